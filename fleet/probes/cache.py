"""cache: does a warm turn reuse the cached prompt, as a voice agent needs (DOMAIN.md trap 2)?

Three checks:
- live turns: a call-shaped conversation (long system prompt, tools from the first request, short
  messages). On each warm turn `prompt_n` must be about the tokens appended since the last turn
  (plus `probes.prompt_allowance_tokens` of template glue) and `cache_n` must cover the earlier prompt;
- renderings: the six turn shapes of fleet/probes/renderings.py rendered through the server's
  `/apply-template`; what the server rendered plus what the model said must be an exact prefix of the
  next rendering. A break names the shape and the token; a profile may accept a shape's break
  (`accept_template_breaks`). Glue at the prompt end that history drops (Gemma 4's empty thought block)
  is reported, and the live turns may re-process the previous reply and that glue;
- a rewritten turn: after a long reply, the agent sends a different one (a barge-in cut it short).
  The cache up to the reply must survive; a sliding-window or recurrent model without context
  checkpoints loses it all (trap 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from fleet.engines.base import Engine
from fleet.engines.registry import LLAMA_SERVER
from fleet.probes import ProbeResult
from fleet.probes.call import Call
from fleet.probes.renderings import CountTokens, Glue, Message, PrefixBreak, Render, check_renderings
from fleet.probes.server import Server, bounded
from fleet.probes.stream import Connection
from fleet.probes.template import LocalRenderer

REWRITE_REPLY = "Sorry, go on."
READ_DEADLINE_S = 60  # a template render or a token count, whole


@dataclass(frozen=True)
class WarmTurn:
    prompt_tokens: int
    prompt_n: int
    cache_n: int
    appended: int  # tokens added since the previous turn's cached prompt
    previous_reply: int = 0  # tokens the model said last turn (re-processed when the template drops glue)


@dataclass(frozen=True)
class Rewrite:
    prefix_tokens: int  # the prompt before the replaced reply: what should stay cached
    cache_n: int
    prompt_n: int


def judge_cache(
    turns: list[WarmTurn],
    breaks: list[PrefixBreak],
    rewrite: Rewrite | None,
    allowance: int,
    glue: list[Glue] | tuple[Glue, ...] = (),
    accepted: list[str] | tuple[str, ...] = (),
    block_tokens: int = 1,
) -> ProbeResult:
    """The verdict on measured warm turns, rendering checks and the rewritten turn. Breaks in `accepted`
    shapes are reported, not failed; glue lets a warm turn re-process the previous reply and the glue.
    `block_tokens`: the cache keeps whole blocks of this many tokens (vLLM's --block-size), so up to one
    block less of the prefix is found again, by design."""
    glue_tokens = max((g.tokens or 0 for g in glue), default=0) if glue else None
    allowance += block_tokens - 1
    metrics: dict[str, Any] = {
        "prompt_n": [t.prompt_n for t in turns],
        "cache_n": [t.cache_n for t in turns],
        "appended": [t.appended for t in turns],
        "prefix_breaks": [vars(b) for b in breaks],
        "accepted_breaks": [b.shape for b in breaks if b.shape in accepted],
        "glue": {"text": glue[0].text, "tokens": glue_tokens, "shapes": [g.shape for g in glue]} if glue else None,
        "rewrite": vars(rewrite) if rewrite else None,
        "block_tokens": block_tokens,
    }
    problems = []
    for i, t in enumerate(turns, start=2):
        limit = t.appended + allowance + (t.previous_reply + (glue_tokens or 0) if glue else 0)
        if t.prompt_n > limit:
            problems.append(
                f"turn {i} re-processed {t.prompt_n} tokens for {t.appended} appended: the prefix "
                f"broke {t.prompt_n - t.appended} tokens back"
            )
        elif t.cache_n < t.prompt_tokens - limit:
            problems.append(f"turn {i} reused only {t.cache_n} cached tokens of {t.prompt_tokens - t.appended}")
    for b in breaks:
        if b.shape not in accepted:
            problems.append(f"the template rewrites history ({b.describe()})")
    if rewrite is not None and rewrite.cache_n < rewrite.prefix_tokens - allowance - (glue_tokens or 0):
        problems.append(
            f"cache lost on a rewritten turn: cache_n {rewrite.cache_n} of {rewrite.prefix_tokens} "
            "(sliding-window or recurrent memory without context checkpoints re-processes everything)"
        )
    if problems:
        return ProbeResult("cache", False, "; ".join(problems), metrics)
    notes = []
    if metrics["accepted_breaks"]:
        notes.append(f"accepted breaks: {', '.join(metrics['accepted_breaks'])}")
    if glue:
        notes.append(
            f"the prompt end's {glue[0].text!r} is not kept in history: each turn re-processes the reply "
            f"and {glue_tokens if glue_tokens is not None else '?'} tokens of glue"
        )
    return ProbeResult(
        "cache",
        True,
        f"{len(turns)} warm turns reused the cache; renderings are prefixes" + "".join(f"; {n}" for n in notes),
        metrics,
    )


def server_renderer(client: httpx.AsyncClient) -> Render:
    """The renderings check's renderer: the server's own `/apply-template` (its template, its engine)."""

    async def render(messages: list[Message], tools: list[dict[str, Any]], generation_prompt: bool) -> str:
        body = {"messages": messages, "tools": tools, "add_generation_prompt": generation_prompt}
        r = await bounded(client, "POST", "/apply-template", deadline_s=READ_DEADLINE_S, json=body)
        return r.raise_for_status().json()["prompt"]

    return render


def server_token_count(client: httpx.AsyncClient, engine: Engine = LLAMA_SERVER) -> CountTokens:
    """The server's own tokenizer, asked as its engine reads /tokenize."""

    async def count(text: str) -> int | None:
        body = engine.tokenize_body(text)
        r = await bounded(client, "POST", "/tokenize", deadline_s=READ_DEADLINE_S, json=body)
        return len(r.json()["tokens"]) if r.status_code == 200 else None

    return count


async def run_cache(
    server: Server,
    call: Call,
    turns: int,
    reply_tokens: int,
    rewrite_reply_tokens: int,
    allowance: int,
    accepted: list[str] | tuple[str, ...] = (),
    engine: Engine = LLAMA_SERVER,
    template_text: str | None = None,
    block_tokens: int = 1,
) -> ProbeResult:
    """The renderings check, then a conversation's warm turns and a rewritten one against their cache use.
    An engine that renders no template for a client (vLLM) has its renderings rendered here from the
    template's text (what it renders too), counted by its tokenizer."""
    async with server.client(timeout=120) as client:
        if not engine.renders_templates:
            if template_text is None:
                return ProbeResult("cache", False, "the model's repository has no chat template", {})
            renderer: Render = LocalRenderer(template_text, {})
        else:
            renderer = server_renderer(client)
        renderings = await check_renderings(
            renderer, server_token_count(client, engine), call.system, call.user_turns[0], call.tools
        )
    conn = Connection(server)
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
                        result.served.prompt_n,
                        result.served.cache_n,
                        prompt_tokens - cached_before,
                        previous[1],
                    )
                )
            previous = (prompt_tokens, result.served.predicted_n)
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
            rewrite = Rewrite(prefix, after.served.cache_n, after.served.prompt_n)
    finally:
        await conn.close()
    return judge_cache(warm, renderings.breaks, rewrite, allowance, renderings.glue, accepted, block_tokens)
