"""What vast.ai's answers say, read strictly: error bodies of every shape, instance rows whose fields fleet acts
on (a malformed one is an error, never a guess)."""

from __future__ import annotations

import math
import time
from typing import Any

import httpx

from fleet.market import Instance, Maintenance, MarketError


def json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def seconds_within(value: Any, most: float) -> float | None:
    """A wait the marketplace asked for (a header's text), if it is one: finite and from 0 to `most` seconds.
    `nan`, a negative or `inf` is none, and so is a wait past what the caller would ever wait (1e9)."""
    if not is_number(value):
        return None
    found = float(value)
    return found if math.isfinite(found) and 0 <= found <= most else None


def reset_time(value: Any) -> float | None:
    """When a spent quota resets (X-RateLimit-Reset, epoch seconds), if the header says a time."""
    return float(value) if is_number(value) and math.isfinite(float(value)) else None


def quota_message(reset_at: float | None) -> str:
    message = "vast.ai's daily search quota is used up (it resets at 00:00 UTC"
    left = seconds_within(max(reset_at - time.time(), 0), 2 * 86400) if reset_at is not None else None
    if left is not None:
        message += f", in {int(left // 3600)}h{int(left % 3600 // 60):02d}m"
    return message + "); searches are not retried until then"


def _status_text(value: Any) -> str | None:
    return value[:40] if isinstance(value, str) else None


def text_excerpt(response: httpx.Response) -> str:
    text = response.text.strip().replace("\n", " ")
    return text[:200] or f"HTTP {response.status_code} with an empty body"


def message(body: Any) -> str:
    if isinstance(body, dict):
        return str(body.get("msg") or body.get("message") or body.get("detail") or body.get("error") or body)
    return str(body)


def instance_from_row(row: Any) -> Instance:
    """An instance row as show and list answer it; MarketError when a field we act on is malformed."""
    if not isinstance(row, dict):
        raise MarketError(f"malformed instance row: {type(row).__name__}, not an object")
    try:
        ports: dict[int, int] = {}
        for key, mappings in (row.get("ports") or {}).items():
            if mappings:
                ports[int(str(key).split("/")[0])] = int(mappings[0]["HostPort"])
        return Instance(
            id=int(row["id"]),
            status=row.get("actual_status"),
            status_msg=row.get("status_msg"),
            label=row.get("label"),
            machine_id=int(row["machine_id"]),
            dph_total=float(row.get("dph_total") or 0.0),
            public_ip=(row.get("public_ipaddr") or "").strip() or None,
            ssh_host=(row.get("ssh_host") or "").strip() or None,
            ssh_port=int(row["ssh_port"]) if row.get("ssh_port") else None,
            ports=ports,
            start_date=float(row["start_date"]) if row.get("start_date") else None,
            raw=row,
            intended=_status_text(row.get("intended_status")),
            cur_state=_status_text(row.get("cur_state")),
            next_state=_status_text(row.get("next_state")),
            contract_end=float(row["end_date"]) if is_number(row.get("end_date")) else None,
        )
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise MarketError(
            f"malformed instance row {str(row.get('id'))[:40]!r}: {type(e).__name__}: {e}"[:300]
        ) from None


def maintenances_from(answer: Any) -> list[Maintenance]:
    """`show maints`' answer: a list of windows, each a machine and its start and end (epoch s)."""
    if not isinstance(answer, list):
        raise MarketError(f"maintenances answered {type(answer).__name__}, not a list")
    found = []
    for row in answer:
        try:
            machine, start, end = int(row["machine_id"]), float(row["start_time"]), float(row["end_time"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise MarketError(f"malformed maintenance window: {type(e).__name__}: {e}"[:300]) from None
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise MarketError(f"malformed maintenance window of machine {machine}: {start}..{end}")
        found.append(Maintenance(machine, start, end))
    return found
