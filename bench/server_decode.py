#!/usr/bin/env python3
"""llama-server's decode at many streams against llama.cpp's own ceiling on the same machine: every stream's
tokens a second through the server, beside `llama-batched-bench` (the same model, build and threads, no
server and no sampling), side by side in one run, on this CPU.

A server step decodes every stream in one pass, then samples each stream's next token on its one thread. With
Gemma's 262,144-token vocabulary that thread's work per stream (the logits into a candidate array, the top-k
over all of them) outweighs the pass itself at 32-64 streams, and the card waits for it (issue 43 measured
0.21-0.29 of batched-bench at 64 streams on an H100). Patch 0004 (images/llama-server/patches) takes the top-k
candidates straight from the logits. Both paths are in the patched binary: a request whose sampler chain puts
typical-p (at 1.0, which changes nothing) before top-k takes the whole-vocabulary path, so each row runs the
same build twice, "top-k first" (0004's path) and "whole vocab" (llama.cpp's path before it), and the
tests (tests/engines/test_llama_sampling.py) show both give the same tokens.

Every request streams its reply, as voice agents do: each token is then a result the server's thread hands to
that request's HTTP thread, which patch 0006 made cost one wakeup, not one for every waiting request (results
before 2026-12-07 were measured with whole replies).

Rows: for each model (the tiny llama with Gemma's vocabulary, and with a 356-token vocabulary for contrast),
each number of streams: the server's tokens a second a stream and over all streams on each path, batched-bench's
over all sequences, and the server's share of it; then the same while decoding alone (the streams' own decode
rates from the server's timings, summed, against batched-bench's generation phase), which leaves out a round's
start. Target (issue 43): >= 0.85 at 64 streams on the card. On this CPU the client, the server's HTTP threads
and the decode share two cores, so the shares say little; the ratio between the paths is what the patch
changes.

Usage: .venv/bin/python bench/server_decode.py [--streams 1,8,32,64] [--tokens 48] [--threads 2]
       [--beside 'FLAGS'] [--stacks N | --perf SECONDS] [--json FILE]
Builds what is missing (scripts/build-llama-server builds llama-batched-bench beside llama-server). On a card
(bench/gpu/run streams): --model-file GGUF --flags '-ngl 99 -fa on' --bin-dir the CUDA build's bin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.localcloud import tinymodels
from fleet.localcloud.llamaproc import llama_server

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stacks

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 16
# fleet's a4b profile's sampling (temperature 1, top-k 64, top-p 0.95, min-p 0)
SAMPLING = {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "min_p": 0.0, "repeat_penalty": 1.0}
TOP_K_FIRST = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
WHOLE_VOCAB = ["typ_p", *[s for s in TOP_K_FIRST if s != "typ_p"]]  # typ_p = 1.0 is a no-op, but it comes first


@dataclass
class Row:
    model: str
    n_vocab: int
    streams: int
    top_k_first: float  # the server's tokens a second over all streams, 0004's path
    whole_vocab: float  # the same over the whole vocabulary
    batched_bench: float  # llama-batched-bench's tokens a second over all sequences
    beside: float | None = None  # top-k first on a second server started with --beside's flags too
    # the same two, decoding alone: the server's streams' own decode rates summed (its timings), batched-bench's
    # generation phase (its speed_tg), the prompts' prefill and a round's ramp out of both
    top_k_decoding: float = 0.0
    batched_decoding: float = 0.0

    @property
    def share_decoding(self) -> float:
        return self.top_k_decoding / self.batched_decoding

    @property
    def share_top_k_first(self) -> float:
        return self.top_k_first / self.batched_bench

    @property
    def share_whole_vocab(self) -> float:
        return self.whole_vocab / self.batched_bench


def build() -> Path:
    """The patched build's bin folder, with llama-server and llama-batched-bench."""
    out = subprocess.run([str(ROOT / "scripts" / "build-llama-server")], check=True, capture_output=True, text=True)
    bin_dir = Path(out.stdout.strip().splitlines()[-1]).parent
    if not (bin_dir / "llama-batched-bench").exists():
        sys.exit(f"server_decode: {bin_dir} has no llama-batched-bench: rerun scripts/build-llama-server")
    return bin_dir


