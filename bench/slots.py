#!/usr/bin/env python3
"""Calls decoding at once on neighbouring slots and on slots apart, with a KV cache stream per slot (fleet's
layout) and with one shared cache (-kvu), with and without idle calls held in the other slots: side by side on
one llama-server build in one run.

llama-server started with `-np N` keeps one KV cache stream per slot. Unpatched, llama.cpp batches the
concurrent slots of a decode step into one micro-batch only while their sequence ids (the slot ids) are
consecutive: two calls on slots 0 and 2 cost two forward passes a step, each reading every weight, half of
each call's decode on a card. fleet's patch 0003 (images/llama-server/patches) decodes any set of slots in one
pass, attention once per run of evenly spaced streams. One shared cache (`-kvu`) joins any slots in one pass
too, but a step's attention then reads the cached cells of every call the host holds, the idle ones too.
Which slots a host's calls land on is its history's doing (earlier calls, fleet's probes), so a fresh server
hides both.

Each row pins its calls to their slots (`id_slot`), each call's prompt `--depth` tokens deep (counted with the
server's /tokenize) and cached before the row, and reads the server's own counters: its decode rate for each
call, and how many of the steps reused the previous step's graph ("graphs reused" in its log): a step that
decodes every call in one pass reuses it, passes that alternate between streams never do. The table gives
each rate over the same number of calls on neighbouring slots (same layout, same idle calls) and over the
same calls with no idle call held, and the least of each over the rows (each row the median of `--repeats`
runs of its calls: one run of 128 tokens on a card is a second, a few percent from the next on a dense
model and up to 16% on the MoE shapes; `--one-text`, every call one prompt, is to take their content out): the
targets (>= 0.95 of neighbours, >= 0.97 of no idle call). The counts show the mechanism on any machine; the
rates, on this CPU, only its direction (bench/gpu/run slots measures them on a card).

Usage: .venv/bin/python bench/slots.py [--tokens 300] [--depth 300] [--layout both] [--repeats 1]
       bench/slots.py --profile NAME --model FILE [--file KEY=PATH] [--slots N] [--config FLEET_TOML]
                      --binary PATH [--depth N] [--repeats N] [--one-text] [--json OUT]   (bench/gpu/run slots)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from fleet.core import config
from fleet.core.config import Profile
from fleet.engines import registry
from fleet.engines.llama_server import KV_LAYOUT, SHARED_CACHE, cache_args
from fleet.localcloud import tinymodels, toolchain
from fleet.localcloud.llamaproc import llama_server

REUSED = re.compile(r"graphs reused =\s+(\d+)")
WORDS = "the caller asked about the delivery window and the agent read the order back to them "
STREAM, SHARED = "a stream per slot (fleet's)", "one shared cache (-kvu)"


class Prompts:
    """Each slot's own call, about `depth` tokens deep by the server's tokenizer (a byte-level test model makes a
    token of each character; a real vocabulary, several)."""

    def __init__(self, url: str, depth: int, one_text: bool = False) -> None:
        sample = WORDS * 40
        reply = httpx.post(f"{url}/tokenize", json={"content": sample}, timeout=60)
        reply.raise_for_status()
        self.chars_per_token = len(sample) / max(len(reply.json()["tokens"]), 1)
        self.depth = depth
        self.one_text = one_text  # every call the same text: the same tokens, the same experts and drafts

    def of(self, slot: int) -> str:
        head = "call: " if self.one_text else f"call {slot}: "
        chars = max(int(self.depth * self.chars_per_token) - len(head), 1)
        return head + (WORDS * (chars // len(WORDS) + 1))[:chars]


async def complete(client: httpx.AsyncClient, url: str, slot: int, text: str, tokens: int) -> dict[str, Any]:
    """The reply's `timings`: its decode rate, and with a draft model how many drafted tokens it accepted."""
    body = {"prompt": text, "n_predict": tokens, "id_slot": slot, "temperature": 0, "ignore_eos": True,
            "cache_prompt": True}  # fmt: skip
    reply = await client.post(f"{url}/completion", json=body)
    if reply.status_code != 200:
        raise SystemExit(f"slot {slot}: llama-server answered {reply.status_code}: {reply.text[:500]}")
    return dict(reply.json()["timings"])


