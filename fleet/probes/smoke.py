"""smoke: one chat completion whose `content` is not empty, and no answer without the API key.

Catches DOMAIN.md trap 1 (thinking left on: the reply lands in `reasoning_content`, `content` is
empty, the caller hears silence) and trap 3 (the silence loop: a reply exactly `max_tokens` long
made only of the empty thought marker).
"""

from __future__ import annotations

from typing import Any

from fleet.probes import ProbeResult
from fleet.probes.server import Server
from fleet.probes.stream import Connection

EMPTY_THOUGHT = "<|channel>thought\n<channel|>"
SMOKE_MAX_TOKENS = 16
SMOKE_MESSAGES = [
    {"role": "system", "content": "You are a voice agent. Answer in one short sentence."},
    {"role": "user", "content": "Hello, can you hear me?"},
]


def judge_smoke(response: dict[str, Any], max_tokens: int) -> ProbeResult:
    """The verdict on one non-streamed chat completion response."""
    try:
        choice = response["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        return ProbeResult("smoke", False, "the response has no choices[0].message", {})
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or ""
    usage = response.get("usage") or {}
    completion_tokens = usage.get("completion_tokens")
    at_limit = completion_tokens == max_tokens or choice.get("finish_reason") == "length"
    metrics = {
        "content_chars": len(content),
        "reasoning_chars": len(reasoning),
        "completion_tokens": completion_tokens,
        "finish_reason": choice.get("finish_reason"),
    }
    if not content.strip() and reasoning.strip():
        return ProbeResult(
            "smoke",
            False,
            "thinking is on: the reply landed in reasoning_content and content is empty (set enable_thinking false)",
            metrics,
        )
    stripped = content.replace(EMPTY_THOUGHT, "")
    if content and not stripped.strip() and at_limit:
        return ProbeResult(
            "smoke", False, "silence loop: the reply is only the empty thought marker, repeated to max_tokens", metrics
        )
    if not content.strip():
        reason = "empty content at the token limit" if at_limit else "empty content"
        return ProbeResult("smoke", False, reason, metrics)
    return ProbeResult("smoke", True, "content is not empty", metrics)


async def run_smoke(server: Server) -> ProbeResult:
    """Ask once with the key, streamed (must answer with content), and once without (must be refused)."""
    body = {"messages": SMOKE_MESSAGES, "max_tokens": SMOKE_MAX_TOKENS, "temperature": 0}
    with_key, without_key = Connection(server), Connection(server.without_key())
    try:
        answer = await with_key.chat(body)
        refused = await without_key.chat(body)
    finally:
        await with_key.close()
        await without_key.close()
    if answer.status != 200:
        return ProbeResult("smoke", False, f"chat completion failed: {answer.error}", {"status": answer.status})
    result = judge_smoke(answer.as_response(), SMOKE_MAX_TOKENS)
    t = answer.timing
    metrics = {
        **result.metrics,
        "connect_ms": t.connect_ms,
        "headers_ms": round(t.headers_ms, 3),
        "first_content_ms": round(t.first_content_ms, 3) if t.first_content_ms is not None else None,
        "total_ms": round(t.total_ms, 3),
        "without_key_status": refused.status,
    }
    if refused.status != 401:
        return ProbeResult("smoke", False, f"the server answered HTTP {refused.status} without the API key", metrics)
    return ProbeResult("smoke", result.passed, result.diagnosis, metrics)
