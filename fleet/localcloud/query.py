"""vast.ai search and list filter semantics, as pure functions over plain dicts.

A query is `{field: {op: value}}`. Clients send numbers as strings ("0.98"), so comparisons
coerce to the offer's type. `geolocation` matches on the two-letter country suffix of values
like "Sweden, SE". Anything malformed raises `QueryError`, which the API turns into vast.ai's
`invalid_args` body.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

OPERATORS = ("eq", "neq", "gt", "gte", "lt", "lte", "in", "notin")

# Keys of a search body that are not field filters.
CONTROL_KEYS = frozenset(
    {
        "order",
        "type",
        "limit",
        "allocated_storage",
        "disable_bundling",
        "target_reliability",
        "extra_ids",
        "gpu_option",
        "show_incompatible",
        "sort_option",
        "template_id",
    }
)

OFFER_TYPES = {
    "on-demand": "on-demand",
    "ondemand": "on-demand",
    "bid": "bid",
    "interruptible": "bid",
    "reserved": "reserved",
}

DEFAULT_LIMIT = 64


class QueryError(ValueError):
    """A query the server refuses; the message is what the client is told."""


def country_code(geolocation: str | None) -> str | None:
    """'Sweden, SE' -> 'SE'; None or an empty string -> None."""
    if not geolocation:
        return None
    return geolocation.strip()[-2:].upper()


def _coerce(actual: Any, wanted: Any, field: str) -> Any:
    """Turn the client's value into the type of the stored value, as vast.ai does."""
    if wanted is None or isinstance(actual, str) or actual is None:
        return wanted
    if isinstance(actual, bool):
        if isinstance(wanted, bool):
            return wanted
        if isinstance(wanted, str) and wanted.lower() in ("true", "false"):
            return wanted.lower() == "true"
        if isinstance(wanted, (int, float)):
            return bool(wanted)
        raise QueryError(f"invalid value for {field}: {wanted!r}")
    if isinstance(actual, (int, float)):
        if isinstance(wanted, bool):
            return int(wanted)
        try:
            return float(wanted)
        except (TypeError, ValueError):
            raise QueryError(f"invalid value for {field}: {wanted!r}") from None
    return wanted


def _match_one(actual: Any, op: str, wanted: Any, field: str) -> bool:
    if op in ("in", "notin"):
        if not isinstance(wanted, list):
            raise QueryError(f"operator {op} on {field} needs a list")
        values = [_coerce(actual, w, field) for w in wanted]
        hit = actual in values or (actual is None and False in values)
        return hit if op == "in" else not hit
    value = _coerce(actual, wanted, field)
    if op == "eq":
        # `external: null` in real offers is matched by the CLI's default `external eq false`.
        return actual == value or (actual is None and value is False)
    if op == "neq":
        return not (actual == value or (actual is None and value is False))
    if actual is None or value is None:
        return False
    if isinstance(actual, str) != isinstance(value, str):
        raise QueryError(f"invalid value for {field}: {wanted!r}")
    if op == "gt":
        return actual > value
    if op == "gte":
        return actual >= value
    if op == "lt":
        return actual < value
    return actual <= value  # lte


def validate_filters(filters: dict[str, Any]) -> None:
    """Raise QueryError unless every filter is `{op: value}` with a known operator."""
    for field, condition in filters.items():
        if not isinstance(condition, dict) or not condition:
            raise QueryError(f'filter for {field} must be an object like {{"eq": value}}')
        for op in condition:
            if op not in OPERATORS:
                raise QueryError(f"unknown operator {op!r} for {field}")


def matches(row: dict[str, Any], filters: dict[str, Any]) -> bool:
    """True when `row` passes every filter. Call validate_filters first."""
    for field, condition in filters.items():
        if field == "geolocation":
            actual: Any = country_code(row.get("geolocation"))
            condition = {
                op: ([country_code(v) for v in w] if isinstance(w, list) else country_code(w))
                for op, w in condition.items()
            }
        else:
            actual = row.get(field)
        for op, wanted in condition.items():
            if not _match_one(actual, op, wanted, field):
                return False
    return True


def parse_order(order: Any) -> list[tuple[str, bool]]:
    """`[["dph_total", "asc"], ["score", "desc"]]` -> [(field, descending)]."""
    if order is None:
        return [("score", True)]
    if not isinstance(order, list):
        raise QueryError("order must be a list of [field, direction]")
    result = []
    for item in order:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or item[1] not in ("asc", "desc"):
            raise QueryError(f"invalid order entry: {item!r}")
        result.append((str(item[0]), item[1] == "desc"))
    return result


def sort_rows(rows: Iterable[dict[str, Any]], order: list[tuple[str, bool]]) -> list[dict[str, Any]]:
    """Stable multi-key sort; missing values sort last whatever the direction."""
    out = list(rows)
    for field, descending in reversed(order):
        present = [r for r in out if r.get(field) is not None]
        missing = [r for r in out if r.get(field) is None]
        present.sort(key=lambda r: r[field], reverse=descending)
        out = present + missing
    return out


def parse_limit(limit: Any, default: int = DEFAULT_LIMIT, maximum: int | None = None) -> int:
    if limit is None:
        return default
    try:
        value = int(limit)
    except (TypeError, ValueError):
        raise QueryError(f"invalid limit: {limit!r}") from None
    if maximum is not None:
        value = min(value, maximum)
    return value
