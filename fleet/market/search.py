"""vast.ai's search body for an OfferQuery: every filter fleet would apply anyway, in vast-cli's query fields
and operators, so that the search's window of offers is not filled with offers fleet would refuse."""

from __future__ import annotations

import math
from typing import Any

from fleet.market import OfferQuery

# (OfferQuery's field, the search's column, its operator): the filters fleet would apply anyway
_QUALITY = (
    ("min_reliability", "reliability", "gt"),  # offers_fields lists `reliability`; its `reliability2` is commented out
    ("min_cuda", "cuda_max_good", "gte"),
    ("min_disk_gb", "disk_space", "gte"),
    ("min_direct_ports", "direct_port_count", "gte"),
    ("max_inet_usd_per_gb", "inet_up_cost", "lte"),
    ("max_inet_usd_per_gb", "inet_down_cost", "lte"),
    ("min_duration_s", "duration", "gte"),
    ("min_inet_down_mbps", "inet_down", "gte"),
    ("max_dph_total", "dph_total", "lte"),
)


def search_filters(query: OfferQuery) -> dict[str, Any]:
    """The search's filters for what fleet would refuse anyway (vast-cli's query fields and operators)."""
    found: dict[str, Any] = {
        column: {op: getattr(query, field)} for field, column, op in _QUALITY if getattr(query, field) is not None
    }
    if query.verified_only:
        found["verified"] = {"eq": True}
    if query.datacenter_only:
        found["datacenter"] = {"eq": True}
    if query.static_ip_only:
        found["static_ip"] = {"eq": True}
    if query.compute_caps:
        found["compute_cap"] = {"in": list(query.compute_caps)}
    if query.cpu_arch:
        found["cpu_arch"] = {"eq": query.cpu_arch}
    if query.min_cpu_ram_gb:
        found["cpu_ram"] = {"gte": math.ceil(query.min_cpu_ram_gb * 1000)}  # MB, as the offers list it
    if query.min_cpu_ghz:
        found["cpu_ghz"] = {"gte": query.min_cpu_ghz}
    if query.min_cpu_cores:
        found["cpu_cores_effective"] = {"gte": query.min_cpu_cores}
    return found
