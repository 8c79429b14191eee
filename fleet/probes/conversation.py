"""`fleet bench`'s conversation load: N calls in conversation at once, each replaying the recorded call's
turns with the time a turn's speech takes between them, as a voice host carries them.

A real call is mostly not asking the LLM anything: after each reply the agent's speech plays and the caller
answers, for seconds (the profile's `voice.turn_gap_s`), and the LLM works for well under one of them. Every
call first takes its cold turn (its system prompt cached in its slot); then the calls start their measured
turns spread over one gap, and each waits its own gap (the mean, times a factor in 0.5-1.5 drawn from a seeded
generator: the same run gives the same gaps) after each reply. Per level: first content p50/p95 and the decode
rate of the measured turns, cache reuse, the turns sent while every slot held another call's turn (they waited
for a slot), the most turns in flight at once, and the duty the calls ran at (the share of their time a turn
was in flight). The speaker levels of fleet/probes/bench.py are this load with no gap.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from fleet.probes.bench import Caller, Replies, percentile
from fleet.probes.call import Call
from fleet.probes.server import Server
from fleet.probes.stream import ChatResult


@dataclass
class CallsLevel:
    calls: int
    requests: int  # measured turns
    errors: int
    first_content_p50_ms: float | None
    first_content_p95_ms: float | None
    decode_per_caller_tok_s: float | None  # median decode rate of the measured turns
    cache_reuse: float | None  # median cache_n / prompt_tokens of measured turns
    waited: int  # measured turns sent while every slot held another call's turn
    peak_in_flight: int  # the most turns in flight at once
    duty: float | None  # the share of the calls' time a turn was in flight
    turn_gap_s: float  # the mean gap between a reply and the call's next turn
    draft_acceptance: float | None = None  # drafted tokens the target accepted, over all turns (None: no draft)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Turn:
    """One measured turn: when it was sent and answered (seconds on one clock), how many turns were in flight
    when it was sent, and the reply."""

    sent: float
    done: float
    in_flight_before: int
    result: ChatResult


def summarize_calls(calls: int, turns: list[Turn], span_s: float, slots: int, gap_s: float) -> CallsLevel:
    """One level from its measured turns (pure: tested on recorded turns). `span_s`: the time the calls were
    in conversation, summed over the calls."""
    replies = Replies.of([t.result for t in turns])
    busy = sum(t.done - t.sent for t in turns)
    return CallsLevel(
        calls=calls,
        requests=len(turns),
        errors=len(turns) - len(replies.good),
        first_content_p50_ms=percentile(replies.firsts, 0.5),
        first_content_p95_ms=percentile(replies.firsts, 0.95),
        decode_per_caller_tok_s=statistics.median(replies.decode) if replies.decode else None,
        cache_reuse=statistics.median(replies.reuse) if replies.reuse else None,
        waited=sum(1 for t in turns if t.in_flight_before >= slots),
        peak_in_flight=max((t.in_flight_before + 1 for t in turns), default=0),
        duty=busy / span_s if span_s > 0 else None,
        turn_gap_s=gap_s,
        draft_acceptance=replies.draft_acceptance,
    )


def gaps(call_index: int, turns: int, mean_s: float, seed: int = 0) -> list[float]:
    """The gaps one call waits after each of its turns: the mean times a factor in [0.5, 1.5], the same for
    the same call, turns and seed."""
    rng = random.Random(seed * 100_003 + call_index)
    return [mean_s * rng.uniform(0.5, 1.5) for _ in range(turns)]


async def converse(
    server: Server,
    call: Call,
    calls: int,
    turns: int,
    max_tokens: int,
    gap_s: float,
    slots: int,
    seed: int = 0,
    named: bool = False,
) -> CallsLevel:
    """`calls` calls in conversation for `turns` measured turns each, after a cold turn each; `named`: each
    call sends its name (`user`), as through a gateway that pins a call's turns to its host."""
    people = [
        Caller(server, call, offset=i * 3, max_tokens=max_tokens, user=f"call-{seed}-{i}" if named else None)
        for i in range(calls)
    ]
    measured: list[Turn] = []
    in_flight = 0
    spans: list[float] = []

    async def one(i: int, person: Caller) -> None:
        nonlocal in_flight
        await asyncio.sleep(i * gap_s / calls)  # the calls' turns spread over one gap, not in waves
        started = time.perf_counter()
        for gap in gaps(i, turns, gap_s, seed):
            sent, before = time.perf_counter(), in_flight
            in_flight += 1
            try:
                result = await person.speak()
            finally:
                in_flight -= 1
            measured.append(Turn(sent, time.perf_counter(), before, result))
            await asyncio.sleep(gap)
        spans.append(time.perf_counter() - started)

    try:
        await asyncio.gather(*(p.speak() for p in people))  # each call's cold turn: its prompt in its slot
        await asyncio.gather(*(one(i, p) for i, p in enumerate(people)))
    finally:
        for p in people:
            await p.conn.close()
    return summarize_calls(calls, measured, sum(spans), slots, gap_s)


async def run_calls(
    server: Server,
    call: Call,
    *,
    choose: Callable[[dict[int, CallsLevel]], int | None],
    turns: int,
    max_tokens: int,
    gap_s: float,
    slots: int,
) -> list[CallsLevel]:
    """Conversation levels in the order `choose` picks them (given what was measured so far) until it says
    None; the results in order of calls. `call` is fitted to the host already (bench.fit_call)."""
    measured: dict[int, CallsLevel] = {}
    while (n := choose(measured)) is not None:
        measured[n] = await converse(server, call, n, turns, max_tokens, gap_s, slots)
    return [measured[n] for n in sorted(measured)]
