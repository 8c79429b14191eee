"""A raw HTTP/1.1 client for llama-server's streamed chat completions, with the timing every probe shares.

The timer starts before the TCP connect (when the request needs a new connection) and stops at
the first non-empty `content` delta of the SSE stream: role-only chunks, empty deltas, reasoning and
tool-call deltas do not count. Connect, the TLS handshake, time to headers, first content and total are
kept apart. A host speaks only HTTPS, verified against fleet's CA; plain HTTP is for a server on this
machine.
It is a plain socket client on purpose: it must see exactly when the server closes a connection,
which a pooling HTTP library hides.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from fleet.core.errors import FleetError
from fleet.engines.replies import Timings, decode_rate, usage_counts
from fleet.probes.server import Server

CLOSE_CHECK_S = 0.05
MAX_BODY = 16 << 20  # bytes of one answer: a long streamed reply is a few hundred kB


class StreamError(FleetError, RuntimeError):
    pass


class SseParser:
    """Incremental SSE parsing: feed bytes as they arrive, get whole events' data back.

    Events may be split anywhere across reads; comment lines (`:` ...) and fields other than
    `data` are skipped; several `data` lines of one event are joined with newlines.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events = []
        while True:
            cut = self._buffer.find(b"\n")
            if cut < 0:
                return events
            raw, self._buffer = self._buffer[:cut], self._buffer[cut + 1 :]
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith(":"):
                continue
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))


@dataclass
class Timing:
    connect_ms: float | None  # the TCP connect; None when the request reused an open connection
    headers_ms: float
    first_content_ms: float | None
    total_ms: float
    reused: bool
    tls_ms: float | None = None  # the TLS handshake after the connect; None when reused or plain HTTP
    first_event_ms: float | None = None  # the first streamed event: its first token decoded, content or not