@dataclass
class Rate:
    round: float  # tokens a second over all streams, from the first request sent to the last reply
    decoding: float  # the streams' own decode rates (the server's timings) summed


async def server_rate(url: str, streams: int, tokens: int, samplers: list[str]) -> Rate:
    """`streams` requests sent at once, each its own prompt, every reply `tokens` long (the end of generation
    ignored): tokens a second over all streams over the time from the first request sent to the last reply (the
    prompts' prefill inside it, as in batched-bench's total below), and while decoding."""

    async def one(client: httpx.AsyncClient, k: int, n_predict: int = tokens) -> dict:
        body = {"prompt": f"caller {k}: " + "the order ships " * 4, "n_predict": n_predict, "ignore_eos": True,
                "cache_prompt": False, "seed": 1000 + k, "samplers": samplers, "typ_p": 1.0, "stream": True,
                **SAMPLING}  # fmt: skip
        # streamed, as voice agents read replies: each token is a result the server hands to this request's
        # HTTP thread (a whole reply is one, and hid patch 0006's cost)
        async with client.stream("POST", f"{url}/completion", json=body) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if line.startswith("data: ") and (chunk := json.loads(line[6:])).get("stop"):
                    return chunk["timings"]
        raise RuntimeError(f"stream {k} ended without its last chunk")

    pool = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=pool) as client:
        await one(client, -1)  # warm-up: the first request pays for the server's first graphs
        # every stream's connection opened before the round (a one-token request on each, kept alive): the round's
        # requests then reach the server together, as batched-bench's sequences start together. Opened in the
        # round, each new connection came one server step after the last (14 ms apart at 64 streams on an H100):
        # the round measured the client's ramp, not the server's decode.
        await asyncio.gather(*(one(client, -2 - k, 1) for k in range(streams)))
        started = time.perf_counter()
        timings = await asyncio.gather(*(one(client, k) for k in range(streams)))
        elapsed = time.perf_counter() - started
    return Rate(sum(t["predicted_n"] for t in timings) / elapsed, sum(t["predicted_per_second"] for t in timings))


def batched_bench(bin_dir: Path, model: Path, streams: list[int], tokens: int, flags: list[str]) -> dict[int, Rate]:
    """llama-batched-bench's generated tokens a second over all sequences, by the number of sequences: over its
    whole run and in its generation phase. batched-bench prints its rows through llama.cpp's logging thread,
    which can lose the last one as the program exits: the levels missing are run again."""
    ctx = max(streams) * (PROMPT_TOKENS + tokens + 8)
    found: dict[int, Rate] = {}
    for _ in range(3):
        missing = [n for n in streams if n not in found]
        if not missing:
            break
        levels = ",".join(map(str, missing))
        argv = [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", str(ctx), "-npp", str(PROMPT_TOKENS),
                "-ntg", str(tokens), "-npl", levels, *flags, "--output-format", "jsonl"]  # fmt: skip
        out = subprocess.run(argv, check=True, capture_output=True, text=True)
        for row in (json.loads(line) for line in (out.stdout + out.stderr).splitlines() if line.startswith('{"n_kv')):
            # the generated tokens over the whole run, the prompts' prefill included, as the server's rate is read
            found[row["pl"]] = Rate(row["pl"] * row["tg"] / row["t"], row["speed_tg"])
    if missing := [n for n in streams if n not in found]:
        raise SystemExit(f"server_decode: llama-batched-bench printed no row for {missing} sequences in 3 runs")
    return found


