"""Selection that learns: rank offers by the expected cost of a voice-minute, not by $/h.

A voice deployment buys concurrent calls that answer in time, so an offer is worth its effective $/h
(traffic included) over the callers a host there is expected to hold, discounted by how often a
bring-up there reaches READY and by the hours it bills before it serves. What fleet remembers of the
machine (fleet/economics/machines.py) gives those numbers where it has seen the machine; otherwise the median of
the machines with that GPU model it has measured, when there are MEDIAN_MACHINES of them; otherwise a stated
prior, the profile's slots (what the profile was sized for). No machine is believed to hold more callers than
the profile's slots: a host that claims more is lying. Pure: `expect` and `rank` take the offers, the
profile and the records.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from fleet.core.config import Profile
from fleet.economics.machines import MachineRecord
from fleet.economics.offers import HOST_LIFETIME_H, expected_price_per_hour
from fleet.market import Offer

MEDIAN_MACHINES = 3  # a GPU model's measured capacity is believed from this many distinct machines, not fewer


@dataclass(frozen=True)
class Expectation:
    callers: float  # concurrent callers a host there is expected to hold at the profile's voice target
    source: str  # where that number comes from
    success: float  # the share of bring-ups there expected to reach READY
    to_ready_s: float | None  # measured time from create to READY there
    usd_per_voice_minute: float  # what ranks the offer (inf when no caller is expected)

    def why(self) -> str:
        parts = [f"{self.callers:g} callers ({self.source})"]
        if self.success < 1:
            parts.append(f"{self.success:.0%} of bring-ups READY")
        if self.to_ready_s:
            parts.append(f"{self.to_ready_s / 60:.0f} min to READY")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "why": self.why()}


def _success(record: MachineRecord | None) -> float:
    """READY bring-ups over all, with one success and one failure assumed beforehand (a machine seen once
    is neither certain nor condemned); blacklistings count as failures."""
    if record is None:
        return 1.0
    failures = max(record.hosts - record.ready, 0) + record.blacklistings
    return (record.ready + 1) / (record.ready + failures + 2) if failures else 1.0


def expect(
    offer: Offer, profile: Profile, seen: dict[tuple[str, int], MachineRecord], provider: str, pull_gb: float = 0.0
) -> Expectation:
    """What a host on this offer is expected to give, from what fleet measured; `pull_gb` is what a
    bring-up there downloads, at the offer's $/GB."""
    record = seen.get((provider, offer.machine_id))
    # What a machine measured is believed up to the profile's slots (a host holds no more callers than the
    # slots it is started with); a GPU's median only from several machines, so no one host sets it.
    same_gpu = [
        min(m.capacity, profile.slots) * min(m.thermal_share or 1.0, 1.0)
        for m in seen.values()
        if m.gpu_name == offer.gpu_name and m.capacity is not None
    ]
    if record is not None and record.capacity is not None:
        callers = min(record.capacity, profile.slots) * min(record.thermal_share or 1.0, 1.0)
        source = "measured on this machine"
    elif record is not None and record.thermal_share is not None and record.thermal_share < 1.0:
        callers = profile.slots * record.thermal_share  # it ran hot here: the prior, cut by what it kept
        source = f"the profile's slots at this machine's thermal share {record.thermal_share:.2f}"
    elif len(same_gpu) >= MEDIAN_MACHINES:
        callers = statistics.median(same_gpu)
        source = f"measured on {len(same_gpu)} {offer.gpu_name} machine(s)"
    else:
        callers = float(profile.slots)
        source = "prior: the profile's slots"
    success = _success(record)
    to_ready_s = record.create_to_ready_s if record is not None else None
    per_hour = expected_price_per_hour(offer, profile, pull_gb) * (1 + (to_ready_s or 0) / 3600 / HOST_LIFETIME_H)
    cost = per_hour / (callers * 60 * success) if callers > 0 else float("inf")
    return Expectation(round(callers, 2), source, success, to_ready_s, cost)


def rank(
    offers: list[Offer],
    profile: Profile,
    seen: dict[tuple[str, int], MachineRecord],
    provider: str,
    pull_gb: float = 0.0,
) -> list[tuple[Offer, Expectation]]:
    """The offers by expected $/voice-minute (ties: expected $/h, then the marketplace's order)."""
    judged = [(o, expect(o, profile, seen, provider, pull_gb)) for o in offers]
    order = {id(o): i for i, o in enumerate(offers)}
    return sorted(
        judged,
        key=lambda oe: (
            oe[1].usd_per_voice_minute,
            expected_price_per_hour(oe[0], profile, pull_gb),
            order[id(oe[0])],
        ),
    )
