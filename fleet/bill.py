"""What a session cost: per host, the hours billed, the GPU rent and the traffic at the profile's expected
rate (the host's effective $/h less its rent), and the total. `fleet destroy` ends with it, so a
benchmark session closes with its numbers. Pure."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from fleet.models import Host


@dataclass(frozen=True)
class BillLine:
    host: str
    gpu_name: str
    geolocation: str
    hours: float
    rent_usd: float  # dph_total x hours (the closed cost once destroyed): GPU, disk, all vast.ai bills hourly
    traffic_usd: float  # the profile's expected GB/h at the machine's $/GB, x hours
    total_usd: float


@dataclass(frozen=True)
class Bill:
    lines: list[BillLine]
    total_usd: float

    def as_dict(self) -> dict[str, object]:
        return {"hosts": [asdict(line) for line in self.lines], "total_usd": self.total_usd}


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def bill(hosts: list[Host], now: datetime) -> Bill:
    """Each host's cost from its create to its destroy (or `now` while it still bills)."""
    lines = []
    for h in hosts:
        hours = max((_utc(h.destroyed_at or now) - _utc(h.created_at)).total_seconds(), 0.0) / 3600
        rent = h.accrued_usd if h.accrued_usd is not None else h.dph_total * hours  # closed: what the record says
        traffic = max(h.effective_usd_per_hour - h.dph_total, 0.0) * hours
        lines.append(BillLine(h.name, h.gpu_name, h.geolocation, hours, rent, traffic, rent + traffic))
    return Bill(lines, sum(line.total_usd for line in lines))
