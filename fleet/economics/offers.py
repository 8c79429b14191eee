"""The filter funnel and the ranking: pure functions over Offer records.

The marketplace is asked for a pool (region, GPU memory); every filter, those two included, is
checked here, so a marketplace that ignores a filter cannot rent us a host in the wrong country,
and the funnel can say how many offers each filter removed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fleet.core.config import Filters, Profile
from fleet.market import Offer, OfferQuery


@dataclass(frozen=True)
class Criteria:
    countries: frozenset[str]
    filters: Filters
    min_gpu_ram_gb: float
    max_usd_per_hour: float | None = None
    excluded_machines: frozenset[int] = frozenset()


@dataclass
class Funnel:
    """How many offers each filter removed, in order, so an empty result explains itself."""

    seen: int = 0
    offers: list[Offer] = field(default_factory=list)  # everything the marketplace returned
    removed: list[tuple[str, int]] = field(default_factory=list)
    passed: list[Offer] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "seen": self.seen,
            "removed": [{"filter": n, "count": c} for n, c in self.removed],
            "passed": len(self.passed),
        }


def _checks(c: Criteria) -> list[tuple[str, Callable[[Offer], bool]]]:
    f = c.filters
    checks: list[tuple[str, Callable[[Offer], bool]]] = [
        (f"region ({len(c.countries)} countries)", lambda o: o.country in c.countries),
        (f"reliability > {f.min_reliability}", lambda o: o.reliability > f.min_reliability),
        (f"CUDA >= {f.min_cuda}", lambda o: o.cuda_max_good >= f.min_cuda),
        (f"disk >= {f.min_disk_gb:g} GB", lambda o: o.disk_space_gb >= f.min_disk_gb),
        (f"direct ports >= {f.min_direct_ports}", lambda o: o.direct_port_count >= f.min_direct_ports),
        (
            f"traffic <= ${f.max_inet_usd_per_gb}/GB each way",
            lambda o: o.inet_up_usd_per_gb <= f.max_inet_usd_per_gb and o.inet_down_usd_per_gb <= f.max_inet_usd_per_gb,
        ),
    ]
    if f.verified_only:
        checks.append(("verified", lambda o: o.verified))
    checks.append(
        (
            f"GPU memory >= {c.min_gpu_ram_gb:.2f} GB (plan)",
            lambda o: o.gpu_ram_mb * o.num_gpus / 1024 >= c.min_gpu_ram_gb,
        )
    )
    if c.excluded_machines:
        checks.append(("machine blacklisted or taken", lambda o: o.machine_id not in c.excluded_machines))
    if c.max_usd_per_hour is not None:
        checks.append((f"price <= ${c.max_usd_per_hour}/h", lambda o: o.dph_total <= c.max_usd_per_hour))
    return checks


def effective_price_per_hour(offer: Offer, profile: Profile) -> float:
    """$/h including the traffic the profile expects (GB/h each way at the offer's $/GB)."""
    t = profile.traffic_gb_per_hour
    return offer.dph_total + t.up * offer.inet_up_usd_per_gb + t.down * offer.inet_down_usd_per_gb


def storage_price_per_hour(offer: Offer) -> float:
    """What the profile's disk costs an hour on this offer: all a stopped instance bills. Search prices every
    offer for the disk asked (`allocated_storage`) and says it apart (`storage_total_cost`, $/h)."""
    value = offer.raw.get("storage_total_cost")
    try:
        price = float(value) if value is not None else 0.0
    except (TypeError, ValueError):
        return 0.0
    return price if math.isfinite(price) and price >= 0 else 0.0


def funnel(offers: Iterable[Offer], criteria: Criteria, profile: Profile) -> Funnel:
    """Apply every filter in order, count what each removed, rank the rest by effective $/h."""
    result = Funnel()
    remaining = list(offers)
    result.offers = list(remaining)
    result.seen = len(remaining)
    for name, check in _checks(criteria):
        kept = [o for o in remaining if check(o)]
        result.removed.append((name, len(remaining) - len(kept)))
        remaining = kept
    result.passed = sorted(remaining, key=lambda o: (effective_price_per_hour(o, profile), o.id))
    return result


def query_for(criteria: Criteria, profile: Profile) -> OfferQuery:
    return OfferQuery(
        countries=sorted(criteria.countries),
        min_gpu_ram_mb=int(criteria.min_gpu_ram_gb * 1024 / 8),  # the pool: a card of 8 GPUs could hold it
        allocated_disk_gb=profile.disk_gb,
    )
