#!/usr/bin/env python3
"""What fleet's timing harness (fleet/probes/stream.py) adds per request, against a bare socket client.

Both send the same streamed chat completion to the same llama-server (the tiny model, started here
on a free loopback port), alternating request by request, each on a fresh connection (this
llama-server closes after every streamed reply anyway). The bare client writes the request and
reads until the end of the chunked body; the harness also parses every SSE event, times connect,
headers, first content and total, and collects usage and timings.
Target: the harness adds under 1 ms per request (median of the paired differences).
Usage: .venv/bin/python bench/probe_overhead.py [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.localcloud import tinymodels, toolchain
from fleet.localcloud.llamaproc import llama_server
from fleet.probes.server import Server
from fleet.probes.stream import Connection

BODY = {
    "messages": [{"role": "user", "content": "Hello there, how are you today?"}],
    "max_tokens": 16,
    "temperature": 0,
}


async def bare(host: str, port: int) -> float:
    payload = json.dumps({**BODY, "stream": True, "stream_options": {"include_usage": True}}).encode()
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        + payload
    )
    await writer.drain()
    received = b""
    while not received.endswith(b"\r\n0\r\n\r\n"):
        chunk = await reader.read(65536)
        if not chunk:
            break
        received += chunk
    elapsed = (time.perf_counter() - started) * 1000
    writer.close()
    return elapsed


async def harness(base: str) -> float:
    started = time.perf_counter()
    conn = Connection(Server(base))
    result = await conn.chat(BODY)
    elapsed = (time.perf_counter() - started) * 1000
    await conn.close()
    assert result.status == 200 and result.content
    return elapsed


async def main(requests: int) -> None:
    server = toolchain.llama_server_path()
    if server is None:
        raise SystemExit("llama-server is not built: run scripts/setup")
    with tempfile.TemporaryDirectory() as tmp:
        model = tinymodels.generate("tiny", Path(tmp) / "tiny.gguf")
        flags = ["-np", "1", "-c", "2048", "-t", "1"]
        with llama_server(server, model, *flags) as base:
            port = int(base.rsplit(":", 1)[1])
            for _ in range(10):  # warm both paths
                await bare("127.0.0.1", port)
                await harness(base)
            pairs = []
            for i in range(requests):
                if i % 2:
                    h, b = await harness(base), await bare("127.0.0.1", port)
                else:
                    b, h = await bare("127.0.0.1", port), await harness(base)
                pairs.append((b, h))
    bare_ms = statistics.median(b for b, _ in pairs)
    harness_ms = statistics.median(h for _, h in pairs)
    added = statistics.median(h - b for b, h in pairs)
    print(f"streamed chat completion, tiny model, {requests} requests each, alternating (medians)")
    print(f"  bare socket client        {bare_ms:8.3f} ms")
    print(f"  fleet timing harness      {harness_ms:8.3f} ms")
    print(f"  added by the harness      {added:8.3f} ms per request   (target < 1 ms)")
    print(f"  ratio harness / bare      {harness_ms / bare_ms:8.3f} x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    asyncio.run(main(parser.parse_args().requests))
