"""Faults on demand: what the local cloud should get wrong next, from `faults.json` or the admin API.

Request faults (`rate_limit`, `server_error`) and `pull_reset` fire for the next `count`
matching requests, or for a `share` of them (seeded, so runs repeat). Host faults are keyed by
machine id, so a test can aim at an offer before anyone rents it.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleet.localcloud.instances import Instance


@dataclass
class RequestFault:
    count: int = 0
    share: float = 0.0
    paths: list[str] = field(default_factory=list)  # path prefixes; empty = every API path
    status: int = 429
    retry_after: str | None = None  # a 429's Retry-After header, as given (any text: a marketplace's words)
    methods: list[str] = field(default_factory=list)  # HTTP methods; empty = every method

    def applies(self, path: str, method: str = "") -> bool:
        if self.methods and method.upper() not in self.methods:
            return False
        return not self.paths or any(path.startswith(p) for p in self.paths)


@dataclass
class SlowAnswer:
    """Answer late: the request is processed at once, its answer held back `delay_s` (a client that gives
    up first does not know whether it was done)."""

    count: int = 0
    share: float = 0.0
    paths: list[str] = field(default_factory=list)
    delay_s: float = 5.0

    def applies(self, path: str, method: str = "") -> bool:
        return not self.paths or any(path.startswith(p) for p in self.paths)


@dataclass
class PullReset:
    """The next `count` downloads longer than `after_bytes` are cut there. `expire_url`: the cut also ends the
    signed URL's life, as a pull that outlives its URL sees on the real hub (every retry of it is refused)."""

    after_bytes: int = 0
    count: int = 0
    expire_url: bool = False


@dataclass
class PullStall:
    """The next `count` downloads of these files (whole-file requests, not a header read's ranges) send their
    headers and then nothing, ever."""

    files: list[str] = field(default_factory=list)
    count: int = 1


@dataclass
class DecodeSag:
    start_after_s: float = 0.0
    ramp_s: float = 60.0
    max_stop_share: float = 0.6  # share of each 100 ms the llama-server is stopped at full sag

    def stop_share(self, running_for_s: float) -> float:
        t = running_for_s - self.start_after_s
        if t <= 0:
            return 0.0
        return min(self.max_stop_share, self.max_stop_share * t / max(self.ramp_s, 1e-9))


@dataclass
class HeartbeatGap:
    after_s: float = 2.0  # after the instance runs
    for_s: float = 3.0
    status: str = "offline"  # or "unknown"


