"""llama-server as a simulated host serves it: fleet's own probes, bench and gateway talk to it unchanged, and
one process can play it for many hosts (issue 48: a thousand hosts measured on one machine).

What it answers is what fleet's host image does (fleet's patched llama-server with `--api-key-file`,
`--metrics`, `--no-slots`, `--cache-salt-header`): /health without the key; /props, /tokenize, /apply-template,
/metrics and /v1/chat/completions (streamed or not, with llama-server's `timings`) with it. How it differs, on
purpose:
- a token is one character: /tokenize counts characters, a reply says one character a token. A rendering's
  tokens are then always a prefix of the next rendering's, as with a real tokenizer on a template that keeps
  history (fleet's templates do), and every count fleet checks adds up;
- the chat template is ChatML's (tools in the system turn, a call's arguments as the model wrote them);
- a reply is a fixed sentence, cut at `max_tokens` (every token of it with `ignore_eos`);
- the time a reply takes is the card's: its prompt's uncached tokens at `prefill_tok_s`, then each token at
  the rate one stream gets while as many streams decode at once (cardmodel.py), delivered a tick at a time
  (many streams cost a wakeup a tick each, not one a token).
Its slots keep their prompts as llama-server's do: a request takes the idle slot whose cached prompt shares
the longest prefix with its own, of its own cache salt only (else the least recently used, cleared), and
waits while every slot is busy.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from fleet.localcloud.cardmodel import CardModel

SALT_HEADER = "x-fleet-cache-salt"
REPLY = "Sure, I can help you with that appointment today. "  # what the simulated model says, cut to length
NATURAL_REPLY_TOKENS = 32  # the tokens of a reply that stops on its own (without ignore_eos)
DEFAULT_MAX_TOKENS = 256
PUBLIC = ("/health", "/v1/health")


@dataclass
class Slot:
    cached: str = ""  # the prompt and reply it holds, as tokens (characters)
    salt: str = ""
    busy: bool = False
    used_at: float = 0.0


@dataclass
class Counters:
    waiting: int = 0  # requests waiting for a slot
    prompt_tokens: int = 0
    predicted_tokens: int = 0
    decoding: int = 0  # streams decoding at this moment


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation_prompt: bool) -> str:
    """ChatML, with the tools in the system turn and each call's arguments as the model wrote them."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        if not isinstance(content, str):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if i == 0 and tools:
            content = (content + "\n\n" if m.get("role") == "system" else "") + "# Tools\n" + json.dumps(tools)
        for call in m.get("tool_calls") or []:
            function = call.get("function") or {}
            content += f"\n<tool_call>\n{function.get('name')} {function.get('arguments')}\n</tool_call>"
        out.append(f"<|im_start|>{m.get('role')}\n{content}<|im_end|>\n")
    if generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _common_prefix(a: str, b: str) -> int:
    """The length of the prefix `a` and `b` share (halving by slices: the comparing is done in C, not a
    character at a time, for prompts of thousands of tokens on every slot of a request)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class SimulatedServer:
    card: CardModel
    api_key: str
    slots: int = 4
    ctx_per_slot: int = 8192
    prefill_tok_s: float = 20_000.0
    tick_s: float = 0.05
    model: str = "simulated"
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        self._slots = [Slot() for _ in range(self.slots)]
        self._freed = asyncio.Condition()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=4 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/health", self._health)
        app.router.add_get("/props", self._props)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/apply-template", self._apply_template)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in PUBLIC:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                return _error(401, "authentication_error", "Invalid API Key")
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _props(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "total_slots": self.slots,
                "default_generation_settings": {"n_ctx": self.ctx_per_slot},
                "model_alias": self.model,
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        c = self.counters
        busy = sum(s.busy for s in self._slots)
        lines = [
            ("llamacpp:prompt_tokens_total", "counter", c.prompt_tokens),
            ("llamacpp:tokens_predicted_total", "counter", c.predicted_tokens),
            ("llamacpp:requests_processing", "gauge", busy),
            ("llamacpp:requests_deferred", "gauge", c.waiting),
        ]
        text = "".join(f"# TYPE {name} {kind}\n{name} {value}\n" for name, kind, value in lines)
        return web.Response(text=text, content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await _json(request)
        return web.json_response({"tokens": [ord(ch) for ch in str(body.get("content", ""))]})

    async def _apply_template(self, request: web.Request) -> web.Response:
        body = await _json(request)
        messages = body.get("messages")
        if not isinstance(messages, list):
            return _error(400, "invalid_request_error", "'messages' is required")
        prompt = render(messages, body.get("tools"), bool(body.get("add_generation_prompt", True)))
        return web.json_response({"prompt": prompt})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error(400, "invalid_request_error", "'messages' is required")
        prompt = render(messages, body.get("tools"), True)
        given = [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
        max_tokens = given[0] if given else DEFAULT_MAX_TOKENS  # a zero is refused below, not read as "unset"
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, "invalid_request_error", "max_tokens must be a positive integer")
        if len(prompt) >= self.ctx_per_slot:
            return _error(400, "exceed_context_size_error", "the request exceeds the available context size")
        # a reply stops where the slot's context is full, as llama-server's does without context shift
        room = self.ctx_per_slot - 1 - len(prompt)
        n = min(room, max_tokens if body.get("ignore_eos") else min(max_tokens, NATURAL_REPLY_TOKENS))
        self.counters.waiting += 1
        try:
            slot, shared = await self._take_slot(prompt, request.headers.get(SALT_HEADER, ""))
        finally:
            self.counters.waiting -= 1
        try:
            return await self._serve(
                request, body, slot, prompt, shared, n, finish="length" if n in (max_tokens, room) else "stop"
            )
        finally:
            slot.busy, slot.used_at = False, time.monotonic()
            async with self._freed:
                self._freed.notify()

    async def _take_slot(self, prompt: str, salt: str) -> tuple[Slot, int]:
        """The slot a request takes, and how much of its prompt that slot holds already."""
        async with self._freed:
            while True:
                idle = [s for s in self._slots if not s.busy]
                if idle:
                    shared = {id(s): _common_prefix(s.cached, prompt) for s in idle if s.salt == salt and s.cached}
                    best = max((s for s in idle if shared.get(id(s))), key=lambda s: shared[id(s)], default=None)
                    if best is None:
                        best = min(idle, key=lambda s: s.used_at)
                        if best.salt != salt:
                            best.cached, best.salt = "", salt  # another salt's state is never reused
                    best.busy = True
                    return best, shared.get(id(best), 0)
                await self._freed.wait()

    async def _serve(
        self, request: web.Request, body: dict[str, Any], slot: Slot, prompt: str, cache_n: int, n: int, finish: str
    ) -> web.StreamResponse:
        if cache_n == len(prompt):
            cache_n -= 1  # llama-server evaluates at least the prompt's last token again
        prompt_n = len(prompt) - cache_n
        started = time.monotonic()
        await asyncio.sleep(prompt_n / self.prefill_tok_s)
        self.counters.prompt_tokens += prompt_n
        prompt_ms = (time.monotonic() - started) * 1000
        reply = (REPLY * (n // len(REPLY) + 1))[:n]
        stream = bool(body.get("stream"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream" if stream else "application/json"})
        await response.prepare(request)
        ident = f"chatcmpl-sim{id(slot):x}{int(started * 1e6):x}"

        def chunk(delta: dict[str, Any], reason: str | None = None, **extra: Any) -> bytes:
            event = {"id": ident, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model}
            event["choices"] = [{"index": 0, "delta": delta, "finish_reason": reason}]
            return b"data: " + json.dumps({**event, **extra}).encode() + b"\n\n"

        decode_began = time.monotonic()
        self.counters.decoding += 1
        try:
            if stream:
                await response.write(chunk({"role": "assistant", "content": None}))
            sent, due, last = 0, 1.0, decode_began  # the first token comes with the prompt's last pass
            while sent < n:
                k = min(n, int(due)) - sent
                if k > 0:
                    if stream:
                        await response.write(b"".join(chunk({"content": ch}) for ch in reply[sent : sent + k]))
                    sent += k
                    self.counters.predicted_tokens += k
                if sent < n:
                    await asyncio.sleep(self.tick_s)
                    now = time.monotonic()
                    due += (now - last) * self.card.stream_tok_s(self.counters.decoding)
                    last = now
        finally:
            self.counters.decoding -= 1
        decode_s = max(time.monotonic() - decode_began, 1e-6)
        slot.cached = prompt + reply[:-1]  # the last sampled token is never decoded
        timings = {
            "prompt_n": prompt_n,
            "cache_n": cache_n,
            "prompt_ms": round(prompt_ms, 3),
            "predicted_n": n,
            "predicted_ms": round(decode_s * 1000, 3),
            "predicted_per_second": n / decode_s,
        }
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        if stream:
            await response.write(chunk({}, finish, usage=usage, timings=timings) + b"data: [DONE]\n\n")
        else:
            message = {"role": "assistant", "content": reply}
            whole = {"id": ident, "object": "chat.completion", "created": int(time.time()), "model": self.model}
            whole |= {"choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}
            await response.write(json.dumps({**whole, "timings": timings}).encode())
        await response.write_eof()
        return response


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text='{"error": "the body is not JSON"}', content_type="application/json") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text='{"error": "the body is not a JSON object"}', content_type="application/json")
    return body


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": status, "message": message, "type": kind}}, status=status)
