"""keep-alive: does the server keep the connection open after a streamed reply (DOMAIN.md trap 4)?

Two streamed requests on one client connection. A server that closes after each streamed reply
makes every turn pay a new TCP connect and slow start (+150-230 ms a turn from 60 ms away). This
build of llama-server does close; the probe reports it and its cost, and gates READY only when
`probes.keepalive_gate` asks it to.
"""

from __future__ import annotations

from typing import Any

from fleet.probes import ProbeResult
from fleet.probes.server import Server
from fleet.probes.stream import Connection

BODY = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}


def judge_keepalive(server_closed: bool, connection_reused: bool, metrics: dict[str, Any], gate: bool) -> ProbeResult:
    metrics = {**metrics, "server_closed_after_stream": server_closed, "connection_reused": connection_reused}
    if connection_reused and not server_closed:
        return ProbeResult("keepalive", True, "the connection stays open after a streamed reply", metrics)
    cost = metrics.get("fresh_connect_ms")
    diagnosis = "the server closed the connection after a streamed reply: every turn pays a new connect" + (
        f" ({cost:.2f} ms here, more from afar)" if cost is not None else ""
    )
    return ProbeResult("keepalive", not gate, diagnosis + ("" if gate else " (reported, not a gate)"), metrics)


async def run_keepalive(server: Server, gate: bool) -> ProbeResult:
    conn = Connection(server)
    try:
        first = await conn.chat(BODY, check_close=True)
        second = await conn.chat(BODY, check_close=True)
    finally:
        await conn.close()
    if first.status != 200 or second.status != 200:
        return ProbeResult("keepalive", False, f"streamed request failed: {first.error or second.error}", {})
    metrics = {
        "fresh_connect_ms": round(first.timing.connect_ms or 0.0, 3),
        "first_content_ms_fresh": round(first.timing.first_content_ms or 0.0, 3),
        "second_connect_ms": round(second.timing.connect_ms, 3) if second.timing.connect_ms is not None else None,
        "first_content_ms_second": round(second.timing.first_content_ms or 0.0, 3),
        "connections_opened": conn.opened,
    }
    return judge_keepalive(first.server_closed, second.timing.reused, metrics, gate)
