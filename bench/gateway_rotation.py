"""bench/gateway.py --rotation: 16 callers talk without pause through the gateway while its hosts change under
them: the health sweep replaces a host whose certificate ends soon (from the standby pool: a stopped host
resumed), a host is moved as a reprice moves it (a new host up, the old one draining its calls, then
destroyed), and last a host dies under its calls and the health sweep replaces it.

Each caller talks call after call (12 turns each, then a new call), so that new calls arrive all along.
Counted: turns, failed turns (target 0), new calls placed on a host that was draining when they were sent
(target 0), and cache misses: warm turns whose host took nothing from its cache, as the gateway's access
log says (an agent sees no cache count; only the turns whose host changed should miss). A host that dies
ends the streams it was sending: those are counted apart (the gateway never replays a stream that had
begun); any other failed turn is a failure."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from fleet.app import Fleet
from fleet.control import gateway, rotation
from fleet.core.models import HostState, utcnow
from fleet.gateway.files import files_for
from fleet.gateway.runtime import Runtime
from fleet.probes.server import Server
from fleet.probes.stream import Connection

CALLERS = 16
AGENT = "rotation-bench"
TURNS_PER_CALL = 12
MAX_TOKENS = 16


@dataclass
class Tally:
    turns: int = 0
    failed: list[str] = field(default_factory=list)
    in_flight_at_death: list[str] = field(default_factory=list)  # streams a dying host was sending
    killed_at: float | None = None
    new_calls: int = 0
    new_on_draining: list[str] = field(default_factory=list)
    misses: int = 0
    moved_calls: set[str] = field(default_factory=set)
    events: list[str] = field(default_factory=list)


def draining_slots(fleet: Fleet) -> set[str]:
    return {
        f"s{h.gateway_slot}" for h in fleet.record.hosts(states=(HostState.DRAINING,)) if h.gateway_slot is not None
    }


def fail(tally: Tally, started: float, what: str) -> None:
    dying = tally.killed_at is not None and started <= tally.killed_at
    (tally.in_flight_at_death if dying else tally.failed).append(what)


async def caller(fleet: Fleet, server: Server, index: int, stop: asyncio.Event, tally: Tally) -> None:
    runtime = Runtime(files_for(fleet.settings).socket)
    connection = Connection(server)
    number = 0
    try:
        while not stop.is_set():
            number += 1
            call = f"caller-{index}-call-{number}"
            history: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful voice agent. " * 4}]
            placed_before = None
            for turn in range(TURNS_PER_CALL):
                if stop.is_set():
                    break
                history.append({"role": "user", "content": f"{call}, turn {turn}: and then?"})
                draining = draining_slots(fleet) if turn == 0 else set()
                started = time.monotonic()
                try:
                    result = await connection.chat({"messages": history, "max_tokens": MAX_TOKENS, "user": call})
                except Exception as e:  # a turn the agent would have seen fail
                    fail(tally, started, f"{call} turn {turn}: {type(e).__name__}: {e}")
                    await connection.close()
                    break
                tally.turns += 1
                if result.status != 200:
                    fail(tally, started, f"{call} turn {turn}: {result.error}")
                    break
                placed = (await runtime.table("calls_t0")).get(f"{AGENT}/{call}", {}).get("server_key")
                if turn == 0:
                    tally.new_calls += 1
                    if placed in draining and placed in draining_slots(fleet):
                        tally.new_on_draining.append(f"{call} on {placed}")
                elif placed != placed_before:
                    tally.moved_calls.add(call)
                placed_before = placed
                history.append({"role": "assistant", "content": result.content})
                await asyncio.sleep(0.05)
    finally:
        await connection.close()


def stamp(tally: Tally, what: str) -> None:
    tally.events.append(f"{time.strftime('%H:%M:%S')} {what}")


async def rotate(fleet: Fleet, tally: Tally, module: Any) -> None:
    await asyncio.sleep(4)
    first, second = sorted(fleet.record.hosts(states=(HostState.READY,)), key=lambda h: h.id or 0)[:2]
    # its certificate ends within the contract margin: the health sweep replaces it, make before break
    fleet.record.update(first, certificate_until=utcnow() + timedelta(hours=1))
    replaced = [(r.name, r.replaced_by) for r in await rotation.health_sweep(fleet) if r.replaced_by]
    stamp(tally, f"health sweep (a certificate ending): {replaced}")
    await asyncio.sleep(3)
    new = await rotation.replace(fleet, second, "reprice", blacklist=False)
    stamp(tally, f"reprice: moved {second.name} -> {new.name if new else None}")
    await asyncio.sleep(3)
    victim = sorted(fleet.record.hosts(states=(HostState.READY,)), key=lambda h: h.id or 0)[0]
    tally.killed_at = time.monotonic()
    await module.kill_server(fleet, victim)
    stamp(tally, f"{victim.name} killed (its llama-server stopped)")
    replaced = [(r.name, r.replaced_by) for r in await rotation.health_sweep(fleet) if r.replaced_by]
    stamp(tally, f"health sweep (a dead host): {replaced}")
    await asyncio.sleep(3)


async def under_rotation(fleet: Fleet, module: Any) -> Tally:
    """The hosts (two READY, one in the standby pool) and the gateway are up; talk while they change."""
    key = await gateway.add_key(fleet, AGENT)
    server = Server(f"https://localhost:{fleet.settings.gateway.port}", key, fleet.tls)
    tally = Tally()
    stop = asyncio.Event()
    callers = [asyncio.create_task(caller(fleet, server, i, stop, tally)) for i in range(CALLERS)]
    try:
        await rotate(fleet, tally, module)
    finally:
        stop.set()
        await asyncio.gather(*callers)
    tally.misses = misses(fleet)
    return tally


def misses(fleet: Fleet) -> int:
    """Warm turns of the bench's calls whose host took nothing from its cache: the gateway's access log."""
    count = 0
    for line in files_for(fleet.settings).access_log.read_text().splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("agent") == AGENT and fields.get("admit") == "turn" and fields.get("cached_tokens") == "0":
            count += 1
    return count


def report(tally: Tally) -> None:
    for event in tally.events:
        print(event, file=sys.stderr)
    print(f"\n{CALLERS} callers talking without pause: a host replaced by the health sweep (from the standby pool),")
    print("a host moved (reprice), then a host killed under its calls and replaced\n")
    print(
        "| turns | failed turns | new calls | new calls on a draining host | cache misses | calls moved "
        "| streams the killed host was sending |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {tally.turns} | {len(tally.failed)} | {tally.new_calls} | {len(tally.new_on_draining)} "
        f"| {tally.misses} | {len(tally.moved_calls)} | {len(tally.in_flight_at_death)} |"
    )
    for failure in tally.failed[:5]:
        print(f"failed: {failure}")
    for placed in tally.new_on_draining[:5]:
        print(f"on a draining host: {placed}")
    print("\ntargets: 0 failed turns, 0 new calls on a draining host; a miss only where a call's host changed")
