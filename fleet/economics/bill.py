"""What a session cost: per host, the hours billed, the GPU rent and the traffic at the profile's expected
rate (the host's effective $/h less its rent), and the total. `fleet destroy` ends with it, so a
benchmark session closes with its numbers. Pure."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime

from fleet.core.models import Host, as_utc, utcnow


@dataclass(frozen=True)
class BillLine:
    host: str
    gpu_name: str
    geolocation: str
    hours: float
    standby_hours: float  # of those, stopped: the disk alone billed
    rent_usd: float  # dph_total x running hours + the disk's $/h x stopped hours (the closed cost once destroyed)
    traffic_usd: float  # the profile's expected GB/h at the machine's $/GB, x hours
    total_usd: float


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


def accrued_usd(host: Host, now: datetime | None = None) -> float:
    """What the host's rent came to: its $/h while running, its disk's $/h while stopped (vast.ai: "Disk
    charges continue; no GPU charges")."""
    stopped = stopped_hours(host, now)
    return host.dph_total * max(hours_billed(host, now) - stopped, 0.0) + host.storage_usd_per_hour * stopped


def bill(hosts: list[Host], now: datetime) -> Bill:
    """Each host's cost from its create to its destroy (or `now` while it still bills)."""
    lines = []
    for h in hosts:
        hours = hours_billed(h, now)
        rent = h.accrued_usd if h.accrued_usd is not None else accrued_usd(h, now)  # closed: what the record says
        standby = stopped_hours(h, now)
        # traffic at the profile's rate while it serves; a stopped host serves nothing
        traffic = max(h.effective_usd_per_hour - h.dph_total, 0.0) * max(hours - standby, 0.0)
        lines.append(BillLine(h.name, h.gpu_name, h.geolocation, hours, standby, rent, traffic, rent + traffic))
    return Bill(lines, sum(line.total_usd for line in lines))