async def hold(url: str, slots: list[int], prompts: Prompts) -> None:
    """Each slot holds its call, idle (one token generated), one after another."""
    async with httpx.AsyncClient(timeout=600) as client:
        for slot in slots:
            await complete(client, url, slot, prompts.of(slot), 1)


async def erase(url: str, slots: list[int]) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        for slot in slots:
            (await client.post(f"{url}/slots/{slot}", params={"action": "erase"})).raise_for_status()


async def speak(url: str, slots: tuple[int, ...], prompts: Prompts, tokens: int) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=600) as client:
        return list(await asyncio.gather(*(complete(client, url, s, prompts.of(s), tokens) for s in slots)))


def passes_per_s(timings: dict[str, Any]) -> float:
    """The target model's forward passes a second for this call: each pass yields one token and the drafted
    ones it accepts, so this is the decode rate with the draft's luck taken out. The first token came with the
    prompt's pass, as llama-server's own `predicted_per_second` counts it."""
    passes = float(timings["predicted_n"]) - 1.0 - float(timings.get("draft_n_accepted", 0))
    return passes / float(timings["predicted_ms"]) * 1000.0


def reused(log: Path) -> int:
    found = REUSED.findall(log.read_text())
    return int(found[-1]) if found else 0


def layouts(profile: Profile, which: str) -> list[tuple[str, list[str]]]:
    """(name, flags): a stream per slot as fleet runs it, and one shared cache as fleet runs a profile that asks
    for it, each over the profile's other flags."""
    base = [a for a in profile.args if a not in KV_LAYOUT]
    stream = [*base, *cache_args(profile.model_copy(update={"args": base}))]
    asked = [*base, SHARED_CACHE[0]]
    shared = [*asked, *cache_args(profile.model_copy(update={"args": asked}))]
    found = [(STREAM, stream), (SHARED, shared)]
    return [f for f in found if which == "both" or f[0] == {"stream": STREAM, "shared": SHARED}[which]]


def call_sets(slots: int) -> list[tuple[int, ...]]:
    """Neighbours first for each number of calls (the reference), then sets apart: evenly spaced and not."""
    if slots >= 8:
        return [(0, 1), (0, 2), (3, 7), (0, 1, 2), (0, 2, 5), (1, 4, 6), (0, 1, 2, 3), (0, 2, 4, 6), (1, 2, 6, 7)]
    return [(0, 1), (0, 2), (1, 3), (0, 1, 2), (0, 1, 3)]


