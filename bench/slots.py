#!/usr/bin/env python3
"""Calls decoding at once on neighbouring slots and on slots apart, with a KV cache stream per slot and with
the one shared cache fleet runs, with and without idle calls held in the other slots: side by side on one
llama-server build in one run.

llama-server started with `-np N` keeps one KV cache stream per slot. llama.cpp batches the concurrent
slots of a decode step into one micro-batch only while their sequence ids (the slot ids) are consecutive
(llama_batch_allocr::split_equal with `sequential`, which the multi-stream cache asks for): two calls on
slots 0 and 2 cost two forward passes a step, each reading every weight once. On a card, where a step
reads the weights and costs the same for one token or two, that halves each caller's decode. Which slots a
host's calls land on is its history's doing (earlier calls, fleet's probes), so a fresh server hides it.
One shared cache (`-kvu`, what fleet adds to a multi-slot profile: fleet/engines/llama_server.py
cache_args) joins any slots in one pass, but a step's attention then reads the cached cells of every call
the host holds, the idle ones too: the rows with every other slot holding an idle call at the same depth
show what that costs.

Each row pins its calls to their slots (`id_slot`), each call's prompt `--depth` tokens deep and cached
before the row, and reads the server's own counters: its decode rate for each call, and how many of the
steps reused the previous step's graph ("graphs reused" in its log): a step that decodes every call in one
pass reuses it, passes that alternate between streams never do. The counts show the mechanism on any
machine; the rates, on this CPU, only its direction (bench/gpu/run slots measures them on a card).

Usage: .venv/bin/python bench/slots.py [--tokens 300] [--depth 300]
       bench/slots.py --profile NAME --model FILE --binary PATH [--depth N] [--json OUT]   (bench/gpu/run slots)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from fleet.core import config
from fleet.core.config import Profile
from fleet.engines.llama_server import KV_LAYOUT, cache_args
from fleet.localcloud import tinymodels, toolchain
from fleet.localcloud.llamaproc import llama_server

REUSED = re.compile(r"graphs reused =\s+(\d+)")
WORDS = "the caller asked about the delivery window and the agent read the order back to them "


def prompt(slot: int, depth: int) -> str:
    """A call's own prompt of about `depth` tokens (one token a character on fleet's byte-level test models)."""
    head = f"call {slot}: "
    return head + (WORDS * (depth // len(WORDS) + 1))[: max(depth - len(head), 1)]


async def complete(client: httpx.AsyncClient, url: str, slot: int, depth: int, tokens: int) -> float:
    body = {"prompt": prompt(slot, depth), "n_predict": tokens, "id_slot": slot, "temperature": 0,
            "ignore_eos": True, "cache_prompt": True}  # fmt: skip
    reply = await client.post(f"{url}/completion", json=body)
    if reply.status_code != 200:
        raise SystemExit(f"slot {slot}: llama-server answered {reply.status_code}: {reply.text[:500]}")
    return float(reply.json()["timings"]["predicted_per_second"])


async def hold(url: str, slots: list[int], depth: int) -> None:
    """Each slot holds a call of `depth` tokens, idle (one token generated), one after another."""
    async with httpx.AsyncClient(timeout=600) as client:
        for slot in slots:
            await complete(client, url, slot, depth, 1)


async def erase(url: str, slots: list[int]) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        for slot in slots:
            (await client.post(f"{url}/slots/{slot}", params={"action": "erase"})).raise_for_status()


async def speak(url: str, slots: tuple[int, ...], depth: int, tokens: int) -> list[float]:
    async with httpx.AsyncClient(timeout=600) as client:
        return list(await asyncio.gather(*(complete(client, url, s, depth, tokens) for s in slots)))


def reused(log: Path) -> int:
    found = REUSED.findall(log.read_text())
    return int(found[-1]) if found else 0


def layouts(profile: Profile) -> list[tuple[str, list[str]]]:
    """(name, flags): a stream per slot, and the shared cache fleet adds, each over the profile's other flags."""
    base = [a for a in profile.args if a not in KV_LAYOUT]
    shared = cache_args(profile.model_copy(update={"args": base}))
    return [("a stream per slot (-no-kvu)", [*base, "-no-kvu"]), ("one shared cache (fleet's)", [*base, *shared])]


def call_sets(slots: int) -> list[tuple[int, ...]]:
    sets: list[tuple[int, ...]] = [(0, 1), (0, 2)]
    if slots >= 4:
        sets.append((1, 3))
    if slots >= 8:
        sets += [(0, 1, 2, 3), (0, 2, 4, 6)]
    return sets


