"""cache: does a warm turn reuse the cached prompt, as a voice agent needs (DOMAIN.md trap 2)?

Three checks:
- live turns: a call-shaped conversation (long system prompt, tools from the first request, short
  messages). On each warm turn `prompt_n` must be about the tokens appended since the last turn
  (plus `probes.prompt_allowance_tokens` of template glue) and `cache_n` must cover the earlier prompt;
- renderings: growing conversations of several turn shapes rendered through `/apply-template`; what
  the server rendered plus what the model said must be an exact prefix of the next rendering (a
  template that rewrites the reply, or puts something at the prompt end that history lacks, breaks it);
- a rewritten turn: after a long reply, the agent sends a different one (a barge-in cut it short).
  The cache up to the reply must survive; a sliding-window or recurrent model without context
  checkpoints loses it all (trap 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from fleet.probes import ProbeResult
from fleet.probes.call import Call
from fleet.probes.stream import Connection

TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "find_slots", "arguments": '{"date": "tuesday", "part_of_day": "morning"}'},
}
# Each shape: the messages the agent appends after the first user turn, each assistant message followed by
# another one; an assistant message's text is what the model said, so the rendering before it plus that
# text must prefix the rendering after it.
TURN_SHAPES: dict[str, list[dict[str, Any]]] = {
    "plain": [{"role": "assistant", "content": "Sure, one moment."}, {"role": "user", "content": "Thanks."}],
    "tool call": [
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"slots": ["10:00", "11:30"]}'},
        {"role": "assistant", "content": "Ten or half past eleven?"},
        {"role": "user", "content": "Ten."},
    ],
    "whitespace": [{"role": "assistant", "content": " Okay, booked. \n"}, {"role": "user", "content": "Great."}],
    "empty reply": [{"role": "assistant", "content": ""}, {"role": "user", "content": "Hello?"}],
}
REWRITE_REPLY = "Sorry, go on."


@dataclass(frozen=True)
class WarmTurn:
    prompt_tokens: int
    prompt_n: int
    cache_n: int
    appended: int  # tokens added since the previous turn's cached prompt


@dataclass(frozen=True)
class PrefixBreak:
    shape: str
    step: int
    at_char: int
    at_token: int | None
    before: str
    after: str


@dataclass(frozen=True)
class Rewrite:
    prefix_tokens: int  # the prompt before the replaced reply: what should stay cached
    cache_n: int
    prompt_n: int


def judge_cache(
    turns: list[WarmTurn], breaks: list[PrefixBreak], rewrite: Rewrite | None, allowance: int
) -> ProbeResult:
    """The verdict on measured warm turns, rendering checks and the rewritten turn."""
    metrics: dict[str, Any] = {
        "prompt_n": [t.prompt_n for t in turns],
        "cache_n": [t.cache_n for t in turns],
        "appended": [t.appended for t in turns],
        "prefix_breaks": [vars(b) for b in breaks],
        "rewrite": vars(rewrite) if rewrite else None,
    }
    problems = []
    for i, t in enumerate(turns, start=2):
        if t.prompt_n > t.appended + allowance:
            problems.append(
                f"turn {i} re-processed {t.prompt_n} tokens for {t.appended} appended: the prefix "
                f"broke {t.prompt_n - t.appended} tokens back"
            )
        elif t.cache_n < t.prompt_tokens - t.appended - allowance:
            problems.append(f"turn {i} reused only {t.cache_n} cached tokens of {t.prompt_tokens - t.appended}")
    for b in breaks:
        where = f"token {b.at_token}" if b.at_token is not None else f"character {b.at_char}"
        problems.append(
            f"the template rewrites history ({b.shape}, step {b.step}): the prefix breaks at {where}: "
            f"{b.before!r} became {b.after!r}"
        )
    if rewrite is not None and rewrite.cache_n < rewrite.prefix_tokens - allowance:
        problems.append(
            f"cache lost on a rewritten turn: cache_n {rewrite.cache_n} of {rewrite.prefix_tokens} "
            "(sliding-window or recurrent memory without context checkpoints re-processes everything)"
        )
    if problems:
        return ProbeResult("cache", False, "; ".join(problems), metrics)
    return ProbeResult("cache", True, f"{len(turns)} warm turns reused the cache; renderings are prefixes", metrics)


def first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


async def _render(
    client: httpx.AsyncClient, messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation_prompt: bool
) -> str:
    r = await client.post(
        "/apply-template", json={"messages": messages, "tools": tools, "add_generation_prompt": generation_prompt}
    )
    r.raise_for_status()
    return r.json()["prompt"]


async def _token_count(client: httpx.AsyncClient, text: str) -> int | None:
    r = await client.post("/tokenize", json={"content": text, "add_special": False})
    return len(r.json()["tokens"]) if r.status_code == 200 else None


async def check_renderings(client: httpx.AsyncClient, call: Call) -> list[PrefixBreak]:
    """For each turn shape: the rendering before each assistant message, plus what the model said,
    must be an exact prefix of the rendering with that message in history."""
    breaks = []
    for shape, appended in TURN_SHAPES.items():
        messages = [{"role": "system", "content": call.system}, {"role": "user", "content": call.user_turns[0]}]
        for step, message in enumerate(appended, start=1):
            if message["role"] == "assistant":
                before = await _render(client, messages, call.tools, generation_prompt=True)
                # A tool call's own syntax is the template's business: then only the prompt end must hold.
                said = "" if message.get("tool_calls") else (message.get("content") or "")
                expected = before + said
                # A trailing assistant message renders as a prefill (left open), so render it in history,
                # followed by what the agent sends next.
                after = await _render(
                    client, [*messages, *appended[step - 1 : step + 1]], call.tools, generation_prompt=True
                )
                if not after.startswith(expected):
                    at = first_difference(expected, after)
                    breaks.append(
                        PrefixBreak(
                            shape,
                            step,
                            at,
                            await _token_count(client, expected[:at]),
                            expected[max(0, at - 12) : at + 12],
                            after[max(0, at - 12) : at + 12],
                        )
                    )
                    break
            messages.append(message)
    return breaks


async def run_cache(
    base_url: str, api_key: str, call: Call, turns: int, reply_tokens: int, rewrite_reply_tokens: int, allowance: int
) -> ProbeResult:
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as client:
        breaks = await check_renderings(client, call)
    conn = Connection(base_url, api_key)
    try:
        messages: list[dict[str, Any]] = [{"role": "system", "content": call.system}]
        warm: list[WarmTurn] = []
        previous: tuple[int, int] | None = None  # (prompt_tokens, predicted_n) of the last turn
        for k in range(turns):
            messages.append({"role": "user", "content": call.user_turns[k % len(call.user_turns)]})
            body = {"messages": messages, "tools": call.tools, "max_tokens": reply_tokens, "temperature": 0}
            result = await conn.chat(body)
            if result.status != 200:
                return ProbeResult("cache", False, f"turn {k + 1} answered {result.error}", {})
            prompt_tokens = int(result.usage.get("prompt_tokens", 0))
            if previous is not None:
                cached_before = previous[0] + max(previous[1] - 1, 0)  # the last sampled token is never decoded
                warm.append(
                    WarmTurn(
                        prompt_tokens,
                        int(result.server_timings.get("prompt_n", 0)),
                        int(result.server_timings.get("cache_n", 0)),
                        prompt_tokens - cached_before,
                    )
                )
            previous = (prompt_tokens, int(result.server_timings.get("predicted_n", 0)))
            messages.append({"role": "assistant", "content": result.content})

        rewrite = None
        if rewrite_reply_tokens:
            messages.append({"role": "user", "content": call.user_turns[turns % len(call.user_turns)]})
            long = await conn.chat(
                {
                    "messages": messages,
                    "tools": call.tools,
                    "max_tokens": rewrite_reply_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
            )
            prefix = int(long.usage.get("prompt_tokens", 0))
            messages += [
                {"role": "assistant", "content": REWRITE_REPLY},
                {"role": "user", "content": call.user_turns[(turns + 1) % len(call.user_turns)]},
            ]
            after = await conn.chat({"messages": messages, "tools": call.tools, "max_tokens": 4, "temperature": 0})
            rewrite = Rewrite(
                prefix, int(after.server_timings.get("cache_n", 0)), int(after.server_timings.get("prompt_n", 0))
            )
    finally:
        await conn.close()
    return judge_cache(warm, breaks, rewrite, allowance)