def measure(bin_dir: Path, name: str, model: Path, n_vocab: int, args: argparse.Namespace) -> list[Row]:
    """One model's rows: llama-batched-bench's ceiling at each number of streams, then one server with as many
    slots as the most streams, each level on both paths in turn (`--repeats` times, the median kept)."""
    streams = [int(s) for s in args.streams.split(",")]
    common = [*shlex.split(args.flags), "-t", str(args.threads)]
    ceiling = batched_bench(bin_dir, model, streams, args.tokens, common)
    most = max(streams)
    ctx = most * (PROMPT_TOKENS * 4 + args.tokens + 64)
    flags = [*common, "-tb", str(args.threads), "-np", str(most), "-c", str(ctx), *shlex.split(args.server_flags)]
    rows = []
    beside: dict[int, float] = {}
    if args.beside or args.beside_bin:
        # the same binary with the server's flags beside, or another build: one difference, on the top-k first path
        other = (args.beside_bin or bin_dir) / "llama-server"
        log = args.log_dir / f"llama-server-{name}-beside.log" if args.log_dir else None
        with llama_server(other, model, *flags, *shlex.split(args.beside), timeout_s=600, log=log) as url:
            for n in streams:
                runs = [asyncio.run(server_rate(url, n, args.tokens, TOP_K_FIRST)).round for _ in range(args.repeats)]
                beside[n] = statistics.median(runs)
                print(f"  {name} at {n} streams, beside: {beside[n]:.0f} tok/s", file=sys.stderr)
    log = args.log_dir / f"llama-server-{name}.log" if args.log_dir else None
    with llama_server(bin_dir / "llama-server", model, *flags, timeout_s=600, log=log) as url:
        for n in streams:
            fast, whole = [], []
            for _ in range(args.repeats):  # the paths taken in turn: a drift of the machine falls on both
                fast.append(asyncio.run(server_rate(url, n, args.tokens, TOP_K_FIRST)))
                whole.append(asyncio.run(server_rate(url, n, args.tokens, WHOLE_VOCAB)).round)
            rows.append(
                Row(name, n_vocab, n, statistics.median(r.round for r in fast), statistics.median(whole),
                    ceiling[n].round, beside.get(n), statistics.median(r.decoding for r in fast), ceiling[n].decoding)
            )  # fmt: skip
            print(
                f"  {name} at {n} streams: {rows[-1].top_k_first:.0f} / {rows[-1].whole_vocab:.0f} tok/s",
                file=sys.stderr,
            )
        if args.stacks or args.perf:
            print(f"{name}: where the server's thread is at {most} streams, top-k first\n", file=sys.stderr)
            print(busy_stacks(url, most, args.tokens, args.stacks, args.perf).table(), file=sys.stderr)
    return rows


def busy_stacks(url: str, streams: int, tokens: int, samples: int, perf_s: float = 0) -> stacks.Profile:
    """The server's main thread sampled (bench/stacks.py), by perf for `perf_s` seconds if given, else `samples`
    times by a debugger, while `streams` requests at a time keep it busy."""
    server = next(p for p in Path("/proc").iterdir() if p.name.isdigit() and _child_server(p))
    done = threading.Event()

    def keep_busy() -> None:
        while not done.is_set():
            asyncio.run(server_rate(url, streams, tokens, TOP_K_FIRST))

    load = threading.Thread(target=keep_busy, daemon=True)
    load.start()
    try:
        time.sleep(1.0)
        if perf_s:
            return stacks.perf_sample(int(server.name), perf_s)
        return stacks.sample(int(server.name), samples)
    finally:
        done.set()
        load.join()


def _child_server(proc: Path) -> bool:
    """Whether /proc/PID is a llama-server this process started (llamaproc.llama_server's child)."""
    try:
        stat = (proc / "stat").read_text()
    except OSError:
        return False
    comm, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
    return comm == "llama-server" and int(fields[1]) == os.getpid()


