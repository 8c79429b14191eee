"""`fleet bench`: replay a voice call at 1, 2, 4 ... N concurrent callers and measure what callers feel.

Each caller holds its own conversation of the recorded-style call (data/call.json). The callers
speak in waves: every caller sends its next turn at once. The first (cold) wave and `warmup`
more are discarded; then `waves` waves are measured. Per level: first-content p50/p95 pooled over
the waves, per-caller decode and its share of the one-caller rate, throughput from the server's
token counts (never from counting stream chunks), cache reuse per turn, and errors.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from fleet.engines.base import Engine
from fleet.engines.registry import LLAMA_SERVER
from fleet.engines.replies import count
from fleet.probes.call import Call
from fleet.probes.server import Server, bounded
from fleet.probes.stream import ChatResult, Connection


@dataclass
class LevelResult:
    callers: int
    requests: int
    errors: int
    first_content_p50_ms: float | None
    first_content_p95_ms: float | None
    decode_per_caller_tok_s: float | None
    decode_share: float | None  # per-caller decode / one-caller decode
    throughput_tok_s: float
    cache_reuse: float | None  # median cache_n / prompt_tokens of measured turns
    reconnects: int
    prompt_tokens: float | None = None  # median prompt of measured turns: the context depth callers decode at
    first_content_p99_ms: float | None = None
    draft_acceptance: float | None = None  # drafted tokens the target accepted, over all replies (None: no draft)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass(frozen=True)
class Replies:
    """What a level's replies say, pooled: those that answered, their first contents, decode rates, cache
    reuse (cache_n over the prompt) and the share of drafted tokens accepted (None: nothing was drafted)."""

    good: list[ChatResult]
    firsts: list[float]
    decode: list[float]
    reuse: list[float]
    draft_acceptance: float | None = None

    @classmethod
    def of(cls, results: list[ChatResult]) -> Replies:
        good = [r for r in results if r.status == 200 and not r.error]
        return cls(
            good,
            [r.timing.first_content_ms for r in good if r.timing.first_content_ms is not None],
            [rate for r in good if (rate := r.decode_tok_s)],
            [r.served.cache_n / r.usage["prompt_tokens"] for r in good if r.usage.get("prompt_tokens")],
            draft_acceptance(good),
        )


def draft_acceptance(replies: list[ChatResult]) -> float | None:
    """The tokens a draft model proposed that the target accepted, over all of them (None: none drafted)."""
    drafted = sum(r.served.draft_n for r in replies)
    return sum(r.served.draft_n_accepted for r in replies) / drafted if drafted else None


def summarize(
    callers: int, waves: list[tuple[float, list[ChatResult]]], one_caller_decode: float | None, reconnects: int
) -> LevelResult:
    """Pool the measured waves of one level (pure: tested on recorded results)."""
    results = [r for _, wave in waves for r in wave]
    pooled = Replies.of(results)
    good, firsts, decode, reuse = pooled.good, pooled.firsts, pooled.decode, pooled.reuse
    throughput = [sum(r.served.predicted_n for r in wave) / wall for wall, wave in waves if wall > 0]
    per_caller = statistics.median(decode) if decode else None
    prompts = [float(r.usage["prompt_tokens"]) for r in good if r.usage.get("prompt_tokens")]
    return LevelResult(
        callers=callers,
        requests=len(results),
        errors=len(results) - len(good),
        first_content_p50_ms=percentile(firsts, 0.5),
        first_content_p95_ms=percentile(firsts, 0.95),
        decode_per_caller_tok_s=per_caller,
        decode_share=(per_caller / one_caller_decode) if per_caller and one_caller_decode else None,
        throughput_tok_s=statistics.mean(throughput) if throughput else 0.0,
        cache_reuse=statistics.median(reuse) if reuse else None,
        reconnects=reconnects,
        prompt_tokens=statistics.median(prompts) if prompts else None,
        first_content_p99_ms=percentile(firsts, 0.99),
        draft_acceptance=pooled.draft_acceptance,
    )


async def fit_call(
    server: Server,
    call: Call,
    share_of_ctx: float = 0.4,
    slots_started: int | None = None,
    engine: Engine = LLAMA_SERVER,
    ctx_per_slot: int | None = None,
) -> tuple[Call, int]:
    """Cut the system prompt so it takes at most `share_of_ctx` of one slot; return (call, slots). The slots
    are what /props says, never more than `slots_started` (the -np fleet started the server with): a host
    that claims more is not believed. An engine without /props (vLLM) has the slots and context fleet
    started it with (--max-num-seqs, --max-model-len)."""
    async with server.client(timeout=60) as client:
        if engine.reports_slots:
            props = (await bounded(client, "GET", "/props", deadline_s=60)).raise_for_status().json()
            props = props if isinstance(props, dict) else {}
            slots = max(count(props.get("total_slots")) or 1, 1)
            if slots_started is not None:
                slots = min(slots, slots_started)
            settings = props.get("default_generation_settings")
            n_ctx = (count(settings.get("n_ctx")) if isinstance(settings, dict) else None) or 4096
        else:
            slots, n_ctx = max(slots_started or 1, 1), ctx_per_slot or 4096
        body = engine.tokenize_body(call.system)
        tokenized = await bounded(client, "POST", "/tokenize", deadline_s=60, json=body)
        tokens = len(tokenized.raise_for_status().json()["tokens"])
    budget = int(n_ctx * share_of_ctx)
    if tokens > budget:
        call = call.with_system_chars(int(len(call.system) * budget / tokens))
    return call, slots


class Caller:
    """One call's turns on one connection. `user`: the call's name in every request (OpenAI's `user`), by which a
    gateway pins a call's turns to one host as a voice framework's session would."""

    def __init__(self, server: Server, call: Call, offset: int, max_tokens: int, user: str | None = None) -> None:
        self.conn = Connection(server)
        self.call = call
        self.turn = offset
        self.max_tokens = max_tokens
        self.user = user
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": call.system}]

    async def speak(self) -> ChatResult:
        self.messages.append({"role": "user", "content": self.call.user_turns[self.turn % len(self.call.user_turns)]})
        self.turn += 1
        body = {"messages": self.messages, "tools": self.call.tools, "max_tokens": self.max_tokens, "temperature": 0}
        if self.user is not None:
            body["user"] = self.user
        result = await self.conn.chat(body)
        self.messages.append({"role": "assistant", "content": result.content})
        return result


async def speak_waves(
    server: Server, call: Call, callers: int, waves: int, warmup: int, max_tokens: int
) -> tuple[list[tuple[float, list[ChatResult]]], int]:
    """`callers` callers speaking in waves (a cold wave and `warmup` discarded): each measured wave's wall
    time and replies, and how many times a caller had to connect again."""
    people = [Caller(server, call, offset=i * 3, max_tokens=max_tokens) for i in range(callers)]
    measured: list[tuple[float, list[ChatResult]]] = []
    try:
        for wave in range(1 + warmup + waves):
            started = time.perf_counter()
            results = await asyncio.gather(*(p.speak() for p in people))
            if wave > warmup:
                measured.append((time.perf_counter() - started, list(results)))
    finally:
        for p in people:
            await p.conn.close()
    return measured, sum(max(p.conn.opened - 1, 0) for p in people)


async def run_level(
    server: Server,
    call: Call,
    callers: int,
    waves: int,
    warmup: int,
    max_tokens: int,
    one_caller_decode: float | None,
) -> LevelResult:
    measured, reconnects = await speak_waves(server, call, callers, waves, warmup, max_tokens)
    return summarize(callers, measured, one_caller_decode, reconnects)


def levels_up_to(n: int) -> list[int]:
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return [*out, n]


def sweep(most: int) -> Callable[[dict[int, LevelResult]], int | None]:
    """The plain sweep: 1, 2, 4 ... `most` callers, every level."""

    def choose(measured: dict[int, LevelResult]) -> int | None:
        return next((n for n in levels_up_to(most) if n not in measured), None)

    return choose


async def run_bench(
    server: Server,
    call: Call,
    slots: int,
    *,
    max_callers: int | None = None,
    waves: int = 3,
    warmup: int = 1,
    max_tokens: int = 32,
    search: Callable[[int], Callable[[dict[int, LevelResult]], int | None]] = sweep,
) -> list[LevelResult]:
    """Measure levels of concurrent callers in the order `search(most)` picks them (given what was
    measured so far) until it says None; the results in order of callers. One caller is measured first:
    its decode rate is what the others' share is of. `call` and `slots` are what fit_call made of the
    server: the slots are the most callers tried unless `max_callers` asks for more."""
    most = max_callers or slots
    choose = search(most)
    measured: dict[int, LevelResult] = {}
    one_caller: float | None = None
    while (n := choose(measured) if measured else 1) is not None:
        level = await run_level(server, call, n, waves, warmup, max_tokens, one_caller)
        if n == 1:
            one_caller = level.decode_per_caller_tok_s
            level.decode_share = 1.0 if one_caller else None
        measured[n] = level
    return [measured[n] for n in sorted(measured)]
