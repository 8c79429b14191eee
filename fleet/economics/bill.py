"""What a session cost: per host, the hours billed, the rent (the GPU while it runs; the disk while it loads
and while it is stopped), the pull's traffic (every byte is billed, vast.ai's FAQ), the serving traffic at
the profile's expected rate (the host's effective $/h less its rent), and the total. `fleet destroy` ends
with it, so a benchmark session closes with its numbers. Pure."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime

from fleet.core.models import Host, as_utc, utcnow

GB = 1e9  # vast.ai prices traffic in $/GB
# the start of the reason a standby host is closed with when vast.ai deleted its stopped instance: its disk and
# the files on it are gone, and with them what the pool had paid to keep
LOST_FROM_POOL = "lost from the standby pool"


@dataclass(frozen=True)
class BillLine:
    host: str
    gpu_name: str
    geolocation: str
    hours: float
    standby_hours: float  # of those, stopped: the disk alone billed
    rent_usd: float  # dph_total x running hours + the disk's $/h x the hours it loaded or was stopped
    pull_usd: float  # the image's and the model files' bytes at the machine's download $/GB
    traffic_usd: float  # the profile's expected GB/h at the machine's $/GB, x serving hours
    total_usd: float
    lost: str | None = None  # what was lost with it, when vast.ai deleted a host the pool kept


@dataclass(frozen=True)
class Bill:
    lines: list[BillLine]
    total_usd: float

    def as_dict(self) -> dict[str, object]:
        return {"hosts": [asdict(line) for line in self.lines], "total_usd": self.total_usd}


def hours_billed(host: Host, now: datetime | None = None) -> float:
    """From the host's create to its destroy (or `now` while it still bills)."""
    end = host.destroyed_at or now or utcnow()
    return max((as_utc(end) - as_utc(host.created_at)).total_seconds(), 0.0) / 3600


def stopped_hours(host: Host, now: datetime | None = None) -> float:
    """Of the hours billed, those its instance spent stopped (ended stops and the one under way)."""
    current = 0.0
    if host.stopped_at is not None:
        end = host.destroyed_at or now or utcnow()
        current = max((as_utc(end) - as_utc(host.stopped_at)).total_seconds(), 0.0) / 3600
    return host.stopped_hours + current


def loading_hours(host: Host, now: datetime | None = None) -> float:
    """Of the hours billed, those before its instance first ran (vast.ai bills no GPU while it loads)."""
    end = host.running_at or host.destroyed_at or now or utcnow()
    return max((as_utc(end) - as_utc(host.created_at)).total_seconds(), 0.0) / 3600


def pull_usd(host: Host) -> float:
    """What downloading its image and its model files cost: vast.ai bills "every byte sent or received ...
    regardless of what state it is in"."""
    return ((host.pulled_bytes or 0) + host.image_bytes) / GB * host.inet_down_usd_per_gb


def rent_usd(host: Host, now: datetime | None = None) -> float:
    """The GPU's $/h while it runs; the disk's $/h while it loads and while it is stopped (vast.ai: "Disk
    charges continue; no GPU charges"; "not charged during loading")."""
    idle = min(stopped_hours(host, now) + loading_hours(host, now), hours_billed(host, now))
    return host.dph_total * (hours_billed(host, now) - idle) + host.storage_usd_per_hour * idle


def accrued_usd(host: Host, now: datetime | None = None) -> float:
    """What the marketplace bills for the host: its rent and its pull."""
    return rent_usd(host, now) + pull_usd(host)


def bill(hosts: list[Host], now: datetime) -> Bill:
    """Each host's cost from its create to its destroy (or `now` while it still bills)."""
    lines = []
    for h in hosts:
        hours = hours_billed(h, now)
        pull = pull_usd(h)
        # closed: what the record says it came to
        rent = h.accrued_usd - pull if h.accrued_usd is not None else rent_usd(h, now)
        standby = stopped_hours(h, now)
        # traffic at the profile's rate while it serves; a stopped host serves nothing
        serving = max(hours - standby - loading_hours(h, now), 0.0)
        traffic = max(h.effective_usd_per_hour - h.dph_total, 0.0) * serving
        total = rent + pull + traffic
        lost = h.failure_reason if (h.failure_reason or "").startswith(LOST_FROM_POOL) else None
        lines.append(BillLine(h.name, h.gpu_name, h.geolocation, hours, standby, rent, pull, traffic, total, lost))
    return Bill(lines, sum(line.total_usd for line in lines))
