#!/usr/bin/env python3
"""Two calls decoding at once: on neighbouring slots, on slots apart, and with one unified KV cache, side by
side on one llama-server build in one run.

llama-server started with `-np N` keeps one KV cache stream per slot. llama.cpp batches the concurrent
slots of a decode step into one micro-batch only while their sequence ids (the slot ids) are consecutive
(llama_batch_allocr::split_equal with `sequential`, which the multi-stream cache asks for): two calls on
slots 0 and 2 cost two forward passes a step, each reading every weight once. On a card, where a step
reads the weights and costs the same for one token or two, that halves each caller's decode (bench/gpu/run
path: 137 against 64 tok/s per caller on an H200). Which slots a host's calls land on is its history's
doing (earlier calls, fleet's probes), so a fresh server (slots taken in order) hides it.

Each row pins two streamed completions to two slots (`id_slot`) and reads the server's own counters: its
decode rate for each, and how many of the steps reused the previous step's graph ("graphs reused" in its
log): a step that decodes both calls in one pass reuses it, passes that alternate between two streams
never do. The counts show the mechanism on any machine; the rates, on this CPU, only its direction.

Usage: .venv/bin/python bench/slots.py [--tokens 400]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from fleet.localcloud import tinymodels, toolchain
from fleet.localcloud.network import free_port

PAIRS = ((0, 1), (0, 2), (1, 3))
REUSED = re.compile(r"graphs reused =\s+(\d+)")


def serve(binary: Path, model: Path, port: int, flags: list[str], log: Path) -> subprocess.Popen:
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "16384", "-np", "4"]
    with log.open("w") as out:
        process = subprocess.Popen(
            [*argv, "-t", "1", *flags], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    raise SystemExit(f"llama-server did not start: {log.read_text()[-2000:]}")


async def pair(port: int, slots: tuple[int, int], tokens: int) -> list[float]:
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(slot: int) -> float:
            body = {"prompt": f"call {slot}: " + "hello " * 50, "n_predict": tokens, "id_slot": slot,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            reply = await client.post(f"http://127.0.0.1:{port}/completion", json=body)
            reply.raise_for_status()
            return float(reply.json()["timings"]["predicted_per_second"])

        return list(await asyncio.gather(*(one(s) for s in slots)))


def reused(log: Path) -> int:
    found = REUSED.findall(log.read_text())
    return int(found[-1]) if found else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=400, help="tokens each call decodes")
    args = parser.parse_args()
    if args.tokens < 16:
        print("error: --tokens takes 16 or more", file=sys.stderr)
        return 2
    binary = toolchain.llama_server_path()
    if binary is None:
        print("error: no llama-server built: run scripts/build-llama-server", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = tinymodels.generate("tiny", tmp / "tiny.gguf")
        for cache, flags in (("one stream per slot (-np 4)", []), ("unified (-np 4 -kvu)", ["-kvu"])):
            log = tmp / f"{len(rows)}.log"
            port = free_port()
            process = serve(binary, model, port, flags, log)
            try:
                for slots in PAIRS:
                    before = reused(log)
                    rates = asyncio.run(pair(port, slots, args.tokens))
                    time.sleep(0.2)  # the second reply's timing line reaches the log
                    rows.append((cache, slots, rates, reused(log) - before))
            finally:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=30)
    adjacent = {cache: sum(r) / 2 for cache, slots, r, _ in rows if slots == (0, 1)}
    print(f"| KV cache | slots | tok/s per call | / slots 0 and 1 | of the {args.tokens} steps, one pass for both |")
    print("| --- | --- | ---: | ---: | ---: |")
    for cache, slots, rates, steps in rows:
        mean = sum(rates) / 2
        print(f"| {cache} | {slots[0]} and {slots[1]} | {mean:.0f} | {mean / adjacent[cache]:.2f} | "
              f"{steps} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
