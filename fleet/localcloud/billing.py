"""The account's money as vast.ai keeps it: a charge per instance and kind (the GPU's whole hourly price
while it runs, the disk alone while it is stopped), the credit left, and the charges endpoint's answer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fleet.localcloud.apierror import ApiError

STARTING_CREDIT_USD = 100.0


@dataclass
class Charge:
    instance_id: int
    label: str | None
    start: float
    end: float | None
    dph_total: float
    kind: str = "gpu"  # gpu: the whole hourly price while it runs; storage: the disk alone while stopped

    def amount(self, now: float) -> float:
        return self.dph_total * ((self.end or now) - self.start) / 3600.0


def credit(charges: list[Charge], now: float) -> float:
    return STARTING_CREDIT_USD - sum(c.amount(now) for c in charges)


def close_open(charges: list[Charge], instance_id: int, now: float) -> None:
    """End every charge of the instance still running (a stop, a start, a destroy)."""
    for charge in charges:
        if charge.instance_id == instance_id and charge.end is None:
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
                        "description": f"{hours:.3f} hours at ${c.dph_total:.4f}/hour",
                        "amount": c.amount(now),
                    }
                ],
            }
        )
    return {"success": True, "count": len(results), "total": len(results), "next_token": None, "results": results}