@dataclass
class ChatResult:
    status: int
    timing: Timing
    content: str = ""
    reasoning: str = ""
    tool_calls: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    server_timings: dict[str, Any] = field(default_factory=dict)
    events: int = 0
    error: str | None = None
    server_closed: bool = False  # the server closed the connection after this response
    max_tokens: int | None = None  # what the request asked for: no reply holds more

    @property
    def served(self) -> Timings:
        """What the server says of this reply: its `timings`, else its `usage` (fleet/engines/replies.py)."""
        return Timings.of(self.server_timings, self.usage)

    @property
    def delivered_tok_s(self) -> float | None:
        """What arrived here: the tokens the server counts (no more than were asked for) after the first, over
        this clock's time from the first event (the first token, whether or not it was text yet: vLLM holds
        back bytes that do not decode yet) to the end; None when that says nothing."""
        tokens = self._tokens()
        first = self.timing.first_event_ms if self.timing.first_event_ms is not None else self.timing.first_content_ms
        if first is None or tokens < 2 or self.timing.total_ms <= first:
            return None
        return (tokens - 1) / ((self.timing.total_ms - first) / 1000)

    def _tokens(self) -> int:
        """The tokens the server counts for this reply, no more than the request asked for."""
        tokens = self.usage.get("completion_tokens") or self.served.predicted_n
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            tokens = self.served.predicted_n
        return min(tokens, self.max_tokens) if self.max_tokens is not None else tokens

    @property
    def whole_tok_s(self) -> float | None:
        """The tokens the server counts (no more than were asked for) over this reply's whole time, from the
        request to the last byte; None when that says nothing."""
        tokens = self._tokens()
        if tokens < 1 or self.timing.total_ms <= 0:
            return None
        return tokens / (self.timing.total_ms / 1000)

    @property
    def decode_tok_s(self) -> float | None:
        """This reply's decode rate as fleet/engines/replies.py's decode_rate reads it: the server's own,
        bounded by what arrived; where the server states none, its tokens over the whole reply."""
        return decode_rate(self.served, self.delivered_tok_s, self.whole_tok_s)

    def as_response(self) -> dict[str, Any]:
        """The shape of a non-streamed response, for verdicts written against that."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        return {
            "choices": [{"message": message, "finish_reason": self.finish_reason}],
            "usage": self.usage,
            "timings": self.server_timings,
        }


class Connection:
    """One client connection to a llama-server, reopened only when the server closed it."""

    def __init__(self, server: Server) -> None:
        parts = urlsplit(server.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise StreamError(f"only http:// and https:// URLs are supported, not {server.url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.api_key = server.api_key
        self.tls_name = server.tls_name or self.host  # what its certificate must name
        self.tls: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self.tls = server.tls or ssl.create_default_context()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.opened = 0  # how many TCP connections this object has made

    @property
    def is_open(self) -> bool:
        return self._reader is not None and not self._reader.at_eof() and self._writer is not None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await self._writer.wait_closed()
        self._reader = self._writer = None

    async def _ensure_open(self) -> tuple[float, float | None] | None:
        """(connect ms, TLS handshake ms) for a new connection; None when the open one is kept."""
        if self.is_open:
            return None
        await self.close()
        started = time.perf_counter()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        connected = time.perf_counter()
        tls_ms = None
        if self.tls is not None:
            try:
                await writer.start_tls(self.tls, server_hostname=self.tls_name)
            except (ssl.SSLError, ConnectionError) as e:
                writer.close()
                raise StreamError(f"TLS with {self.host}:{self.port} failed: {e}") from None
            tls_ms = (time.perf_counter() - connected) * 1000
        self._reader, self._writer = reader, writer
        self.opened += 1
        return (connected - started) * 1000, tls_ms

    async def chat(self, body: dict[str, Any], *, check_close: bool = False) -> ChatResult:
        """POST /v1/chat/completions with stream on; time it; parse the SSE events."""
        payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
        started = time.perf_counter()
        opened = await self._ensure_open()
        reused = opened is None
        connect_ms, tls_ms = opened if opened is not None else (None, None)
        assert self._reader is not None and self._writer is not None
        head = [
            "POST /v1/chat/completions HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
            "Accept: text/event-stream",
            "Connection: keep-alive",
        ]
        if self.api_key:
            head.append(f"Authorization: Bearer {self.api_key}")
        try:
            self._writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
            await self._writer.drain()
            status, headers = await self._read_head()
        except asyncio.LimitOverrunError:
            raise StreamError("the answer's head runs past 64 KiB") from None
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            if reused:  # the server closed while we were idle: once more on a fresh connection
                await self.close()
                return await self.chat(body, check_close=check_close)
            raise StreamError(f"connection failed: {e}") from None
        headers_ms = (time.perf_counter() - started) * 1000
        result = ChatResult(status=status, timing=Timing(connect_ms, headers_ms, None, 0.0, reused, tls_ms))
        result.max_tokens = body.get("max_tokens") if isinstance(body.get("max_tokens"), int) else None
        parser = SseParser()
        first_content: float | None = None
        if status != 200:
            raw = b"".join([chunk async for chunk in self._body(headers)])
            result.error = f"HTTP {status}: {_error_message(raw)}"
            result.timing.total_ms = (time.perf_counter() - started) * 1000
            if headers.get("connection", "").lower() == "close":
                await self.close()
                result.server_closed = True
            return result
        async for chunk in self._body(headers):
            for data in parser.feed(chunk):
                if data == "[DONE]":
                    continue
                if result.timing.first_event_ms is None:
                    result.timing.first_event_ms = (time.perf_counter() - started) * 1000
                result.events += 1
                if first_content is None and self._apply(result, data):
                    first_content = (time.perf_counter() - started) * 1000
                elif first_content is not None:
                    self._apply(result, data)
        result.timing.first_content_ms = first_content
        result.timing.total_ms = (time.perf_counter() - started) * 1000
        if headers.get("connection", "").lower() == "close":
            await self.close()
            result.server_closed = True
        elif check_close:
            await asyncio.sleep(CLOSE_CHECK_S)
            result.server_closed = self._reader is None or self._reader.at_eof()
        return result

    @staticmethod
    def _apply(result: ChatResult, data: str) -> bool:
        """Fold one event into the result; True when it carried non-empty content."""
        try:
            event = json.loads(data)
        except ValueError:
            result.error = f"unparseable event: {data[:80]!r}"
            return False
        if "error" in event:
            result.error = str(event["error"])
            return False
        if event.get("usage"):
            result.usage = usage_counts(event["usage"])
        if event.get("timings"):
            result.server_timings = event["timings"]
        got_content = False
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if isinstance(content, str) and content:
                result.content += content
                got_content = True
            reasoning = delta.get("reasoning_content")
            if isinstance(reasoning, str):
                result.reasoning += reasoning
            result.tool_calls += len(delta.get("tool_calls") or [])
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        return got_content

    async def _read_head(self) -> tuple[int, dict[str, str]]:
        assert self._reader is not None
        raw = await self._reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            raise StreamError(f"bad status line {lines[0]!r}") from None
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        return status, headers

    async def _body(self, headers: dict[str, str]):  # type: ignore[no-untyped-def]
        """The answer's body as it arrives, at most MAX_BODY bytes of it (a host's answer is not trusted)."""
        try:
            async for data in self._raw_body(headers):
                yield data
        except asyncio.LimitOverrunError:
            raise StreamError("a chunk's size line runs past 64 KiB") from None

    async def _raw_body(self, headers: dict[str, str]):  # type: ignore[no-untyped-def]
        assert self._reader is not None
        reader = self._reader
        total = 0
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await reader.readuntil(b"\r\n")
                try:
                    size = int(size_line.split(b";")[0].strip() or b"0", 16)
                except ValueError:
                    raise StreamError(f"bad chunk size {size_line[:40]!r}") from None
                total += size
                if total > MAX_BODY:
                    raise StreamError(f"the answer runs past {MAX_BODY} bytes")
                if size == 0:
                    await reader.readuntil(b"\r\n")  # the empty trailer
                    return
                data = await reader.readexactly(size)
                await reader.readexactly(2)
                yield data
        elif "content-length" in headers:
            try:
                remaining = int(headers["content-length"])
            except ValueError:
                raise StreamError(f"bad Content-Length {headers['content-length'][:40]!r}") from None
            if remaining > MAX_BODY:
                raise StreamError(f"the answer runs past {MAX_BODY} bytes")
            while remaining > 0:
                data = await reader.read(min(remaining, 65536))
                if not data:
                    raise StreamError("connection closed mid-body")
                remaining -= len(data)
                yield data
        else:
            while data := await reader.read(65536):
                total += len(data)
                if total > MAX_BODY:
                    raise StreamError(f"the answer runs past {MAX_BODY} bytes")
                yield data
            await self.close()


def _error_message(raw: bytes) -> str:
    """llama-server's error body is {"error": {"message": ...}}; fall back to the raw text."""
    try:
        body = json.loads(raw)
        error = body.get("error", body)
        return str(error.get("message", error) if isinstance(error, dict) else error)[:300]
    except ValueError:
        return raw.decode("utf-8", errors="replace")[:300]
