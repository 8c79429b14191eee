#!/usr/bin/env python3
"""What Google's Gemma 4 chat template costs a warm turn against fleet's repaired one, measured on a
real llama-server: the tokens it processes (`prompt_n`) on the turn after each of the six turn shapes.

For each template the tiny model is served with it, and for each shape (fleet/probes/renderings.py) the
server's cache is first filled with exactly what it holds after the model spoke: the prompt it was sent
(the generation prompt included) plus what the model said, in the model's own syntax (a tool call as
Gemma 4 writes it, arguments in the order the model chose, then the `<|tool_response>` it stops on).
Then the agent's next request (that message in history, the next one appended) is sent and the server's
own timings say how many tokens it processed and how many it took from the cache. "Appended" is what
the agent added: the next request's tokens less those the model's turn left in the cache.
Target: the repaired template processes only what was appended, plus the reply and the empty thought
block that Gemma 4 with thinking off drops from history (the glue, the same with both templates).

Usage: .venv/bin/python bench/template_cache.py
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.localcloud import tinymodels, toolchain
from fleet.localcloud.llamaproc import llama_server
from fleet.probes import template as chat_template
from fleet.probes.call import load_call
from fleet.probes.renderings import TURN_SHAPES

TEMPLATES = ("gemma-4.jinja", "gemma-4.repaired.jinja")
KWARGS = {"enable_thinking": False}
OPEN_TURN = "<|turn>model\n"
CALL_END = "<|tool_response>"
EMPTY_THOUGHT = "<|channel>thought\n<channel|>"


async def said_by_model(messages: list[dict[str, Any]], message: dict[str, Any], following: dict[str, Any]) -> str:
    """What the model wrote for `message`, in Gemma 4's syntax: the faithful (repaired) rendering of it."""
    render = chat_template.LocalRenderer(chat_template.bundled("gemma-4.repaired.jinja"), KWARGS)
    call = load_call()
    history = await render(messages, call.tools, False)
    after = await render([*messages, message, following], call.tools, True)
    start = len(history) + len(OPEN_TURN)
    assert after[len(history) : start] == OPEN_TURN
    if after.startswith(EMPTY_THOUGHT, start):  # given by the generation prompt, not written by the model
        start += len(EMPTY_THOUGHT)
    if message.get("tool_calls"):
        return after[start : after.index(CALL_END, start) + len(CALL_END)]
    return message.get("content") or ""


async def measure(base: str, key: str) -> dict[str, dict[str, int]]:
    call = load_call().with_system_chars(2000)
    out: dict[str, dict[str, int]] = {}
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as client:

        async def tokens(text: str) -> int:
            r = await client.post("/tokenize", json={"content": text, "add_special": True, "parse_special": True})
            return len(r.json()["tokens"])

        for shape, appended in TURN_SHAPES.items():
            messages = [{"role": "system", "content": call.system}, {"role": "user", "content": call.user_turns[0]}]
            message, following = appended[0], appended[1]
            before = (
                await client.post(
                    "/apply-template",
                    json={"messages": messages, "tools": call.tools, "add_generation_prompt": True},
                )
            ).json()["prompt"]
            cached_text = before + await said_by_model(messages, message, following)
            filled = await client.post(
                "/completion", json={"prompt": cached_text, "n_predict": 0, "cache_prompt": True, "temperature": 0}
            )
            filled.raise_for_status()
            nxt = [*messages, message, following]
            r = await client.post(
                "/v1/chat/completions",
                json={"messages": nxt, "tools": call.tools, "max_tokens": 1, "temperature": 0},
            )
            r.raise_for_status()
            timings = r.json()["timings"]
            after = (
                await client.post(
                    "/apply-template", json={"messages": nxt, "tools": call.tools, "add_generation_prompt": True}
                )
            ).json()["prompt"]
            out[shape] = {
                "prompt_n": int(timings["prompt_n"]),
                "cache_n": int(timings["cache_n"]),
                "appended": await tokens(after) - await tokens(cached_text),
            }
    return out


def main() -> int:
    server = toolchain.llama_server_path()
    if server is None:
        print("error: llama-server is not built: run scripts/build-llama-server", file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = tinymodels.ensure(Path(tmp))["tiny"]
        key = secrets.token_urlsafe(24)
        (Path(tmp) / "key").write_text(key)
        for name in TEMPLATES:
            (Path(tmp) / name).write_text(chat_template.bundled(name))
            flags = ["-np", "1", "-c", "16384", "--override-kv", "llama.context_length=int:16384", "-t", "2"]
            flags += ["--jinja", "--chat-template-file", str(Path(tmp) / name)]
            flags += ["--api-key-file", str(Path(tmp) / "key")]
            flags += ["--chat-template-kwargs", json.dumps(KWARGS)]
            with llama_server(server, model, *flags) as base:
                results[name] = asyncio.run(measure(base, key))
    print("tiny model (one token per character), the recorded call's system prompt cut to 2000 characters\n")
    print("| turn shape | appended | prompt_n, Google's | prompt_n, repaired | beyond appended: Google's | repaired |")
    print("|---|---|---|---|---|---|")
    for shape in TURN_SHAPES:
        stock, repaired = results[TEMPLATES[0]][shape], results[TEMPLATES[1]][shape]
        print(
            f"| {shape} | {repaired['appended']} | {stock['prompt_n']} | {repaired['prompt_n']} | "
            f"{stock['prompt_n'] - stock['appended']} | {repaired['prompt_n'] - repaired['appended']} |"
        )
    print(
        "\n(beyond appended: what the warm turn re-processed because the prefix broke: with Google's template "
        "the model's whole last turn, as history drops the empty thought block it was written after)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