def table(rows: list[Row], title: str, beside: str = "") -> str:
    """`beside`: what the second server differs by, as the table's columns name it."""
    shown = any(r.beside for r in rows)
    lines = [
        title,
        "",
        "| model | vocab | streams | whole vocab | "
        + (f"top-k first, {beside} | " if shown else "")
        + "top-k first | batched-bench | share before | share after | after / before |"
        + (f" as shipped / {beside} |" if shown else "")
        + " decoding: top-k first / batched-bench |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        + (" ---: | ---: |" if shown else "")
        + " ---: |",
    ]
    for r in rows:
        one = (f"{r.beside:.0f} | " if r.beside else "- | ") if shown else ""
        gain = (f" {r.top_k_first / r.beside:.2f} |" if r.beside else " - |") if shown else ""
        lines.append(f"| {r.model} | {r.n_vocab:,} | {r.streams} | {r.whole_vocab:.0f} | {one}{r.top_k_first:.0f} | "
                     f"{r.batched_bench:.0f} | {r.share_whole_vocab:.2f} | {r.share_top_k_first:.2f} | "
                     f"{r.top_k_first / r.whole_vocab:.2f} |{gain} {r.top_k_decoding:.0f} / {r.batched_decoding:.0f} = "
                     f"{r.share_decoding:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,8,32,64")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model-file", type=Path, help="a GGUF to measure instead of the two tiny models")
    parser.add_argument("--name", default=None, help="the model's name in the table (with --model-file)")
    parser.add_argument("--n-vocab", type=int, default=0, help="its vocabulary's size, for the table")
    parser.add_argument("--flags", default="", help="flags for both programs, e.g. '-ngl 99 -fa on' on a card")
    parser.add_argument(
        "--server-flags",
        default="",
        help="flags for the servers alone, e.g. fleet's host cache flags '-no-kvu --no-cache-idle-slots'",
    )
    parser.add_argument("--bin-dir", type=Path, help="llama-server and llama-batched-bench (default: this build)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--log-dir", type=Path, help="keep each server's log here (its graph reuse, its timings)")
    parser.add_argument("--beside", default="", help="also the top-k first path on a server with these flags too")
    parser.add_argument(
        "--beside-bin", type=Path, help="also the top-k first path on this build's llama-server (e.g. one patch less)"
    )
    parser.add_argument(
        "--stacks",
        type=int,
        default=0,
        help="then sample the server's thread this many times at the most streams (gdb or cuda-gdb)",
    )
    parser.add_argument(
        "--perf", type=float, default=0, help="then sample the server's thread with perf for this many seconds instead"
    )
    args = parser.parse_args()
    bin_dir = args.bin_dir or build()
    rows: list[Row] = []
    if args.model_file:
        rows = measure(bin_dir, args.name or args.model_file.stem, args.model_file, args.n_vocab, args)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for model in (tinymodels.LARGE_VOCAB, tinymodels.MODELS["tiny"]):
                path = tinymodels.generate(model, Path(tmp) / model.filename)
                rows += measure(bin_dir, model.name, path, model.n_vocab or len(tinymodels._vocab()[0]), args)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"share_top_k_first": r.share_top_k_first,
                                                      "share_whole_vocab": r.share_whole_vocab,
                                                      "share_decoding": r.share_decoding} for r in rows],
                                        indent=2))  # fmt: skip
    title = (f"llama-server against llama-batched-bench, {bin_dir.parents[1].name}, {args.threads} threads, "
             + (f"servers with `{args.server_flags}`, " if args.server_flags else "")
             + f"{args.tokens} tokens a stream, tokens/s over all streams (median of {args.repeats})")  # fmt: skip
    differs = [f"`{args.beside}`"] if args.beside else []
    differs += [f"the server in `{args.beside_bin}`"] if args.beside_bin else []
    print(table(rows, title, ", ".join(differs)))


if __name__ == "__main__":
    main()