def measure(
    binary: Path, model: Path, profile: Profile, files: dict[str, str], which: str, depth: int, tokens: int,
    work: Path, keep: Path | None, repeats: int = 1, one_text: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every row; each also written to `keep` as it is measured (a run cut off brings back what it measured).
    `files`: the path of each of the profile's other files, by key ({file.KEY} in its flags). A row's rate is
    the median over `repeats` runs of its calls (each run's rate the mean of its calls'), its steps the mean;
    with a draft model, its target passes a second the same way and the share of drafted tokens accepted."""
    rows: list[dict[str, Any]] = []
    everyone = list(range(profile.slots))
    for name, flags in layouts(profile, which):
        flags = [re.sub(r"\{file\.([a-z0-9_]+)\}", lambda m: files[m.group(1)], a) for a in flags]
        log = work / f"server-{len(rows)}.log"
        saves = work / "saves"  # a slot is erased through /slots, which wants a folder for saves it is never asked
        saves.mkdir(exist_ok=True)
        with llama_server(binary, model, *flags, "--slot-save-path", str(saves), timeout_s=600, log=log) as url:
            prompts = Prompts(url, depth, one_text)
            for idle in (False, True):
                if idle:
                    asyncio.run(hold(url, everyone, prompts))
                for calls in call_sets(profile.slots):
                    others = [s for s in everyone if s not in calls]
                    if not idle:
                        asyncio.run(erase(url, others))
                    asyncio.run(hold(url, list(calls), prompts))  # the calls' own history, cached before the row
                    before = reused(log)
                    runs, passes, drafted, accepted = [], [], 0, 0
                    for _ in range(repeats):  # each run from the same cached history: the prompt again
                        timings = asyncio.run(speak(url, calls, prompts, tokens))
                        runs.append(sum(t["predicted_per_second"] for t in timings) / len(timings))
                        passes.append(sum(passes_per_s(t) for t in timings) / len(timings))
                        drafted += sum(int(t.get("draft_n", 0)) for t in timings)
                        accepted += sum(int(t.get("draft_n_accepted", 0)) for t in timings)
                    time.sleep(0.3)  # the last reply's timing line reaches the log
                    rows.append({"cache": name, "calls": list(calls), "idle_calls": len(others) if idle else 0,
                                 "depth": depth, "tokens": tokens, "tok_s_per_call": statistics.median(runs),
                                 "runs_tok_s": runs, "one_pass_steps": (reused(log) - before) // repeats,
                                 "passes_s_per_call": statistics.median(passes),
                                 "draft_accepted": accepted / drafted if drafted else None})  # fmt: skip
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                    if keep:
                        keep.write_text(json.dumps(rows, indent=1))
    return rows


def ratios(rows: list[dict[str, Any]], key: str = "tok_s_per_call") -> list[tuple[float | None, float | None]]:
    """Each row's rate (`key`) over the neighbouring slots' with as many calls (same layout and idle calls), and
    over the same calls' with no idle call held (same layout); None where the reference was not measured."""

    def rate(cache: str, calls: list[int], idle: bool) -> float | None:
        found = [r[key] for r in rows
                 if r["cache"] == cache and r["calls"] == calls and (r["idle_calls"] > 0) == idle]  # fmt: skip
        return found[0] if found else None

    out = []
    for r in rows:
        idle = r["idle_calls"] > 0
        neighbours = rate(r["cache"], list(range(len(r["calls"]))), idle)
        alone = rate(r["cache"], r["calls"], False)
        own = r[key]
        out.append((own / neighbours if neighbours else None, own / alone if alone and idle else None))
    return out


def table(rows: list[dict[str, Any]]) -> str:
    found = ratios(rows)
    lines = [
        f"| KV cache | speaking calls on slots | idle calls held | tok/s per call | / neighbours | / no idle call "
        f"| of the {rows[0]['tokens']} steps, one pass for all |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r, (apart, idle) in zip(rows, found, strict=True):
        cells = [f"{x:.2f}" if x is not None else "" for x in (apart, idle)]
        lines.append(f"| {r['cache']} | {', '.join(map(str, r['calls']))} | {r['idle_calls']} | "
                     f"{r['tok_s_per_call']:.1f} | {cells[0]} | {cells[1]} | {r['one_pass_steps']} |")  # fmt: skip
    for cache in dict.fromkeys(r["cache"] for r in rows):
        mine = [(r, x) for r, x in zip(rows, found, strict=True) if r["cache"] == cache]
        apart = [a for r, (a, _) in mine if a is not None and r["calls"] != list(range(len(r["calls"])))]
        idle = [i for _, (_, i) in mine if i is not None]
        lines.append("")
        lines.append(f"{cache}: slots apart, least of / neighbours {min(apart):.2f} (target 0.95); idle calls held, "
                     f"least of / no idle call {min(idle):.2f} (target 0.97)")  # fmt: skip
        if any(r.get("draft_accepted") is not None for r, _ in mine):
            lines.append(_passes_line([r for r, _ in mine]))
    return "\n".join(lines)


def _passes_line(rows: list[dict[str, Any]]) -> str:
    """The same ratios over the target's passes a second, which a draft's acceptance does not move."""
    found = ratios(rows, "passes_s_per_call")
    apart = [
        a for r, (a, _) in zip(rows, found, strict=True) if a is not None and r["calls"] != list(range(len(r["calls"])))
    ]
    idle = [i for _, i in found if i is not None]
    shares = [r["draft_accepted"] for r in rows if r.get("draft_accepted") is not None]
    return (
        f"over the target's passes a second (drafted tokens accepted: {min(shares):.2f}-{max(shares):.2f} of a "
        f"row's): least of / neighbours {min(apart):.2f}, least of / no idle call {min(idle):.2f}"
    )


def _profile(args: argparse.Namespace) -> tuple[Profile, dict[str, str]]:
    """The profile asked for (at --slots), and its other files' paths by key."""
    profile = registry.load(args.config).profile(args.profile)
    files = dict(f.split("=", 1) for f in args.file)
    if set(files) != {f.key for f in profile.files} - {"main"}:
        raise config.ConfigError(f"{args.profile}: give --file KEY=PATH for each of its files but main")
    update: dict[str, Any] = {}
    if args.slots:
        argv = list(profile.args)
        for flag, value in (("-np", args.slots), ("-c", args.slots * profile.ctx_per_slot)):
            if flag not in argv:
                raise config.ConfigError(f"{args.profile}: --slots needs {flag} in its args")
            argv[argv.index(flag) + 1] = str(value)
        update = {"slots": args.slots, "args": argv}
    return profile.model_copy(update=update), files


def _ended(signum: int, _frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second TERM (the process group's, forwarded) waits its turn
    raise SystemExit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=300, help="tokens each call decodes")
    parser.add_argument("--depth", type=int, default=300, help="tokens of each call's prompt")
    parser.add_argument("--layout", choices=("both", "stream", "shared"), default="both", help="KV cache layouts")
    parser.add_argument("--profile", help="a profile of the configuration (its flags and slots); default: 4 tiny slots")
    parser.add_argument("--model", type=Path, help="the profile's main model file (with --profile)")
    parser.add_argument("--file", action="append", default=[], help="KEY=PATH: another file of the profile")
    parser.add_argument("--slots", type=int, help="serve this many slots of the profile's context (-np, -c)")
    parser.add_argument("--config", type=Path, help="fleet.toml to read the profile from (default: FLEET_CONFIG)")
    parser.add_argument("--binary", type=Path, help="llama-server (default: the local build)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each row's calls; the row reads the median")
    parser.add_argument(
        "--one-text",
        action="store_true",
        help="every call the same prompt (a MoE's experts and a draft's luck then do not depend on which calls speak)",
    )
    parser.add_argument("--json", type=Path, help="write the rows here too, each as it is measured")
    args = parser.parse_args()
    # ended from outside (bench/gpu/measure.py cut short): unwind, once, so the server ends with this process
    signal.signal(signal.SIGTERM, _ended)
    if args.tokens < 16 or args.depth < 16:
        print("error: --tokens and --depth take 16 or more", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print("error: --repeats takes 1 or more", file=sys.stderr)
        return 2
    if (args.profile is None) != (args.model is None):
        print("error: --profile and --model go together", file=sys.stderr)
        return 2
    if any("=" not in f for f in args.file) or (args.slots is not None and args.slots < 3):
        print("error: --file takes KEY=PATH, --slots 3 or more", file=sys.stderr)
        return 2
    binary = args.binary or toolchain.llama_server_path()
    if binary is None or not binary.exists():
        print("error: no llama-server built: run scripts/build-llama-server", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp_name:
        work = Path(tmp_name)
        if args.profile:
            try:
                profile, files = _profile(args)
            except config.ConfigError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            model = args.model
            if profile.slots < 3:
                print(f"error: {args.profile}: this bench takes a profile of 3 or more slots", file=sys.stderr)
                return 2
        else:
            slots, ctx = 4, 4096
            profile = Profile(name="tiny", gpu_ram_gb=0, disk_gb=10, slots=slots, ctx_per_slot=ctx,
                              files=[{"key": "main", "repo": "fleet-local/tiny-models", "file": "tiny.gguf"}],
                              args=["-c", str(slots * ctx), "-np", str(slots), "-t", "1"])  # fmt: skip
            model, files = tinymodels.generate("tiny", work / "tiny.gguf"), {}
        if args.depth + args.tokens >= profile.ctx_per_slot:
            print(f"error: --depth plus --tokens must fit a slot ({profile.ctx_per_slot})", file=sys.stderr)
            return 2
        rows = measure(
            binary,
            model,
            profile,
            files,
            args.layout,
            args.depth,
            args.tokens,
            work,
            args.json,
            args.repeats,
            args.one_text,
        )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
