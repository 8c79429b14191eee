"""The filter funnel and the ranking: pure functions over Offer records.

The marketplace is asked for a pool (region, GPU memory); every filter, those two included, is
checked here, so a marketplace that ignores a filter cannot rent us a host in the wrong country,
and the funnel can say how many offers each filter removed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fleet.core.config import Filters, Profile
from fleet.market import Maintenance, Offer, OfferQuery

# The hours a host is expected to serve before it is replaced (the nightly reprice): what a bring-up costs once
# (its pull, its hours before READY) is spread over them.
HOST_LIFETIME_H = 24.0
GB = 1e9  # vast.ai prices traffic in $/GB


@dataclass(frozen=True)
class Criteria:
    countries: frozenset[str]
    filters: Filters
    min_gpu_ram_gb: float
    max_usd_per_hour: float | None = None
    excluded_machines: frozenset[int] = frozenset()
    compute_caps: tuple[int, ...] = ()  # the cards the engine's build runs (empty: any)
    contract_ends_after: float = 0.0  # epoch s: an offer's contract must outlast this
    pull_gb: float = 0.0  # the profile's files: every bring-up downloads them, at the offer's $/GB
    plan_gib: float = 0.0  # what the plan needs on the card (min_gpu_ram_gb is the larger of it and the card's)
    one_card: bool = False  # the engine serves from one card (vLLM without tensor parallelism): no sum over GPUs
    cpu_arch: str = "amd64"  # the image's: an offer that lists another (or none) cannot start it
    min_cpu_ram_gb: float = 0.0  # the system RAM a host of the profile needs (its engine's host_ram_gb)
    min_cpu_ghz: float = 0.0  # the profile's floors on the host's CPU: its server's per-step work runs there
    min_cpu_cores: float = 0.0


@dataclass
class Funnel:
    """How many offers each filter removed, in order, so an empty result explains itself."""

    seen: int = 0
    offers: list[Offer] = field(default_factory=list)  # everything the marketplace returned
    removed: list[tuple[str, int]] = field(default_factory=list)
    passed: list[Offer] = field(default_factory=list)
    limit: int | None = None  # the most offers the search could answer
    pull_gb: float = 0.0  # what a bring-up downloads: ranked at each offer's $/GB
    asked: str = ""  # the filters the marketplace applied before answering
    unknown: list[str] = field(default_factory=list)  # what the marketplace would not say, so no filter judged it

    @property
    def truncated(self) -> bool:
        """The answer filled the search's window: cheaper-first, so dearer offers that pass went unseen."""
        return self.limit is not None and self.seen >= self.limit

    def as_dict(self) -> dict[str, object]:
        return {
            "seen": self.seen,
            "asked": self.asked,
            "truncated": self.truncated,
            "limit": self.limit,
            "removed": [{"filter": n, "count": c} for n, c in self.removed],
            "passed": len(self.passed),
            "unknown": list(self.unknown),
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
    if f.datacenter_only:
        checks.append(("datacenter (hosting_type 1)", lambda o: o.datacenter))
    if f.static_ip_only:
        checks.append(("static IP", lambda o: o.static_ip))
    if c.compute_caps:
        caps = "/".join(f"{cap / 100:g}" for cap in c.compute_caps)
        checks.append(
            (f"compute capability {caps} (the image's CUDA build)", lambda o: o.compute_cap in c.compute_caps)
        )
    checks.append((f"CPU {c.cpu_arch} (the image's)", lambda o: o.cpu_arch == c.cpu_arch))
    if c.min_cpu_ram_gb:
        checks.append((f"RAM >= {c.min_cpu_ram_gb:.1f} GB (the profile's)", lambda o: o.cpu_ram_gb >= c.min_cpu_ram_gb))
    if c.min_cpu_ghz:
        checks.append((f"CPU >= {c.min_cpu_ghz:g} GHz (the profile's)", lambda o: o.cpu_ghz >= c.min_cpu_ghz))
    if c.min_cpu_cores:
        checks.append((f"CPU cores >= {c.min_cpu_cores:g} (the profile's)", lambda o: o.cpu_cores >= c.min_cpu_cores))
    if c.contract_ends_after:
        checks.append(
            (
                f"contract runs >= {f.min_contract_hours:g} h",
                lambda o: o.end_date is not None and o.end_date >= c.contract_ends_after,
            )
        )
    if f.min_inet_down_mbps:
        checks.append(
            (f"download >= {f.min_inet_down_mbps:g} Mbit/s", lambda o: o.inet_down_mbps >= f.min_inet_down_mbps)
        )
    why = "the plan" if c.plan_gib >= c.min_gpu_ram_gb else f"the profile's card; the plan needs {c.plan_gib:.2f} GiB"
    checks.append(
        (
            f"GPU memory >= {c.min_gpu_ram_gb:.2f} GiB ({why})",
            lambda o: o.gpu_ram_mb * (1 if c.one_card else o.num_gpus) / 1024 >= c.min_gpu_ram_gb,
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


def pull_usd(offer: Offer, pull_gb: float) -> float:
    """What downloading the profile's files costs on this offer (vast.ai bills every byte received)."""
    return pull_gb * offer.inet_down_usd_per_gb


def expected_price_per_hour(offer: Offer, profile: Profile, pull_gb: float = 0.0) -> float:
    """The effective $/h with the pull a bring-up there pays once, spread over a host's expected life: what
    offers are ranked by."""
    return effective_price_per_hour(offer, profile) + pull_usd(offer, pull_gb) / HOST_LIFETIME_H


def storage_price_per_hour(offer: Offer) -> float:
    """What the profile's disk costs an hour on this offer: all a stopped instance bills. Search prices every
    offer for the disk asked (`allocated_storage`) and says it apart (`storage_total_cost`, $/h)."""
    value = offer.raw.get("storage_total_cost")
    try:
        price = float(value) if value is not None else 0.0
    except (TypeError, ValueError):
        return 0.0
    return price if math.isfinite(price) and price >= 0 else 0.0


def funnel(offers: Iterable[Offer], criteria: Criteria, profile: Profile, query: OfferQuery | None = None) -> Funnel:
    """Apply every filter in order, count what each removed, rank the rest by expected $/h (the pull
    included; at the same price a static address first). `query`, when given, is what the marketplace was
    asked: its window and its filters."""
    result = Funnel(limit=query.limit if query else None, asked=asked(query) if query else "", pull_gb=criteria.pull_gb)
    remaining = list(offers)
    result.offers = list(remaining)
    malformed = getattr(offers, "malformed", 0)  # rows the marketplace answered that were no offer
    result.seen = len(remaining) + malformed
    if malformed:
        result.removed.append(("malformed offer (its row skipped)", malformed))
    for name, check in _checks(criteria):
        kept = [o for o in remaining if check(o)]
        result.removed.append((name, len(remaining) - len(kept)))
        remaining = kept
    # at the same expected price a fixed address first: a dynamic one may change and cost a bring-up
    result.passed = sorted(
        remaining, key=lambda o: (expected_price_per_hour(o, profile, criteria.pull_gb), not o.static_ip, o.id)
    )
    return result


MAINTENANCE_UNKNOWN = "maintenance windows (the marketplace would not say: none taken into account)"


def without_maintenance(result: Funnel, windows: Iterable[Maintenance] | None, until: float) -> Funnel:
    """The funnel less the offers whose machine is down for an announced maintenance before `until` (epoch s: as
    long as a host there must serve), counted as one more filter; `windows` None (the marketplace would not say):
    the funnel says so, and nothing is removed."""
    if windows is None:
        result.unknown.append(MAINTENANCE_UNKNOWN)
        return result
    down = {w.machine_id for w in windows if w.start < until}
    kept = [o for o in result.passed if o.machine_id not in down]
    hours = max((until - time.time()) / 3600, 0.0)
    result.removed.append((f"no maintenance announced within {hours:.0f} h", len(result.passed) - len(kept)))
    result.passed = kept
    return result


def query_for(criteria: Criteria, profile: Profile, pool_only: bool = False) -> OfferQuery:
    """What to ask the marketplace for: the pool, and (unless `pool_only`) every filter it understands, so
    its window of `filters.search_limit` offers is not filled with offers fleet would refuse."""
    f = criteria.filters
    return OfferQuery(
        countries=sorted(criteria.countries),
        # the pool: a machine of 8 GPUs could hold it between them (one card must, where the engine uses one)
        min_gpu_ram_mb=int(criteria.min_gpu_ram_gb * 1024 / (1 if criteria.one_card else 8)),
        allocated_disk_gb=profile.disk_gb,
        limit=f.search_limit,
        pool_only=pool_only,
        min_reliability=f.min_reliability,
        min_cuda=f.min_cuda,
        min_disk_gb=f.min_disk_gb,
        min_direct_ports=f.min_direct_ports,
        max_inet_usd_per_gb=f.max_inet_usd_per_gb,
        verified_only=f.verified_only,
        datacenter_only=f.datacenter_only,
        static_ip_only=f.static_ip_only,
        compute_caps=criteria.compute_caps,
        min_duration_s=f.min_contract_hours * 3600 if criteria.contract_ends_after else None,
        min_inet_down_mbps=f.min_inet_down_mbps or None,
        max_dph_total=criteria.max_usd_per_hour,
        cpu_arch=criteria.cpu_arch,
        min_cpu_ram_gb=criteria.min_cpu_ram_gb or None,
        min_cpu_ghz=criteria.min_cpu_ghz or None,
        min_cpu_cores=criteria.min_cpu_cores or None,
    )


def asked(query: OfferQuery) -> str:
    """The filters the marketplace applied, in a line."""
    if query.pool_only:
        return "region and GPU memory only (every other filter counted here)"
    parts = ["region", "GPU memory", "reliability", "CUDA", "disk", "direct ports", "traffic $/GB", "CPU"]
    parts += ["verified"] if query.verified_only else []
    parts += ["datacenter"] if query.datacenter_only else []
    parts += ["static IP"] if query.static_ip_only else []
    parts += ["compute capability"] if query.compute_caps else []
    parts += ["contract length"] if query.min_duration_s else []
    parts += ["download speed"] if query.min_inet_down_mbps else []
    parts += ["RAM"] if query.min_cpu_ram_gb else []
    parts += ["CPU clock"] if query.min_cpu_ghz else []
    parts += ["CPU cores"] if query.min_cpu_cores else []
    parts += ["price"] if query.max_dph_total is not None else []
    return ", ".join(parts)
