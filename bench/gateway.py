#!/usr/bin/env python3
"""What the gateway costs a voice call: the same host, direct and through `fleet gateway`, side by side in
one run on the local cloud, at 1, 8, 32 and 64 concurrent callers.

One host (the tiny model with 64 slots, so that no caller waits for a slot) behind a gateway on this
machine. Each caller keeps one connection, as an agent does, and talks turn after turn (its own call: the
body's `user`); the rounds alternate direct and gateway so that both see the same machine. Per level:
first content p50 and p99 of the warm turns, each caller's decode rate, and the tokens per second of all
callers together. Targets: the gateway adds at most 1 ms to first content at p50 and 3 ms at p99, and
keeps at least 0.98 of the direct throughput.

`--rotation`: 16 callers talk without pause while the hosts behind the gateway change under them (a host
replaced by the health sweep, a host moved by a reprice, a standby host resumed into the target): failed
turns (target 0), new calls placed on a draining host (target 0), and the turns whose host changed (each
a cache miss; the others find their conversation cached).

Usage: .venv/bin/python bench/gateway.py [--levels 1,8,32,64] [--rounds 3] [--turns 4] [--rotation]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.app import Fleet
from fleet.control import gateway
from fleet.control.up import UpRequest
from fleet.core import config
from fleet.core.config import Serve
from fleet.core.models import HostState
from fleet.gateway.files import files_for
from fleet.gateway.process import running_pid
from fleet.gateway.runtime import Runtime, checked
from fleet.localcloud import control
from fleet.localcloud.network import free_port
from fleet.probes.server import Server
from fleet.probes.stream import ChatResult, Connection
from tests.fleetkit import fleet_for, settings_for, with_variant
from tests.helpers import kill_llama_server

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway_rotation

SLOTS = 64
CTX_PER_SLOT = 2048
MAX_TOKENS = 32


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench_settings(tmp: Path) -> config.Settings:
    # --rotation: a draining host keeps its calls 8 s at most, a dead host is replaced at its first failed sweep
    base = settings_for(tmp, rotation={"drain_timeout_s": 8.0, "unhealthy_after_sweeps": 1})
    args = [
        "-ngl",
        "99",
        "-c",
        str(SLOTS * CTX_PER_SLOT),
        "-np",
        str(SLOTS),
        "-t",
        "1",
        "--jinja",
        "--threads-http",
        "256",
    ]
    settings = with_variant(base, "wide", args=args, ctx_per_slot=CTX_PER_SLOT, on_up=["smoke"])
    return settings.model_copy(
        update={
            "serve": [Serve(model="wide", region="eu")],
            "gateway": settings.gateway.model_copy(
                update={"directory": str(tmp / "gateway"), "port": free_port(), "metrics_port": 0}
            ),
        }
    )


async def caller(server: Server, name: str, turns: int) -> list[ChatResult]:
    """One agent's call: a kept connection, turn after turn, each turn's history growing."""
    connection = Connection(server)
    history: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful voice agent. " * 6}]
    results = []
    try:
        for i in range(turns):
            history.append({"role": "user", "content": f"{name}, turn {i}: what about the weather tomorrow?"})
            result = await connection.chat({"messages": history, "max_tokens": MAX_TOKENS, "user": name})
            if result.status != 200:
                raise RuntimeError(f"{name} turn {i}: {result.error}")
            results.append(result)
            history.append({"role": "assistant", "content": result.content})
    finally:
        await connection.close()
    return results


async def level_round(server: Server, callers: int, turns: int, tag: str) -> dict[str, Any]:
    started = time.perf_counter()
    per_caller = await asyncio.gather(*(caller(server, f"{tag}-{i}", turns) for i in range(callers)))
    wall = time.perf_counter() - started
    results = [r for rs in per_caller for r in rs]
    warm = [r.timing.first_content_ms for rs in per_caller for r in rs[1:] if r.timing.first_content_ms is not None]
    tokens = sum(int(r.usage.get("completion_tokens") or 0) for r in results)
    decode = [d for r in results if (d := r.decode_tok_s) is not None]
    return {"first": warm, "decode": decode, "tokens": tokens, "wall": wall}


def haproxy_cpu_s(fleet: Fleet) -> float:
    pid = running_pid(files_for(fleet.settings))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def side_by_side(fleet: Fleet, key: str, levels: list[int], rounds: int, turns: int) -> list[dict[str, Any]]:
    host = fleet.record.hosts(states=(HostState.READY,))[0]
    direct = fleet.server(host)
    through = Server(f"https://localhost:{fleet.settings.gateway.port}", key, fleet.tls)
    rows = []
    for level in levels:
        pooled: dict[str, dict[str, list[float]]] = {
            "direct": {"first": [], "decode": [], "rate": [], "cpu": []},
            "gateway": {"first": [], "decode": [], "rate": [], "cpu": []},
        }
        # a fresh server answers its first round of calls faster than any later one (its slots' caches are
        # empty): a warm-up round of each path is discarded, then the paths alternate
        for path, server in (("direct", direct), ("gateway", through)):
            await level_round(server, level, turns, f"warmup-{path}-{level}")
        for r in range(rounds):
            order = [("direct", direct), ("gateway", through)]
            for path, server in order if r % 2 == 0 else order[::-1]:
                cpu = haproxy_cpu_s(fleet)
                got = await level_round(server, level, turns, f"{path}-{level}-{r}")
                pooled[path]["cpu"].append((haproxy_cpu_s(fleet) - cpu) / got["wall"])
                pooled[path]["first"] += got["first"]
                pooled[path]["decode"] += got["decode"]
                pooled[path]["rate"].append(got["tokens"] / got["wall"])
        row: dict[str, Any] = {"callers": level}
        for path in ("direct", "gateway"):
            row[path] = {
                "p50": statistics.median(pooled[path]["first"]),
                "p99": pct(pooled[path]["first"], 0.99),
                "decode": statistics.median(pooled[path]["decode"]),
                "throughput": statistics.median(pooled[path]["rate"]),
                "turns": len(pooled[path]["first"]),
                "haproxy_cpu": statistics.median(pooled[path]["cpu"]),
            }
        rows.append(row)
        d, g = row["direct"], row["gateway"]
        print(
            f"{level} callers: first content p50 {d['p50']:.2f} -> {g['p50']:.2f} ms, p99 {d['p99']:.2f} -> "
            f"{g['p99']:.2f} ms; throughput {d['throughput']:.0f} -> {g['throughput']:.0f} tok/s",
            file=sys.stderr,
        )
    return rows


async def refusals(fleet: Fleet, key: str, count: int = 40) -> list[float]:
    """How long a new call on a full target waits for its 503: the host's limit set to one stream (through the
    admin socket, as a bench of 1 would), one long stream held, then new calls one after another."""
    runtime = Runtime(files_for(fleet.settings).socket)
    await runtime.must(checked("set", "maxconn", "server", "calls_t0/s0", "1"))
    through = Server(f"https://localhost:{fleet.settings.gateway.port}", key, fleet.tls)
    held = Connection(through)
    hold = asyncio.create_task(held.chat({"messages": [{"role": "user", "content": "go on"}], "max_tokens": 1800}))
    probe = Connection(through)
    times: list[float] = []
    try:
        await asyncio.sleep(0.05)
        for i in range(count):
            result = await probe.chat({"messages": [{"role": "user", "content": "hi"}], "user": f"new-{i}"})
            if hold.done():
                break  # the held stream ended: the target is not full any more
            if result.status == 503:
                times.append(result.timing.headers_ms)
    finally:
        await hold
        await held.close()
        await probe.close()
    return times


def print_table(rows: list[dict[str, Any]], rounds: int, turns: int) -> None:
    print(f"\none host, tiny model, {SLOTS} slots; {rounds} rounds per path, alternating; {turns} turns a caller")
    print(f"({MAX_TOKENS} tokens a reply); first content of the warm turns, pooled over the rounds\n")
    print(
        "| callers | first content p50 direct | gateway | added | p99 direct | gateway | added "
        "| decode per caller direct | gateway | throughput direct | gateway | ratio | HAProxy's CPU |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        d, g = row["direct"], row["gateway"]
        print(
            f"| {row['callers']} | {d['p50']:.2f} ms | {g['p50']:.2f} ms | {g['p50'] - d['p50']:+.2f} ms "
            f"| {d['p99']:.2f} ms | {g['p99']:.2f} ms | {g['p99'] - d['p99']:+.2f} ms "
            f"| {d['decode']:.0f} tok/s | {g['decode']:.0f} tok/s "
            f"| {d['throughput']:.0f} tok/s | {g['throughput']:.0f} tok/s | {g['throughput'] / d['throughput']:.3f} "
            f"| {g['haproxy_cpu']:.1%} of a core |"
        )
    worst_p50 = max(r["gateway"]["p50"] - r["direct"]["p50"] for r in rows)
    worst_p99 = max(r["gateway"]["p99"] - r["direct"]["p99"] for r in rows)
    worst_ratio = min(r["gateway"]["throughput"] / r["direct"]["throughput"] for r in rows)
    print(
        f"\nadded first content: at most {worst_p50:+.2f} ms p50 (target <= 1 ms), {worst_p99:+.2f} ms p99 "
        f"(target <= 3 ms); throughput at least {worst_ratio:.3f} of direct (target >= 0.98)"
    )


async def kill_server(fleet: Fleet, host: Any) -> None:
    """Stop a host's llama-server over SSH, with the host's own script: a host dead under its calls."""
    await kill_llama_server(host.ssh_host, host.ssh_port, fleet.ssh_key.private)


async def rotation_run(fleet: Fleet) -> None:
    for request in (UpRequest("wide", "eu", count=3), UpRequest("wide", "eu", standby=True)):
        result = await fleet.up(request)
        assert result.ready, result.failures
    await gateway.start(fleet)
    tally = await gateway_rotation.under_rotation(fleet, sys.modules[__name__])
    gateway_rotation.report(tally)


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        os.environ["FLEET_LOCALCLOUD_DIR"] = str(tmp / "cloud")
        os.environ["FLEET_STATE_DIR"] = str(tmp / "state")
        control.start(tmp / "cloud", timeout_s=120)
        try:
            settings = bench_settings(tmp)
            async with fleet_for(settings) as fleet:
                try:
                    if args.rotation:
                        await rotation_run(fleet)
                        return
                    up = await fleet.up(UpRequest(model="wide", region="eu"))
                    assert up.ready, up.failures
                    await gateway.start(fleet)
                    key = await gateway.add_key(fleet, "bench")
                    rows = await side_by_side(fleet, key, args.levels, args.rounds, args.turns)
                    refused = await refusals(fleet, key)
                finally:
                    await gateway.stop(fleet)
                    await fleet.destroy(None)
            print_table(rows, args.rounds, args.turns)
            if refused:
                print(
                    f"a new call on a full target: 503 in {statistics.median(refused):.2f} ms p50, "
                    f"{max(refused):.2f} ms at most, over {len(refused)} calls on a kept connection (target < 50 ms)"
                )
        finally:
            control.stop(tmp / "cloud")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,8,32,64", help="concurrent callers, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per path and level")
    parser.add_argument("--turns", type=int, default=4, help="turns a caller takes per round")
    parser.add_argument("--rotation", action="store_true", help="16 callers while hosts are replaced and moved")
    args = parser.parse_args()
    try:
        args.levels = [int(x) for x in args.levels.split(",")]
    except ValueError:
        print(f"error: --levels takes numbers separated by commas, not {args.levels!r}", file=sys.stderr)
        return 2
    if any(n < 1 or n > SLOTS for n in args.levels) or args.rounds < 1 or args.turns < 2:
        print(f"error: levels 1-{SLOTS}, at least one round and two turns", file=sys.stderr)
        return 2
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
