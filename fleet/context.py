"""Context: what every controller (fleet/control/) and every host step (fleet/host/) is handed.

It carries the settings, the record, the marketplace, the reporter people or logs read, and this
process as an owner with its leases; plus what one process keeps while it runs: the shared listing of
instances in flight, the GGUF headers and chat templates it read, and the seconds it spent waiting on
the outside world. It holds no verbs: those are functions of the modules that take a Context.

`open_context` assembles one from fleet.toml: the marketplace endpoint (the local cloud, started on
demand, or vast.ai with its key), the database (migrated), fleet's own SSH key and the CA that signs its
hosts' certificates (both made on first use).
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol, TypeVar

from sqlalchemy.exc import DBAPIError

from fleet.core.apikeys import ensure_secret, host_api_key
from fleet.core.config import ConfigError, Settings
from fleet.core.keys import SshKey, ensure_key
from fleet.core.marketpace import claim_turn, release_turn
from fleet.core.models import LABEL_PREFIX, Host
from fleet.core.ownership import context_owner
from fleet.core.record import Record, open_database
from fleet.core.tls import CertificateAuthority, client_context, ensure_ca, load_certificate, public_key_sha256
from fleet.localcloud import control as local_cloud
from fleet.market.pacing import Pace
from fleet.market.vast import VastMarket
from fleet.market.watch import InstanceWatch
from fleet.plan.gguf import GgufHeader
from fleet.plan.snapshot import Snapshot
from fleet.probes.server import Server

C = TypeVar("C", bound="Context")


class Reporter(Protocol):
    def info(self, host: str, message: str) -> None: ...

    def progress(self, host: str, what: str, done: int, total: int) -> None: ...


class QuietReporter:
    def info(self, host: str, message: str) -> None:
        pass

    def progress(self, host: str, what: str, done: int, total: int) -> None:
        pass


@dataclass
class Waits:
    """Seconds spent waiting on the outside world, by kind (for bench/up_overhead.py)."""

    seconds: dict[str, float] = field(default_factory=dict)

    @asynccontextmanager
    async def on(self, kind: str) -> AsyncIterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - started


class Leases:
    """This process's hold on the hosts it works on (fleet/core/ownership.py): a claim takes a host, and
    one task renews every lease the owner holds while the Context is open."""

    def __init__(self, record: Record, lease_s: float, owner: str) -> None:
        self.record = record
        self.lease_s = lease_s
        self.owner = owner
        self._renewal: asyncio.Task | None = None

    def claim(self, host: Host) -> bool:
        """Own the host, and keep its lease renewed while this Context runs. False: another live process
        works on it now."""
        if not self.record.claim(host, self.lease_s, self.owner):
            return False
        if self._renewal is None or self._renewal.done():
            self._renewal = asyncio.get_running_loop().create_task(self._renew(), name="leases")
        return True

    def release(self, host: Host) -> None:
        self.record.release(host, self.owner)

    async def _renew(self) -> None:
        wait = self.lease_s / 3
        while True:
            await asyncio.sleep(wait)
            try:
                self.record.renew(self.lease_s, self.owner)
                wait = self.lease_s / 3
            except DBAPIError:
                # the database stayed busy past its timeout (a daemon, a reconcile and several `fleet up` write
                # at once): the lease has time left, so try again soon. A renewal task that died here let the
                # leases run out mid-bring-up and a reconcile fail the hosts as interrupted.
                wait = min(1.0, self.lease_s / 3)

    def close(self) -> None:
        if self._renewal is not None:
            self._renewal.cancel()


class InstallBudget:
    """The marketplace's `Budget` (fleet/market/pacing.py) in this install's record, which the daemon and every
    command beside it draw on (fleet/core/marketpace.py)."""

    def __init__(self, record: Record, market_url: str, request_timeout_s: float) -> None:
        self._record = record
        self._url = market_url.rstrip("/")
        self._request_timeout_s = request_timeout_s

    async def claim(self, endpoint: str, pace: Pace) -> tuple[float | None, float]:
        # a call in flight holds the turn at most its request's timeout and interval (its process may die)
        hold = self._request_timeout_s + pace.interval_s
        claim = partial(claim_turn, self._record, f"{endpoint} {self._url}", pace.interval_s, pace.per_minute)
        return await asyncio.to_thread(claim, None, hold)  # the record's clock: every machine's the same

    async def release(self, endpoint: str, pace: Pace, token: float) -> None:
        release = partial(release_turn, self._record, f"{endpoint} {self._url}", token, pace.interval_s)
        await asyncio.to_thread(release, None)


class Context:
    """What a controller or a host step works with; see the module's docstring. The marketplace (and with it,
    for the local provider, the local cloud) and fleet's SSH key are opened the first time a step needs them:
    `fleet status` reads the record and starts nothing."""

    def __init__(
        self,
        settings: Settings,
        record: Record,
        market: VastMarket | None = None,
        ssh_key: SshKey | None = None,
        hub_url: str | None = None,
        reporter: Reporter | None = None,
    ) -> None:
        self.settings = settings
        self.record = record
        self.reporter: Reporter = reporter or QuietReporter()
        self.owner = context_owner()
        # every instance this install rents is labelled so; reconcile takes only such strays
        self.label_prefix = f"{LABEL_PREFIX}{record.install_id()}:"
        self.leases = Leases(record, settings.up.lease_s, self.owner)
        self.waits = Waits()
        self.headers: dict[str, GgufHeader] = {}  # by URL: a file at a pinned revision never changes
        self.templates: dict[str, tuple[str | None, str]] = {}  # by profile: (text, where it came from)
        self.snapshots: dict[str, Snapshot] = {}  # by repo@revision: the hub's listing, read once per process
        # an API key that may not add fleet's SSH key to the account (no user_write) attaches it to each instance
        self.key_per_instance = False
        self._market = market
        self._ssh_key = ssh_key
        self._hub_url = hub_url.rstrip("/") if hub_url else None
        self._watch: InstanceWatch | None = None
        self._ca: CertificateAuthority | None = None
        self._tls: ssl.SSLContext | None = None
        self._key_secret: bytes | None = None
        # what runs after the hosts a process serves changed (fleet/host/endpoints.py's publish): app.py
        # hangs the gateway's apply here, which the host steps below it cannot import
        self.on_hosts_changed: list[Callable[[Context], Awaitable[object]]] = []
        self.publishing = asyncio.Lock()  # fleet/host/endpoints.py's publish, one at a time
        # whether this machine's gateway is the agents' door to a host (its key then stays out of the endpoints
        # file): app.py asks the gateway, which the host steps cannot import
        self.gateway_serves: Callable[[Host], bool] = lambda host: False
        self.permissions_checked = False  # the marketplace key's permissions, read once a process (control/up.py)

    @property
    def market(self) -> VastMarket:
        if self._market is None:
            endpoint = resolve(self.settings, self.reporter)
            provider = self.settings.provider
            self._market = VastMarket(
                endpoint.url,
                endpoint.api_key,
                timeout_s=provider.request_timeout_s,
                create_timeout_s=provider.create_timeout_s,
                budget=InstallBudget(self.record, endpoint.url, provider.request_timeout_s),
                rate_limited_wait_s=provider.rate_limited_wait_s,
                attempts=provider.error_attempts,
            )
            self._hub_url = self._hub_url or self.settings.hub_url(endpoint.local_cloud_url).rstrip("/")
        return self._market

    @market.setter
    def market(self, market: VastMarket) -> None:
        self._market = market

    @property
    def hub_url(self) -> str:
        """Where model files come from: the local cloud's hub needs the local cloud; Hugging Face does not."""
        if self._hub_url is None:
            if self.settings.provider.is_local and self.settings.hub.url == "auto":
                _ = self.market  # the local cloud serves the hub: start it
            else:
                self._hub_url = self.settings.hub_url(None).rstrip("/")
        assert self._hub_url is not None
        return self._hub_url

    @property
    def watch(self) -> InstanceWatch:
        """One listing for every instance in flight (fleet/market/watch.py)."""
        if self._watch is None:
            self._watch = InstanceWatch(self.market, self.settings.provider.poll_max_interval_s)
        return self._watch

    @watch.setter
    def watch(self, watch: InstanceWatch) -> None:
        self._watch = watch

    @property
    def ssh_key(self) -> SshKey:
        """fleet's own SSH key, made beside the database on first use."""
        if self._ssh_key is None:
            self._ssh_key = ensure_key(ssh_key_path(self.settings))
        return self._ssh_key

    @property
    def ca(self) -> CertificateAuthority:
        """fleet's CA, with its key: it signs every host's certificate. Made beside fleet's SSH key on first use,
        and named in the record then: a machine without that CA (a new state directory, a gateway's machine
        given no key) refuses to make another, whose certificates no client of the install would trust."""
        if self._ca is None:
            directory = tls_dir(self.settings)
            named = self.record.ca_sha256()
            if named is not None and not (directory / "ca.key").exists():
                raise ConfigError(
                    f"fleet's CA key is not on this machine ({directory / 'ca.key'}) and this install's record names"
                    f" its CA ({named[:16]}...): copy ca.key and ca.pem from the machine that made them (a gateway"
                    " needs only ca.pem: docs/security.md)"
                )
            ca = ensure_ca(directory, f"fleet CA {self.label_prefix.rstrip(':')}")
            self._check_named(public_key_sha256(ca.certificate), directory)
            self._ca = ca
        return self._ca

    @property
    def ca_file(self) -> Path:
        """fleet's CA certificate, all a client of the hosts needs: on a machine without the CA's key (a
        gateway's), the ca.pem copied there, provided it is the CA the record names."""
        if self._ca is None:
            directory = tls_dir(self.settings)
            certificate = load_certificate(directory / "ca.pem")
            if certificate is not None and not (directory / "ca.key").exists():
                self._check_named(public_key_sha256(certificate), directory)
                return directory / "ca.pem"
        return self.ca.certificate_path

    def _check_named(self, sha256: str, directory: Path) -> None:
        named = self.record.claim_ca(sha256)
        if named != sha256:
            raise ConfigError(
                f"the CA in {directory} ({sha256[:16]}...) is not the one this install's hosts trust"
                f" ({named[:16]}...): copy ca.key and ca.pem from the machine that made them"
            )

    @property
    def tls(self) -> ssl.SSLContext:
        """What every client of a host verifies it with: fleet's CA alone."""
        if self._tls is None:
            self._tls = client_context(self.ca_file)
        return self._tls

    def api_key(self, host: Host) -> str | None:
        """The host's llama-server key, derived from the secret beside fleet's SSH key and the host's nonce."""
        if host.api_key_nonce is None:
            return host.api_key  # started before keys were derived
        return host_api_key(self.key_secret, host.name, host.api_key_nonce)

    @property
    def key_secret(self) -> bytes:
        """The secret beside fleet's SSH key that every key fleet derives comes from (never in the record)."""
        if self._key_secret is None:
            self._key_secret = ensure_secret(key_secret_path(self.settings))
        return self._key_secret

    def server(self, host: Host) -> Server:
        """How to reach a host's llama-server: its URL, its key, its certificate checked against fleet's CA."""
        return Server(host.api_url or "", self.api_key(host), self.tls, host.tls_name)

    async def close(self) -> None:
        self.leases.close()
        if self._watch is not None:
            await self._watch.close()
        if self._market is not None:
            await self._market.close()