@dataclass
class Faults:
    rate_limit: RequestFault | None = None
    server_error: RequestFault | None = None
    vanish_at_create: list[int] = field(default_factory=list)
    stuck_loading: list[int] = field(default_factory=list)
    exit_after_s: dict[int, float] = field(default_factory=dict)
    disappear_after_s: dict[int, float] = field(default_factory=dict)
    pull_reset: PullReset | None = None
    corrupt_files: list[str] = field(default_factory=list)  # hub file names served with one byte flipped
    decode_sag: dict[int, DecodeSag] = field(default_factory=dict)
    oci_error: list[int] = field(default_factory=list)  # machines whose container never starts
    heartbeat_gap: dict[int, HeartbeatGap] = field(default_factory=dict)
    reprice_at_create: dict[int, float] = field(default_factory=dict)  # offer id -> factor on its GPU price
    create_error_with_contract: int = 0  # the next N creates answer an error naming the contract they made
    # the next N destroys answer HTTP 200 with `success: false` and destroy nothing (dstack raises on such an
    # answer unless its error is no_such_instance; the error's name here is ours)
    destroy_refused: int = 0
    # machines whose instances' logs hold the platform's lines alone, none of the container's console
    logs_without_console: list[int] = field(default_factory=list)
    # how long a new instance is unknown to reads and writes by id (None: the settings' 3 s)
    read_lag_s: float | None = None
    search_quota_left: int | None = None  # searches left today (None: the default quota)
    slow: SlowAnswer | None = None
    pull_stall: PullStall | None = None
    offline_after_s: dict[int, float] = field(default_factory=dict)  # machine -> its network goes, for good
    host_key_change: list[int] = field(default_factory=list)  # machines whose SSH host key is made anew now
    address_change: list[int] = field(default_factory=list)  # machines whose dynamic public address changes now
    # machine -> the instance whose published ports its listing names instead of its own (a lying listing: the
    # marketplace's word for where a host serves is all fleet has)
    lying_ports: dict[int, int] = field(default_factory=dict)
    # machines' announced maintenance windows: machine -> [start (epoch s), duration (hours)]; an instance there
    # goes offline for the window (the machine is down)
    maintenances: dict[int, list[float]] = field(default_factory=dict)
    # `show maints` is a host's command (vast-cli: "[Host] Show maintenance information for host machines"):
    # a renter's key is refused unless this says the marketplace answers renters too
    renter_reads_maintenances: bool = False
    # images' compressed sizes (bytes) beside the local cloud's own table: what a create's pull downloads
    image_sizes: dict[str, int] = field(default_factory=dict)
    # how long an expired instance is kept before vast.ai deletes it (None: its 48 h)
    expired_kept_s: float | None = None
    # machines whose sshd never takes the host key fleet-host-key installs and announces: someone else answers
    foreign_host_key: list[int] = field(default_factory=list)
    # machines whose listed ports, but SSH's, lead nowhere: nothing answers there (SkyPilot: direct ports listed
    # and unreachable)
    unreachable_ports: list[int] = field(default_factory=list)
    # machines on whose console someone else announces a host key of theirs before onstart announces the host's
    forged_host_key: list[int] = field(default_factory=list)
    freeze_server: list[int] = field(
        default_factory=list
    )  # machines (set before renting) whose llama-server never starts
    # machines that boot a stale copy of the image's tag: another build's programs and manifest
    stale_image: list[int] = field(default_factory=list)
    # machines whose GPU another renter took while our instance there was stopped: a start waits in
    # `scheduling` until the fault is cleared (vast.ai: "subject to resource availability on the machine")
    gpu_taken: list[int] = field(default_factory=list)
    # images the registry does not have (a wrong tag): the pull fails on every machine
    missing_images: list[str] = field(default_factory=list)
    # private images: image -> the login (vast.ai's `-u USER -p TOKEN REGISTRY`) a create must carry to pull it
    private_images: dict[str, str] = field(default_factory=dict)
    credit_usd: float | None = None  # the account's starting credit (None: the default); at 0 vast.ai stops all
    # how far below zero the balance may go before vast.ai deletes every instance of an account with no card
    # (None: a share of the account's average daily spend, as vast.ai sizes it)
    credit_buffer_usd: float | None = None
    # API keys with only some permissions (vast.ai's scoped keys): key -> its permissions (user_write, ...)
    scoped_keys: dict[str, list[str]] = field(default_factory=dict)
    # gated model repos: repo -> the Hugging Face token that opens it (401 GatedRepo without it)
    gated_repos: dict[str, str] = field(default_factory=dict)
    signed_url_ttl_s: float | None = None  # how long the hub's signed CDN URLs last (None: hub.SIGNED_URL_TTL_S)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Faults:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown fault(s): {', '.join(sorted(unknown))}")
        return cls(
            rate_limit=RequestFault(**data["rate_limit"]) if data.get("rate_limit") else None,
            server_error=RequestFault(**{"status": 503, **data["server_error"]}) if data.get("server_error") else None,
            vanish_at_create=[int(x) for x in data.get("vanish_at_create", [])],
            stuck_loading=[int(x) for x in data.get("stuck_loading", [])],
            exit_after_s={int(k): float(v) for k, v in data.get("exit_after_s", {}).items()},
            disappear_after_s={int(k): float(v) for k, v in data.get("disappear_after_s", {}).items()},
            pull_reset=PullReset(**data["pull_reset"]) if data.get("pull_reset") else None,
            corrupt_files=[str(x) for x in data.get("corrupt_files", [])],
            decode_sag={int(k): DecodeSag(**v) for k, v in data.get("decode_sag", {}).items()},
            oci_error=[int(x) for x in data.get("oci_error", [])],
            heartbeat_gap={int(k): HeartbeatGap(**v) for k, v in data.get("heartbeat_gap", {}).items()},
            reprice_at_create={int(k): float(v) for k, v in data.get("reprice_at_create", {}).items()},
            create_error_with_contract=int(data.get("create_error_with_contract", 0)),
            destroy_refused=int(data.get("destroy_refused", 0)),
            logs_without_console=[int(x) for x in data.get("logs_without_console", [])],
            read_lag_s=float(data["read_lag_s"]) if data.get("read_lag_s") is not None else None,
            search_quota_left=int(data["search_quota_left"]) if data.get("search_quota_left") is not None else None,
            slow=SlowAnswer(**data["slow"]) if data.get("slow") else None,
            pull_stall=PullStall(**data["pull_stall"]) if data.get("pull_stall") else None,
            offline_after_s={int(k): float(v) for k, v in data.get("offline_after_s", {}).items()},
            host_key_change=[int(x) for x in data.get("host_key_change", [])],
            address_change=[int(x) for x in data.get("address_change", [])],
            lying_ports={int(k): int(v) for k, v in data.get("lying_ports", {}).items()},
            expired_kept_s=float(data["expired_kept_s"]) if data.get("expired_kept_s") is not None else None,
            image_sizes={str(k): int(v) for k, v in data.get("image_sizes", {}).items()},
            maintenances={int(k): [float(v[0]), float(v[1])] for k, v in data.get("maintenances", {}).items()},
            renter_reads_maintenances=bool(data.get("renter_reads_maintenances", False)),
            foreign_host_key=[int(x) for x in data.get("foreign_host_key", [])],
            forged_host_key=[int(x) for x in data.get("forged_host_key", [])],
            unreachable_ports=[int(x) for x in data.get("unreachable_ports", [])],
            freeze_server=[int(x) for x in data.get("freeze_server", [])],
            gpu_taken=[int(x) for x in data.get("gpu_taken", [])],
            stale_image=[int(x) for x in data.get("stale_image", [])],
            missing_images=[str(x) for x in data.get("missing_images", [])],
            private_images={str(k): str(v) for k, v in data.get("private_images", {}).items()},
            credit_usd=float(data["credit_usd"]) if data.get("credit_usd") is not None else None,
            credit_buffer_usd=float(data["credit_buffer_usd"]) if data.get("credit_buffer_usd") is not None else None,
            scoped_keys={str(k): [str(p) for p in v] for k, v in data.get("scoped_keys", {}).items()},
            gated_repos={str(k): str(v) for k, v in data.get("gated_repos", {}).items()},
            signed_url_ttl_s=float(data["signed_url_ttl_s"]) if data.get("signed_url_ttl_s") is not None else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FaultDice:
    """Decides whether a request fault fires now; consumes counts."""

    def __init__(self, seed: int = 7) -> None:
        self._rng = random.Random(seed)

    def fire(self, fault: RequestFault | SlowAnswer | None, path: str, method: str = "") -> bool:
        if fault is None or not fault.applies(path, method):
            return False
        if fault.count > 0:
            fault.count -= 1
            return True
        return fault.share > 0 and self._rng.random() < fault.share


def late_heartbeat(faults: Faults, inst: Instance, strict: bool, now: float) -> str | None:
    """`offline`/`unknown` while the host's heartbeat is late, or None. A fault names a machine; without
    one, every third instance of a strict cloud misses its heartbeat once, soon after it runs."""
    if inst.status != "running" or inst.running_at is None:
        return None
    gap = faults.heartbeat_gap.get(inst.machine_id)
    if gap is None and strict and inst.id % 3 == 0:
        gap = HeartbeatGap(after_s=2.0, for_s=3.0, status="offline" if inst.id % 2 else "unknown")
    if gap and gap.after_s <= now - inst.running_at < gap.after_s + gap.for_s:
        return gap.status
    return None
