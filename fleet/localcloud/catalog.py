"""The offers the local cloud rents out, loaded from `offers/*.json` (raw `vastai search offers --raw`)."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

from fleet.localcloud import query

HOURS_PER_MONTH = 30 * 24


def load_offers(directory: Path, now: float | None = None) -> list[dict[str, Any]]:
    """Every offer of every JSON file in `directory`; ids are unique across files. A snapshot's contracts
    keep the time they had left when it was taken (`duration`, seconds): their end is set that far from now."""
    loaded = time.time() if now is None else now
    offers: dict[int, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.json")):
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of offers")
        for row in rows:
            if isinstance(row.get("duration"), int | float):
                row["end_date"] = loaded + float(row["duration"])
            offers.setdefault(int(row["id"]), row)
    return list(offers.values())


def priced(offer: dict[str, Any], allocated_storage_gb: float) -> dict[str, Any]:
    """The offer as search returns it for a disk of `allocated_storage_gb` (vast.ai's pricing)."""
    row = copy.deepcopy(offer)
    if isinstance(row.get("end_date"), int | float):
        row["duration"] = max(float(row["end_date"]) - time.time(), 0.0)  # what its contract has left
    disk_hour = row.get("storage_cost", 0.0) / HOURS_PER_MONTH * allocated_storage_gb
    total = row.get("dph_base", 0.0) + disk_hour
    row["storage_total_cost"] = disk_hour
    row["dph_total"] = total
    row["discounted_dph_total"] = total
    row["search"] = {
        "discountTotalHour": 0,
        "discountedTotalPerHour": total,
        "diskHour": disk_hour,
        "gpuCostPerHour": row.get("dph_base", 0.0),
        "slaPremiumPerHour": 0.0,
        "totalHour": total,
    }
    row["instance"] = {
        "discountTotalHour": 0,
        "discountedTotalPerHour": disk_hour,
        "diskHour": disk_hour,
        "gpuCostPerHour": 0,
        "slaPremiumPerHour": 0,
        "totalHour": disk_hour,
    }
    return row


def _filterable(row: dict[str, Any]) -> dict[str, Any]:
    """Fields the server filters on that a raw offer does not carry as such."""
    return {
        **row,
        "verified": row.get("verification") == "verified",
        "datacenter": row.get("hosting_type") == 1,
        "static_ip": row.get("static_ip") is True,
    }


def search(
    offers: list[dict[str, Any]],
    body: dict[str, Any],
    taken_gpu_ids: dict[int, set[int]],
) -> list[dict[str, Any]]:
    """Apply a `POST /bundles/` body to the catalogue. Raises query.QueryError on bad input."""
    if not isinstance(body, dict):
        raise query.QueryError("invalid json: query must be an object")
    kind = body.get("type", "on-demand")
    if kind not in query.OFFER_TYPES:
        raise query.QueryError(f"invalid type: {kind!r}")
    try:
        storage = float(body.get("allocated_storage", 5.0))
    except (TypeError, ValueError):
        raise query.QueryError("allocated_storage must be a number") from None
    filters = {k: v for k, v in body.items() if k not in query.CONTROL_KEYS}
    query.validate_filters(filters)
    # vast.ai's backend does not filter by `rented` at all (vast-cli 52b515c): it is checked, then ignored
    filters.pop("rented", None)
    order = query.parse_order(body.get("order"))
    limit = query.parse_limit(body.get("limit"))

    rows = []
    for offer in offers:
        taken = taken_gpu_ids.get(offer.get("machine_id"), set())
        rented = bool(taken & set(offer.get("gpu_ids") or []))
        row = priced(offer, storage)
        row["rented"] = rented
        expired = row.get("duration") is not None and row["duration"] <= 0
        row["rentable"] = bool(offer.get("rentable", True)) and not rented and not expired
        row["is_bid"] = query.OFFER_TYPES[kind] == "bid"
        if query.matches(_filterable(row), filters):
            rows.append(row)
    rows = query.sort_rows(rows, order)
    return rows[: max(limit, 0)]