@dataclass(frozen=True)
class Endpoint:
    url: str
    api_key: str
    local_cloud_url: str | None  # the local cloud's own URL (its hub too), when the provider is local


def resolve(settings: Settings, reporter: Reporter | None = None) -> Endpoint:
    """Where the marketplace is and the key for it. Starts the local cloud when the provider is local and it
    does not run, and says so."""
    if settings.provider.is_local:
        directory = local_cloud.default_state_dir()
        if local_cloud.find(directory) is None and reporter is not None:
            reporter.info("fleet", f"starting the local cloud (its state: {directory}; `fleet cloud stop` ends it)")
        info = local_cloud.start(directory)
        return Endpoint(info.url, info.api_key(), info.url)
    key = os.environ.get(settings.provider.api_key_env)
    if not key:
        path = Path(os.path.expanduser(settings.provider.api_key_file))
        if path.exists():
            key = path.read_text().strip()
    if not key:
        raise ConfigError(
            f"{settings.source}: provider.api_key_env: no API key in ${settings.provider.api_key_env} "
            f"nor in {settings.provider.api_key_file}"
        )
    return Endpoint(settings.provider.url, key, None)


def ssh_key_path(settings: Settings) -> Path:
    return settings.database.file.parent / "ssh" / "id_ed25519"


def tls_dir(settings: Settings) -> Path:
    return settings.database.file.parent / "tls"


def key_secret_path(settings: Settings) -> Path:
    return settings.database.file.parent / "secret" / "host-api-keys"


@asynccontextmanager
async def open_context(
    settings: Settings, reporter: Reporter | None = None, kind: type[C] = Context
) -> AsyncIterator[C]:
    """A Context (or `kind`, a subclass) for these settings, closed with everything it opened."""
    engine = open_database(settings.database.target)
    ctx = kind(settings, Record(engine), reporter=reporter)
    try:
        yield ctx
    finally:
        await ctx.close()
        engine.dispose()
