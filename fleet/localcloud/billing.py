"""The account's money as vast.ai keeps it: a charge per instance and kind (the GPU's whole hourly price
while it runs, the disk alone while it is stopped), the credit left, and the charges endpoint's answer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fleet.localcloud.apierror import ApiError

STARTING_CREDIT_USD = 100.0


GB = 1e9  # vast.ai prices traffic in $/GB


@dataclass
class Charge:
    instance_id: int
    label: str | None
    start: float
    end: float | None
    dph_total: float
    # gpu: the whole hourly price while it runs; storage: the disk alone while it loads or is stopped;
    # bandwidth: every byte received and sent, at the offer's $/GB, "regardless of what state it is in"
    kind: str = "gpu"
    bytes_down: int = 0
    bytes_up: int = 0
    usd_per_gb_down: float = 0.0
    usd_per_gb_up: float = 0.0

    def amount(self, now: float) -> float:
        if self.kind == "bandwidth":
            return (self.bytes_down * self.usd_per_gb_down + self.bytes_up * self.usd_per_gb_up) / GB
        return self.dph_total * ((self.end or now) - self.start) / 3600.0


def daily_spend(charges: list[Charge], now: float) -> float:
    """The account's average spend a day since its first charge (a day at least)."""
    if not charges:
        return 0.0
    days = max((now - min(c.start for c in charges)) / 86400, 1.0)
    return sum(c.amount(now) for c in charges) / days


def bandwidth(charges: list[Charge], instance_id: int) -> Charge | None:
    return next((c for c in charges if c.instance_id == instance_id and c.kind == "bandwidth"), None)


def credit(charges: list[Charge], now: float, starting_usd: float | None = None) -> float:
    """What the account has left: its starting credit less every charge so far."""
    start = STARTING_CREDIT_USD if starting_usd is None else starting_usd
    return start - sum(c.amount(now) for c in charges)


BALANCE_PERIOD_S = 0.1  # a running instance's watch period (boot.py), at which the balance was always acted on


class Balance:
    """The account's credit, summed over its charges at most once a BALANCE_PERIOD_S: each running instance's
    watch asks for it every period, and each row of a listing; summed each time, that grew with hosts times
    charges (at 1,000 hosts, a listing summed seven million charges)."""

    def __init__(self, charges: list[Charge]) -> None:
        self.charges = charges
        self._last: tuple[float, float | None, float] | None = None  # when, the starting credit, the credit
        self._traffic: dict[int, Charge] = {}

    def left(self, starting_usd: float | None) -> float:
        now = time.monotonic()
        if self._last is None or now - self._last[0] >= BALANCE_PERIOD_S or self._last[1] != starting_usd:
            self._last = (now, starting_usd, credit(self.charges, time.time(), starting_usd))
        return self._last[2]

    def traffic(self, instance_id: int) -> Charge | None:
        """The instance's bandwidth charge, found once: every piece its forwarders relay adds to it."""
        charge = self._traffic.get(instance_id)
        if charge is None and (charge := bandwidth(self.charges, instance_id)) is not None:
            self._traffic[instance_id] = charge
        return charge


def close_open(
    charges: list[Charge], instance_id: int, now: float, kinds: tuple[str, ...] = ("gpu", "storage")
) -> None:
    """End the instance's charges of these kinds still running (a stop, a start; a destroy ends all)."""
    for charge in charges:
        if charge.instance_id == instance_id and charge.end is None and charge.kind in kinds:
            charge.end = now


def charges_page(charges: list[Charge], select_filters: dict[str, Any]) -> dict[str, Any]:
    """The charges endpoint's answer for a day range (both ends required, as vast.ai's)."""
    day = select_filters.get("day") if isinstance(select_filters, dict) else None
    if not isinstance(day, dict) or "gte" not in day or "lte" not in day:
        raise ApiError(400, "invalid_args", "Must provide both 'day' gte and lte filters for instance charges")
    now = time.time()
    results = []
    for c in charges:
        end = c.end or now
        if end < float(day["gte"]) or c.start > float(day["lte"]):
            continue
        hours = (end - c.start) / 3600.0
        what = (
            f"{c.bytes_down + c.bytes_up} bytes at ${c.usd_per_gb_down:.4f}/GB down, ${c.usd_per_gb_up:.4f}/GB up"
            if c.kind == "bandwidth"
            else f"{hours:.3f} hours at ${c.dph_total:.4f}/hour"
        )
        results.append(
            {
                "start": c.start,
                "end": end,
                "type": "instance",
                "source": f"instance-{c.instance_id}",
                "description": f"Instance {c.instance_id} Charges",
                "amount": c.amount(now),
                "metadata": {"label": c.label, "instance_id": c.instance_id, "ongoing": c.end is None},
                "items": [
                    {
                        "type": c.kind,
                        "description": what,
                        "amount": c.amount(now),
                    }
                ],
            }
        )
    return {"success": True, "count": len(results), "total": len(results), "next_token": None, "results": results}
