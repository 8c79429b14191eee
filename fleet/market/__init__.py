"""The marketplace contract: five verbs, plain dataclasses in and out, typed errors.

Each error maps to one policy in the lifecycle:
- OfferGone / NoCapacity: take the next offer;
- RateLimited / Transient: retried here with backoff (Retry-After honoured) before they surface;
- CreateFailed: destroy the contract the answer names (or the one found by label), take the next offer;
- SearchQuotaExceeded: stop, saying when the quota resets; never retried;
- CreditSpent: stop, blaming no machine;
- AuthError / BadRequest / MarketError: stop, after destroying what this attempt created.
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleet.core.errors import FleetError


class MarketError(FleetError, RuntimeError):
    """The marketplace answered something we cannot act on."""

    prefix = "marketplace"


class OfferGone(MarketError):
    """The offer was rented or withdrawn between search and create."""


class NoCapacity(MarketError):
    """The offer exists but cannot be rented now."""


class RateLimited(MarketError):
    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Transient(MarketError):
    """A 5xx or a broken connection: worth retrying, except where the request may have been processed."""


class SearchQuotaExceeded(MarketError):
    """vast.ai's daily search quota is spent; it resets at 00:00 UTC (`reset_at`, epoch seconds)."""

    def __init__(self, message: str, reset_at: float | None = None) -> None:
        super().__init__(message)
        self.reset_at = reset_at


class CreateFailed(MarketError):
    """Create answered an error. vast.ai may have made the contract all the same: `new_contract` is the
    instance its answer names, if any; without one, only a lookup by label can tell."""

    def __init__(self, message: str, new_contract: int | None = None) -> None:
        super().__init__(message)
        self.new_contract = new_contract


class AuthError(MarketError):
    """The API key was refused."""


class CreditSpent(MarketError):
    """The account's credit is spent: vast.ai stops every instance and rents nothing more. No machine is to
    blame, and no retry can succeed until someone pays."""


class BadRequest(MarketError):
    """The marketplace refused our request as malformed."""


class NotFound(MarketError):
    """The marketplace knows no such instance: gone, or (its reads lag a create) not yet known to it."""


