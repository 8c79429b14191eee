"""One host's bring-up as a table of phases: create, boot, connect, pull, start, probes.

Each phase names the state the host is in while it runs and the fleet.toml timeout that bounds it; the
runner moves the host into that state (compare-and-set: if another process moved it, this one stops),
runs the phase under its timeout and records a failure with the phase's name. The host is owned by this
process throughout (its lease renewed by the Context's leases), so housekeeping elsewhere leaves it alone.

What a phase cannot do becomes PhaseFailed; what fails after the instance exists is destroyed by the
caller (fleet/host/teardown.py's fail), whatever the exception.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import asyncssh
import httpx

from fleet.context import Context
from fleet.core import failpoints, tls
from fleet.core.apikeys import new_nonce
from fleet.core.config import ConfigError, Profile, Provider
from fleet.core.models import Host, HostState, utcnow
from fleet.engines import SERVICE_PORT
from fleet.engines.registry import engine_of
from fleet.host import addresses, certificate, hostkey, imageproof, ports, templates
from fleet.host import ops as hostops
from fleet.host.instance import image_pull_s, inside_read_lag, wait_running, wait_stopped
from fleet.host.measure import probe_host
from fleet.host.payloads import payload_of, pull_deadline
from fleet.host.phase import PhaseFailed
from fleet.host.remote import RemoteError, connect
from fleet.market import (
    AuthError,
    CreateFailed,
    CreditSpent,
    Instance,
    InstanceSpec,
    MarketError,
    NotFound,
    Offer,
    OfferGone,
    RateLimited,
)
from fleet.probes import ProbeResult
from fleet.probes.server import Server
from fleet.probes.thermal import sample_card

GRACE_S = 5.0  # a phase's own deadline fires first with its own words; this one is the backstop


class Preempted(PhaseFailed):
    """Another process moved the host out of the state this bring-up expected: it stops touching it."""

    def __init__(self, phase: str, state: str) -> None:
        super().__init__(phase, f"the host left {state} under another process; this bring-up stops", blacklist=False)


@dataclass(frozen=True)
class Phase:
    name: str  # recorded as the failed phase
    state: HostState  # the host's state while the phase runs
    timeout: str | None  # the key in [timeouts] that bounds it (None: create bounds itself)
    run: Callable[[BringUp], Awaitable[None]]


@dataclass
class BringUp:
    ctx: Context
    host: Host
    profile: Profile
    offer: Offer | None  # None when resuming a standby host: there is nothing to rent
    instance: Instance | None = None
    conn: asyncssh.SSHClientConnection | None = None
    files: dict[str, str] = field(default_factory=dict)
    results: list[ProbeResult] = field(default_factory=list)
    standby: bool = False  # for the standby pool: stopped once probed, STANDBY instead of READY
    resume: bool = False  # a standby host started again: no create, no download (the pull verifies), then READY
    pull_limit_s: float = 0.0  # timeouts.pull, or longer on a slow link (payloads.pull_deadline)

    async def run(self) -> None:
        """Every phase in order, then READY (or, for the standby pool, stopped and STANDBY). Raises PhaseFailed
        (or anything else) with the host as it was."""
        timeouts = self.ctx.settings.timeouts
        try:
            for phase in PHASES:
                if self.resume and phase.name == "create":
                    continue
                if self.host.state != phase.state and not self.ctx.record.transition(self.host, phase.state):
                    raise Preempted(phase.name, self.host.state)
                timeout = "standby_start" if self.resume and phase.name == "boot" else phase.timeout
                limit = getattr(timeouts, timeout) if timeout else None
                if phase.name == "pull" and not self.resume:
                    limit = self.pull_limit_s = await pull_deadline(self.ctx, self.host, self.profile)
                if phase.name == "boot" and not self.resume and limit is not None:
                    limit += image_pull_s(self.host, timeouts)  # the image comes down the machine's listed link
                began = time.monotonic()
                try:
                    async with asyncio.timeout(limit + GRACE_S if limit else None):
                        await phase.run(self)
                except TimeoutError:
                    reason = f"not done after {limit:g}s (timeouts.{timeout})"
                    if self.ctx.market.pacer.counters.rate_limited_since(began):
                        # the marketplace kept refusing fleet's calls meanwhile: no sign of this machine's
                        raise PhaseFailed(
                            phase.name, f"{reason}, the marketplace rate-limiting", blacklist=False
                        ) from None
                    raise PhaseFailed(phase.name, reason) from None
                except RateLimited as e:
                    raise PhaseFailed(phase.name, str(e), blacklist=False) from None
                except (asyncssh.Error, OSError, httpx.HTTPError, RemoteError) as e:
                    # the host went away under us (connection lost, reset, refused): this machine failed here
                    raise PhaseFailed(phase.name, f"{type(e).__name__}: {e}") from None
                failpoints.reach(f"after_{phase.name}")
        finally:
            if self.conn is not None:
                self.conn.close()
        if self.standby:
            await self.stop()
            return
        if not self.ctx.record.transition(self.host, HostState.READY, ready_at=utcnow(), owner=None, lease_until=None):
            raise Preempted("probes", self.host.state)

    async def stop(self) -> None:
        """The probed host is stopped for the standby pool: its GPU goes back, its disk and the verified
        weights on it stay (billed at the disk's price). STANDBY once the marketplace reads it `stopped`."""
        assert self.host.instance_id is not None
        if not self.ctx.record.transition(self.host, HostState.STOPPING):
            raise Preempted("stop", self.host.state)
        limit = self.ctx.settings.timeouts.stop
        try:
            async with asyncio.timeout(limit):
                async with self.ctx.waits.on("market"):
                    await self.ctx.market.stop(self.host.instance_id)
                failpoints.reach("mid_stop")
                await wait_stopped(self.ctx, self.host)
        except TimeoutError:
            raise PhaseFailed("stop", f"not stopped after {limit:g}s (timeouts.stop)") from None
        except MarketError as e:
            raise PhaseFailed("stop", str(e)) from None
        if not self.ctx.record.transition(
            self.host, HostState.STANDBY, stopped_at=utcnow(), owner=None, lease_until=None
        ):
            raise Preempted("stop", self.host.state)

    # ---- the phases ------------------------------------------------------------------------------
    async def create(self) -> None:
        ctx, host, offer = self.ctx, self.host, self.offer
        assert offer is not None
        spec = InstanceSpec(
            image=engine_of(self.profile).image(ctx.settings.provider),
            disk_gb=self.profile.disk_gb,
            label=host.label,
            env={},
            ports=[SERVICE_PORT],
            onstart=hostkey.onstart(),
            image_login=image_login(ctx.settings.provider),
        )
        ctx.reporter.info(
            host.name, f"renting offer {offer.id} ({offer.gpu_name}, {offer.geolocation}, ${offer.dph_total:.4f}/h)"
        )

        def sent() -> None:
            ctx.record.update(host, create_sent_at=utcnow())
            failpoints.reach("create_sent")

        try:
            async with ctx.waits.on("market"):
                instance_id = await ctx.market.create(offer.id, spec, on_sent=sent)
        except OfferGone:
            ctx.record.event("answer", "create", "offer gone", host.id)
            raise
        except CreditSpent as e:
            # the account's doing: no machine would rent, none is to blame
            ctx.record.event("answer", "create", json.dumps({"error": str(e)}), host.id)
            raise PhaseFailed("create", str(e), blacklist=False, retry=False) from None
        except CreateFailed as e:
            # vast.ai may have made the contract despite the error: destroy what it names, or what carries
            # our label once its reads catch up. The machine did nothing wrong: next offer, no blacklist.
            ctx.record.event("answer", "create", json.dumps({"error": str(e), "new_contract": e.new_contract}), host.id)
            if e.new_contract is not None:
                ctx.record.update(host, instance_id=e.new_contract)
            raise PhaseFailed("create", str(e), blacklist=False) from None
        except MarketError as e:
            # The create may have been processed: teardown.fail looks for our label, so nothing is left billing.
            ctx.record.event("answer", "create", f"error: {e}", host.id)
            raise PhaseFailed("create", f"{type(e).__name__}: {e}", blacklist=False) from None
        failpoints.reach("create_answered")  # bought, and the id not yet recorded: only the label knows it
        ctx.record.update(host, instance_id=instance_id)
        ctx.record.event("answer", "create", json.dumps({"instance_id": instance_id}), host.id)
        if ctx.key_per_instance:
            try:
                async with ctx.waits.on("market"):
                    await self.attach_key(instance_id)
            except AuthError as e:
                raise PhaseFailed(
                    "create",
                    f"the API key may add fleet's SSH key neither to the account (user_write) nor to the instance "
                    f"(instance_write): {e}",
                    blacklist=False,
                    retry=False,
                ) from None
        ctx.reporter.info(host.name, f"instance {instance_id} created; waiting for it to run")

    async def attach_key(self, instance_id: int) -> None:
        """fleet's SSH key onto the new instance. Its writes lag its create as its reads do: a "not found"
        inside timeouts.instance_visible of the create is asked again."""
        while True:
            try:
                await self.ctx.market.attach_ssh_key(instance_id, self.ctx.ssh_key.public)
                return
            except NotFound as e:
                if not inside_read_lag(self.ctx, self.host.create_sent_at):
                    unknown = f"the new instance is still unknown to the marketplace: {e}"
                    raise PhaseFailed("create", unknown, blacklist=False) from None
            await asyncio.sleep(1.0)

    async def boot(self) -> None:
        self.instance = await wait_running(self.ctx, self.host, resuming=self.resume)
        if self.host.running_at is None:  # the first time it ran: the GPU bills from here (economics/bill.py)
            self.ctx.record.update(self.host, running_at=utcnow())

    async def connect(self) -> None:
        assert self.instance is not None
        endpoint = self.instance.ssh_endpoint()
        service = self.instance.service_endpoint(SERVICE_PORT)
        if endpoint is None or service is None:
            raise PhaseFailed("boot", f"running without an SSH endpoint or a mapping of port {SERVICE_PORT}")
        loopback_ok = self.ctx.settings.provider.is_local
        await addresses.require_resolved(endpoint[0], endpoint[1], loopback_ok=loopback_ok)
        addresses.require(service[0], loopback_ok=loopback_ok)
        if self.host.host_key is None:  # a new host: its key as it announced it (a resumed one keeps its own)
            try:
                async with self.ctx.waits.on("market"):
                    announced = await hostkey.learn(
                        self.ctx.market, self.instance.id, self.ctx.settings.timeouts.host_key
                    )
            except hostkey.HostKeyUnknown as e:
                # two keys: someone else printed one on its console, the machine's doing; none: the logs may be
                # the marketplace's fault as much as the machine's
                raise PhaseFailed("connect", str(e), blacklist=e.conflicting) from None
            self.ctx.record.update(self.host, host_key=announced)  # pinned before first contact
        try:
            async with self.ctx.waits.on("ssh"):
                # the key it announced (the platform's own until onstart has swapped it in)
                self.conn, _ = await connect(
                    endpoint[0],
                    endpoint[1],
                    self.ctx.ssh_key,
                    self.host.host_key,
                    self.ctx.settings.timeouts.ssh,
                    settling=True,
                )
        except RemoteError as e:
            raise PhaseFailed("connect", str(e)) from None
        self.ctx.record.update(self.host, ssh_host=endpoint[0], ssh_port=endpoint[1], connected_at=utcnow())
        try:
            async with self.ctx.waits.on("ssh"):
                await ports.check_service_port(
                    self.conn, service[0], service[1], SERVICE_PORT, self.ctx.settings.timeouts.port_check
                )
        except ports.PortUnreachable as e:
            raise PhaseFailed("connect", str(e)) from None  # the machine's ports: blamed before a pull is paid
        if pinned := engine_of(self.profile).image_proof(self.ctx.settings.provider):
            try:
                async with self.ctx.waits.on("ssh"):
                    await imageproof.prove(self.conn, pinned, self.ctx.settings.timeouts.port_check)
            except (imageproof.ImageNotPinned, RemoteError) as e:
                raise PhaseFailed("connect", str(e)) from None  # this machine's copy of the tag: blamed
        then = "checking the weights it kept" if self.resume else "pulling weights"
        self.ctx.reporter.info(self.host.name, f"SSH {endpoint[0]}:{endpoint[1]} (host key pinned); {then}")

    async def pull(self) -> None:
        assert self.conn is not None
        ctx, host = self.ctx, self.host
        first_progress = [True]
        sizes: dict[str, int] = {}

        def progress(name: str, done: int, total: int) -> None:
            sizes[name] = total
            if first_progress[0] and done:
                first_progress[0] = False
                failpoints.reach("mid_pull")
            ctx.reporter.progress(host.name, name, done, total)

        payload = payload_of(self.profile)
        if self.resume:
            async with ctx.waits.on("pull"):
                self.files = await payload.kept(ctx, self.conn, self.profile)
            return
        limits = (ctx.settings.up.pull_connections, self.pull_limit_s, progress, ctx.settings.timeouts.pull_stall)
        async with ctx.waits.on("pull"):
            self.files = await payload.pull(ctx, self.conn, self.profile, limits)
        ctx.record.update(host, pulled_at=utcnow(), pulled_bytes=sum(sizes.values()))

    async def start(self) -> None:
        assert self.conn is not None and self.instance is not None
        service = self.instance.service_endpoint(SERVICE_PORT)
        assert service is not None
        self.ctx.record.update(self.host, api_key_nonce=new_nonce(), api_key=None)
        api_url = certificate.https_url(service[0], service[1])
        certificate.refuse_held(self.ctx, self.host, api_url)
        async with self.ctx.waits.on("server"):
            certificate_until = certificate.lifetime_end(self.host.contract_end_at)
            await certificate.install(self.conn, self.ctx.ca, service[0], self.host.name, certificate_until)
            self.ctx.record.update(
                self.host, certificate_until=certificate_until, tls_name=tls.host_tls_name(self.host.name)
            )
            await hostops.start_server(
                self.conn,
                self.profile,
                SERVICE_PORT,
                self.files,
                Server(api_url, self.ctx.api_key(self.host), self.ctx.tls, self.host.tls_name),
                self.ctx.settings.timeouts.load,
                await templates.chat_template(self.ctx, self.profile),
            )
        self.ctx.record.update(self.host, api_url=api_url, started_at=utcnow())
        await self.check_card()

    async def check_card(self) -> None:
        """With its server loaded, the host's card by nvidia-smi against the plan; a host without one
        (the local cloud on a CPU) is left alone. The reading is recorded as an event."""
        samples = await sample_card(self.conn)
        if not samples:
            return
        total = sum(s.mem_total_mib or 0 for s in samples)
        used = sum(s.mem_used_mib or 0 for s in samples)
        names = ", ".join(sorted({s.name or "unknown" for s in samples}))
        self.ctx.record.event("card", "loaded", f"{names}: {used:.0f} of {total:.0f} MiB in use", self.host.id)
        problem = await payload_of(self.profile).card_problem(self.ctx, self.profile, samples)
        if problem:
            raise PhaseFailed("start", problem)

    async def probe(self) -> None:
        names = list(self.profile.probes.on_up)
        server = engine_of(self.profile).server_name
        self.ctx.reporter.info(self.host.name, f"{server} up at {self.host.api_url}; probing: {', '.join(names)}")
        results = await probe_host(
            self.ctx, self.host, self.profile, names, self.conn, self.ctx.settings.timeouts.probes
        )
        failed = [r for r in results if not r.passed]
        if failed:
            # keep-alive and the prompt cache are the server build's, the template's and the flags' doing:
            # no other machine would pass them, and this one is not to blame
            software = all(r.name in SOFTWARE_PROBES for r in failed)
            reason = "; ".join(f"{r.name}: {r.diagnosis}" for r in failed)
            raise PhaseFailed(
                "probes",
                reason + (" (the same on every machine: fix the image or the profile)" if software else ""),
                blacklist=not software,
                retry=not software,
            )


def image_login(provider: Provider) -> str | None:
    """The create call's `image_login` for a private image (None for a public one): `-u USER -p TOKEN
    REGISTRY`, the registry being the image's first part when it names a host, else Docker Hub."""
    if not provider.registry_user:
        return None
    token = os.environ.get(provider.registry_token_env, "")
    if not token or any(c.isspace() for c in token):
        raise ConfigError(
            f"provider.registry_user is set: ${provider.registry_token_env} must hold the registry's token (no spaces)"
        )
    first = provider.image.split("/", 1)[0]
    registry = first if "/" in provider.image and ("." in first or ":" in first) else "docker.io"
    return f"-u {provider.registry_user} -p {token} {registry}"


SOFTWARE_PROBES = frozenset({"cache", "keepalive"})

PHASES: tuple[Phase, ...] = (
    Phase("create", HostState.CREATING, None, BringUp.create),
    Phase("boot", HostState.BOOTING, "create_to_running", BringUp.boot),
    Phase("connect", HostState.CONNECTING, "ssh", BringUp.connect),
    Phase("pull", HostState.PULLING, "pull", BringUp.pull),
    Phase("start", HostState.STARTING, "load", BringUp.start),
    Phase("probes", HostState.PROBING, "probes", BringUp.probe),
)