def measure(
    binary: Path, model: Path, profile: Profile, depth: int, tokens: int, work: Path, keep: Path | None
) -> list[dict[str, Any]]:
    """Every row; each also written to `keep` as it is measured (a run cut off brings back what it measured)."""
    rows: list[dict[str, Any]] = []
    everyone = list(range(profile.slots))
    for name, flags in layouts(profile):
        log = work / f"server-{len(rows)}.log"
        saves = work / "saves"  # a slot is erased through /slots, which wants a folder for saves it is never asked
        saves.mkdir(exist_ok=True)
        with llama_server(binary, model, *flags, "--slot-save-path", str(saves), timeout_s=600, log=log) as url:
            for idle in (False, True):
                if idle:
                    asyncio.run(hold(url, everyone, depth))
                for calls in call_sets(profile.slots):
                    others = [s for s in everyone if s not in calls]
                    if not idle:
                        asyncio.run(erase(url, others))
                    asyncio.run(hold(url, list(calls), depth))  # the calls' own history, cached before the row
                    before = reused(log)
                    rates = asyncio.run(speak(url, calls, depth, tokens))
                    time.sleep(0.3)  # the last reply's timing line reaches the log
                    rows.append({"cache": name, "calls": list(calls), "idle_calls": len(others) if idle else 0,
                                 "depth": depth, "tokens": tokens, "tok_s_per_call": sum(rates) / len(rates),
                                 "one_pass_steps": reused(log) - before})  # fmt: skip
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                    if keep:
                        keep.write_text(json.dumps(rows, indent=1))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    best = {  # the neighbouring slots of a fresh server with a stream per slot: the rate llama.cpp's own bench shows
        len(r["calls"]): r["tok_s_per_call"]
        for r in rows
        if r["calls"] == list(range(len(r["calls"]))) and r["idle_calls"] == 0 and r["cache"].startswith("a stream")
    }
    lines = [
        f"| KV cache | speaking calls on slots | idle calls held | tok/s per call | / neighbours, a stream per slot, "
        f"no idle | of the {rows[0]['tokens']} steps, one pass for all |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        rate = r["tok_s_per_call"]
        lines.append(f"| {r['cache']} | {', '.join(map(str, r['calls']))} | {r['idle_calls']} | {rate:.1f} | "
                     f"{rate / best[len(r['calls'])]:.2f} | {r['one_pass_steps']} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=300, help="tokens each call decodes")
    parser.add_argument("--depth", type=int, default=300, help="tokens of each call's prompt")
    parser.add_argument("--profile", help="a profile of FLEET_CONFIG (its flags and slots); default: 4 tiny slots")
    parser.add_argument("--model", type=Path, help="the profile's model file (with --profile)")
    parser.add_argument("--binary", type=Path, help="llama-server (default: the local build)")
    parser.add_argument("--json", type=Path, help="write the rows here too, each as it is measured")
    args = parser.parse_args()
    if args.tokens < 16 or args.depth < 16:
        print("error: --tokens and --depth take 16 or more", file=sys.stderr)
        return 2
    if (args.profile is None) != (args.model is None):
        print("error: --profile and --model go together", file=sys.stderr)
        return 2
    binary = args.binary or toolchain.llama_server_path()
    if binary is None or not binary.exists():
        print("error: no llama-server built: run scripts/build-llama-server", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp_name:
        work = Path(tmp_name)
        if args.profile:
            try:
                profile = config.load().profile(args.profile)
            except config.ConfigError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            model = args.model
            if profile.slots < 3 or any("{file." in a for a in profile.args):
                print(f"error: {args.profile}: this bench takes a profile of 3 or more slots and one model file",
                      file=sys.stderr)  # fmt: skip
                return 2
        else:
            slots, ctx = 4, 4096
            profile = Profile(name="tiny", gpu_ram_gb=0, disk_gb=10, slots=slots, ctx_per_slot=ctx,
                              files=[{"key": "main", "repo": "fleet-local/tiny-models", "file": "tiny.gguf"}],
                              args=["-c", str(slots * ctx), "-np", str(slots), "-t", "1"])  # fmt: skip
            model = tinymodels.generate("tiny", work / "tiny.gguf")
        if args.depth + args.tokens >= profile.ctx_per_slot:
            print(f"error: --depth plus --tokens must fit a slot ({profile.ctx_per_slot})", file=sys.stderr)
            return 2
        rows = measure(binary, model, profile, args.depth, args.tokens, work, args.json)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