@dataclass(frozen=True)
class Offer:
    id: int
    machine_id: int
    gpu_name: str
    num_gpus: int
    gpu_ram_mb: int
    geolocation: str
    dph_total: float
    inet_up_usd_per_gb: float
    inet_down_usd_per_gb: float
    reliability: float
    cuda_max_good: float
    disk_space_gb: float
    direct_port_count: int
    verified: bool
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    compute_cap: int = 0  # CUDA compute capability x 100 (860: an RTX 3090); 0 when the offer does not say
    end_date: float | None = None  # when the machine's contract ends (epoch s): vast.ai stops the instance then
    inet_down_mbps: float = 0.0  # the machine's measured download speed
    datacenter: bool = False  # hosting_type 1: a machine in a certified datacenter
    cpu_arch: str = ""  # the machine's CPU architecture as listed (amd64, arm64); "" when the offer does not say
    cpu_ram_gb: float = 0.0  # the system RAM the instance gets (vast.ai's cpu_ram, MB: its share of the machine's)
    cpu_ghz: float = 0.0  # the machine's CPU clock as listed; 0 when the offer does not say
    cpu_cores: float = 0.0  # the instance's share of the machine's cores (vast.ai's cpu_cores_effective)
    cpu_name: str = ""
    # the machine's public address is fixed (vast.ai's static_ip); a dynamic one may change under a running host,
    # and the instance's PUBLIC_IPADDR "is not updated if the IP changes"
    static_ip: bool = False

    @property
    def country(self) -> str:
        return self.geolocation.strip()[-2:].upper() if self.geolocation else ""

    @classmethod
    def from_raw(cls, row: Any) -> Offer:
        """From a raw vast.ai offer; raises MarketError when it is not an object, a field we filter on is
        missing or of the wrong type, or a number is not finite."""
        if not isinstance(row, dict):
            raise MarketError(f"malformed offer: {type(row).__name__}, not an object")
        try:
            offer = cls(
                id=int(row["id"]),
                machine_id=int(row["machine_id"]),
                gpu_name=_text(row["gpu_name"]),
                num_gpus=int(row["num_gpus"]),
                gpu_ram_mb=int(row.get("gpu_ram") or 0),
                geolocation=_text(row.get("geolocation") or ""),
                dph_total=float(row["dph_total"]),
                inet_up_usd_per_gb=float(row.get("inet_up_cost") or 0.0),
                inet_down_usd_per_gb=float(row.get("inet_down_cost") or 0.0),
                reliability=float(row.get("reliability2", row.get("reliability")) or 0.0),
                cuda_max_good=float(row.get("cuda_max_good") or 0.0),
                disk_space_gb=float(row.get("disk_space") or 0.0),
                direct_port_count=int(row.get("direct_port_count") or 0),
                verified=row.get("verification", "verified" if row.get("verified") else "") == "verified",
                raw=row,
                compute_cap=int(row.get("compute_cap") or 0),
                end_date=float(row["end_date"]) if row.get("end_date") is not None else None,
                inet_down_mbps=float(row.get("inet_down") or 0.0),
                datacenter=row.get("hosting_type") == 1 or row.get("datacenter") is True,
                cpu_arch=_text(row.get("cpu_arch") or "")[:16],
                cpu_ram_gb=float(row.get("cpu_ram") or 0.0) / 1000,
                cpu_ghz=float(row.get("cpu_ghz") or 0.0),
                cpu_cores=float(row.get("cpu_cores_effective") or 0.0),
                cpu_name=_text(row.get("cpu_name") or "")[:80],
                static_ip=row.get("static_ip") is True,
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise MarketError(f"malformed offer {str(row.get('id'))[:40]!r}: {type(e).__name__}: {e}"[:300]) from None
        numbers = (offer.dph_total, offer.inet_up_usd_per_gb, offer.inet_down_usd_per_gb, offer.reliability)
        more = (
            offer.cuda_max_good,
            offer.disk_space_gb,
            offer.inet_down_mbps,
            offer.end_date or 0.0,
            offer.cpu_ram_gb,
            offer.cpu_ghz,
            offer.cpu_cores,
        )
        if not all(math.isfinite(n) for n in (*numbers, *more)):
            raise MarketError(f"malformed offer {offer.id}: a number that is not finite")
        return offer


class Offers(list[Offer]):
    """A search's answer: the offers that parsed, and how many rows did not (skipped, never the whole answer:
    one row with `gpu_name` null or a NaN price said nothing of the others)."""

    malformed: int = 0


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class OfferQuery:
    """What to ask the marketplace for. Its answer is capped at `limit` offers, cheapest first, before fleet
    re-checks any filter (economics/offers.py): every filter it understands goes with the question, so that
    offers fleet would refuse do not fill that window. `pool_only` asks for the region and the card alone
    (`fleet offers --explain` counts there what each filter removes)."""

    countries: list[str]
    min_gpu_ram_mb: int = 0
    allocated_disk_gb: float = 10.0
    limit: int = 1000
    pool_only: bool = False
    min_reliability: float | None = None  # strictly greater
    min_cuda: float | None = None
    min_disk_gb: float | None = None
    min_direct_ports: int | None = None
    max_inet_usd_per_gb: float | None = None  # each way
    verified_only: bool = False
    datacenter_only: bool = False
    static_ip_only: bool = False
    compute_caps: tuple[int, ...] = ()
    min_duration_s: float | None = None  # the contract runs at least this long from now
    min_inet_down_mbps: float | None = None
    max_dph_total: float | None = None
    cpu_arch: str | None = None  # the image's: a machine of another architecture cannot start it
    min_cpu_ram_gb: float | None = None  # the system RAM a host of the profile needs
    min_cpu_ghz: float | None = None  # the CPU clock a host of the profile needs (its server's one thread)
    min_cpu_cores: float | None = None  # the cores a host of the profile needs


@dataclass(frozen=True)
class InstanceSpec:
    image: str
    disk_gb: float
    label: str
    env: dict[str, str]
    ports: list[int]
    onstart: str | None = field(default=None, repr=False)  # carries the host's SSH host key: a secret
    image_login: str | None = field(default=None, repr=False)  # a private registry's login: a secret


@dataclass(frozen=True)
class Maintenance:
    """A maintenance window a machine's host announced: the machine is down from `start` to `end` (epoch s)."""

    machine_id: int
    start: float
    end: float


@dataclass(frozen=True)
class Instance:
    id: int
    status: str | None  # vast.ai's actual_status: None, loading, running, exited, ...
    status_msg: str | None
    label: str | None
    machine_id: int
    dph_total: float
    public_ip: str | None
    ssh_host: str | None  # vast.ai's SSH gateway
    ssh_port: int | None
    ports: dict[int, int]  # container port -> external port on public_ip, once running
    start_date: float | None
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    intended: str | None = None  # vast.ai's intended_status: what the platform is driving it to
    cur_state: str | None = None  # the contract's state: running, stopped, unloaded (destroyed)
    next_state: str | None = None  # where the platform moves the contract next
    contract_end: float | None = None  # when the rental contract ends (epoch s): its host may move it later only

    @property
    def stopped(self) -> bool:
        """Stopped as asked. vast.ai says so in more than one way: `exited` or `stopped` (its status filter knows
        no `stopped`; SkyPilot reads EXITED and STOPPED alike) with `stopped` intended, or, whatever the
        container's own status reads, the contract's states all `stopped` (dstack reads a stop from
        `cur_state`, `intended_status` and `next_state` alone)."""
        if self.cur_state == "stopped" and self.intended == "stopped" and self.next_state in (None, "stopped"):
            return True
        return self.status in STOPPED_STATUSES and (self.intended == "stopped" or self.cur_state == "stopped")

    @property
    def down(self) -> bool:
        """Not serving and not on its way to: exited (as asked, or crashed), stopped, frozen."""
        return self.status in FAILED

    def abandoned(self) -> str | None:
        """Why vast.ai gave up starting it (it sets `stopped` intended, with a message), or None."""
        if self.intended == "stopped" and self.status != "running" and not self.stopped:
            return self.status_msg or "the platform stopped trying to start it"
        return None

    def image_error(self) -> str | None:
        """The image could not be pulled (a wrong name, a private image without its login): the same on
        every machine, so no machine is to blame."""
        msg = self.status_msg or ""
        if self.status in (None, "created", "loading", "exited") and IMAGE_ERRORS.search(msg):
            return msg
        return None

    def disk_error(self) -> str | None:
        """The image did not fit the disk the create call asked for (vast.ai's allocation holds it too)."""
        msg = self.status_msg or ""
        if self.status in (None, "created", "loading", "exited") and DISK_FULL.search(msg):
            return msg
        return None

    def ssh_endpoint(self) -> tuple[str, int] | None:
        """Direct (public IP and the port mapped to 22) when there is one, else the gateway."""
        if self.public_ip and 22 in self.ports:
            return self.public_ip, self.ports[22]
        if self.ssh_host and self.ssh_port:
            return self.ssh_host, self.ssh_port
        return None

    def service_endpoint(self, container_port: int) -> tuple[str, int] | None:
        """Where the outside reaches a container port: the public IP and the port `ports` maps it to
        (`HostIp` says 0.0.0.0, which is no address to connect to)."""
        if not self.public_ip or container_port not in self.ports:
            return None
        return self.public_ip, self.ports[container_port]

    def boot_error(self) -> str | None:
        """The container cannot start (vast.ai leaves such an instance `created`, saying why in status_msg)."""
        msg = self.status_msg or ""
        if self.status in (None, "created", "loading") and any(sign in msg for sign in BOOT_ERRORS):
            return msg
        return None


PENDING = frozenset({None, "created", "loading", "restarting", "rebooting", "scheduling"})
FAILED = frozenset({"exited", "stopped", "frozen"})
STOPPED_STATUSES = frozenset({"exited", "stopped"})
# What show may answer for an instance after its destroy, besides null and 404: a row that says so (vast-cli's
# fixtures and self-test: destroyed, terminated; the docs: cur_state unloaded, "released on destroy").
GONE = frozenset({"destroyed", "terminated"})
# A pull that failed: vast-cli's self-test classifies these messages as docker_pull_failed.
IMAGE_ERRORS = re.compile(
    r"manifest for .* not found|manifest unknown|pull access denied|repository does not exist|no such image|"
    r"unauthorized|authentication required|denied: |"
    # an image built for another CPU (an amd64 image on an arm64 machine): every such machine fails the same way
    r"exec format error|no matching manifest for",
    re.IGNORECASE,
)


DISK_FULL = re.compile(r"no space left on device", re.IGNORECASE)


def reads_gone(row: dict[str, Any]) -> bool:
    """A row show or list answered for an instance that no longer exists."""
    return row.get("actual_status") in GONE or row.get("intended_status") in GONE or row.get("cur_state") == "unloaded"


# A host's heartbeat is late: the instance reads like this for a while and comes back (or does not).
HEARTBEAT_LOST = frozenset({"unknown", "offline"})
BOOT_ERRORS = ("OCI runtime create failed", "Error response from daemon", "failed to create task for container")


class Market(Protocol):
    url: str

    async def search(self, query: OfferQuery) -> Offers:
        """Offers matching the query, as the marketplace filters them (no local re-check).
        Raises MarketError on a malformed answer: an unparseable listing is never "no offers"."""

    async def create(self, offer_id: int, spec: InstanceSpec, on_sent: Callable[[], None] | None = None) -> int:
        """Rent the offer; return the new instance id. OfferGone when it was taken. Never retried
        on an ambiguous answer: a retried create can buy twice. `on_sent` is called as the request leaves
        (after any wait for the rate limit): from then on it may have been processed, whatever happens."""

    async def get(self, instance_id: int) -> Instance | None:
        """The instance, or None when the marketplace does not show it: gone (vast.ai answers null or 404
        after destroy) or not yet visible (its read path lags create by a few seconds)."""

    async def list(self, label_prefix: str) -> list[Instance]:
        """Every instance whose label starts with label_prefix, all pages. Raises MarketError on a
        malformed listing: it never answers "no instances" for an answer it did not understand."""

    async def instances(self, ids: list[int]) -> dict[int, Instance]:
        """The given instances in one listing (a page per 25), for polling many at once. An id missing
        from the answer is gone or not yet visible, as with get."""

    def instance_pages(self, ids: list[int]) -> AsyncIterator[dict[int, Instance]]:
        """The same listing a page at a time, each as it answers: work on the first instances goes on while the
        pages after them are paced."""

    async def attach_ssh_key(self, instance_id: int, public_key: str) -> None:
        """Put a public key on one instance (where the API key may not add one to the account). AuthError
        when the key lacks instance_write; NotFound when the marketplace does not know the instance (yet)."""

    async def logs(self, instance_id: int, tail: int = 200, wait_s: float = 30.0) -> str | None:
        """The last `tail` lines of the instance's logs (its console: what its PID 1 printed), as the marketplace
        gives them a moment after they are asked for; None when they never come within `wait_s`."""

    async def credit(self) -> float | None:
        """The account's available credit in $, or None when the marketplace does not say. At zero vast.ai
        stops every instance and rents nothing more."""

    async def account_env_names(self) -> list[str] | None:
        """The names of the account's own environment variables, which the marketplace puts into every instance
        it rents (vast.ai: `vastai show env-vars`); their values are never kept. None when the key may not read
        them."""

    async def destroy(self, instance_id: int) -> bool:
        """Destroy the instance. Idempotent: an instance already gone is success, answered False (True: it was
        there and is destroyed). A new instance's writes lag its create as its reads do: False inside
        `timeouts.instance_visible` of a create may be an instance the marketplace does not know yet."""

    async def stop(self, instance_id: int) -> None:
        """Stop the instance: its processes end and its GPU is released; its disk, and the weights on it,
        stay and are still billed (vast.ai: "Disk charges continue; no GPU charges"). The answer comes at
        once and the instance reads `stopped` later. Idempotent. MarketError (NotFound) when it is gone."""

    async def start(self, instance_id: int) -> None:
        """Ask a stopped instance to run again. The answer comes at once; the instance then boots as a new
        one does, on new external ports, and may first wait in `scheduling` for as long as someone else
        holds its machine's GPU: watch it, with a deadline. Idempotent. MarketError (NotFound) when gone."""

    async def close(self) -> None: ...
