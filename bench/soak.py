#!/usr/bin/env python3
"""A day of operation, compressed, on the local cloud: what housekeeping costs live calls, and what grows.

Default (`--soak`): `fleet daemon` keeps a serve target of two calls with its schedules compressed (health
every 5 s, reconcile every 10 s, the thermal re-probe every 60 s, reprice every 2 minutes), `fleet gateway`
in front, and `--calls` calls talk through it without pause for `--minutes`. Every `--sample-s` it samples
the daemon's, HAProxy's and each host's llama-server's resident memory, the database's bytes (with its
WAL) and rows of `job_runs` and `events`. The first third is warm-up; a least-squares line through the rest
gives each figure's growth per hour of the run, and per day at the default schedules (the run's ticks come
at `compression` times the default rate). Failed turns are counted (target 0).

`--sweep`: two hosts behind the gateway, one call talking without pause (its client a process of its own);
rounds alternate a window with no housekeeping, a window in which `thermal_sweep` runs (the daemon's thermal
re-probe), one in which the call's host is held and let go alone (no probe anywhere), and the live turns'
first content p50/p95 of each is printed side by side with the ratio (target: p95 within 1.10 of the
sweep-free windows; issue 38 saw 244-398 ms against a p50 of 23 ms when the probe ran beside the call), and
beside them the same probe run on the call's host, as sweeps did before. On this machine the hosts share its
cores, so the idle host's probe load and the probe's clients (the daemon's, in this process) take CPU the
call's host would use: `--apart` gives the hosts without the call and this process the lowest CPU priority,
as if each had a machine of its own.

Usage: .venv/bin/python bench/soak.py [--minutes 20] [--sample-s 15] [--calls 2] [--cache-ram-mib N]
       .venv/bin/python bench/soak.py --sweep [--rounds 4] [--window-s 8] [--apart]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sqlite3
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.control import gateway, thermal
from fleet.control.up import UpRequest
from fleet.core.config import Serve
from fleet.core.models import HostState
from fleet.engines import registry
from fleet.gateway.files import files_for
from fleet.gateway.process import running_pid
from fleet.gateway.runtime import Runtime
from fleet.localcloud import control
from fleet.localcloud.network import free_port
from fleet.probes.server import Server
from fleet.probes.stream import Connection, StreamError
from tests.fleetkit import fleet_for, settings_for, without_shipped_serve, write_config

# the run's schedules against the defaults (fleet.toml): health 60 s -> 5 s, reconcile 600 s -> 10 s
COMPRESSION = 12
SCHEDULES = """
[rotation]
unhealthy_after_sweeps = 2
health_timeout_s = 10
drain_timeout_s = 10
health_every_s = 5
reconcile_every_s = 10
thermal_every_s = 60
reprice_cron = "*/2 * * * *"
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(x.split()[1]) / 1024 for x in status.splitlines() if x.startswith("VmRSS:")), None)


class Talk:
    """Calls that talk through the gateway without pause, each turn a new user line on a growing history
    (trimmed to the last turns, as an agent keeps its context)."""

    def __init__(self, server: Server, calls: int) -> None:
        self.server, self.calls = server, calls
        self.stop = asyncio.Event()
        self.turns: list[tuple[float, float]] = []  # (when it ended, first content ms)
        self.failed: list[str] = []
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._call(f"call-{i}")) for i in range(self.calls)]

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)

    async def _call(self, name: str) -> None:
        history: list[dict[str, str]] = []
        connection = Connection(self.server)
        try:
            i = 0
            while not self.stop.is_set():
                history = [*history[-6:], {"role": "user", "content": f"{name}, turn {i}: and then?"}]
                try:
                    result = await connection.chat({"messages": history, "max_tokens": 8, "user": name})
                except (StreamError, OSError, asyncio.IncompleteReadError) as e:  # cut mid-reply: a failed turn
                    self.failed.append(f"{name} turn {i}: {type(e).__name__}: {e}")
                    await connection.close()
                    await asyncio.sleep(0.5)
                    continue
                if result.status != 200 or result.timing.first_content_ms is None:
                    self.failed.append(f"{name} turn {i}: {result.status} {result.error}")
                    await asyncio.sleep(0.5)
                    continue
                self.turns.append((time.monotonic(), result.timing.first_content_ms))
                history.append({"role": "assistant", "content": result.content})
                i += 1
        finally:
            await connection.close()


# ---- --sweep ---------------------------------------------------------------------------------------------


async def set_apart(fleet: Any, cloud_dir: Path) -> None:
    """The hosts here share this machine's cores, where rented hosts share nothing: every host but the one that
    carries the call gets the lowest CPU priority, so that a probe's load there takes no core the call's host
    wants (as on a machine of its own)."""
    entry = (await Runtime(files_for(fleet.settings).socket).table("calls_t0"))["soak/call-0"]
    slot = int(entry["server_key"][1:])
    for host in fleet.record.hosts(states=(HostState.READY,)):
        if host.gateway_slot != slot:
            pid = int(next((cloud_dir / "hosts" / str(host.instance_id)).rglob("llama-server.pid")).read_text())
            os.setpriority(os.PRIO_PROCESS, pid, 19)
            print(f"{host.name} (no call) runs at nice 19", file=sys.stderr)


class Talker:
    """The call's client in a process of its own, as an agent is: the sweep's probe load, run by this process,
    shares no event loop with it (in one process a probe's streams delayed the call's reads). It appends each
    turn's end (this machine's monotonic clock) and first content to a file; the key goes on its stdin."""

    def __init__(self, url: str, key: str, ca_file: Path, out: Path) -> None:
        self.out = out
        argv = [sys.executable, __file__, "--talker", url, str(ca_file), str(out)]
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, text=True, start_new_session=True)
        assert self.process.stdin is not None
        self.process.stdin.write(key + "\n")
        self.process.stdin.flush()

    def finish(self) -> tuple[list[tuple[float, float]], int]:
        """Stop it: (turns, failed)."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise
        turns, failed = [], 0
        for line in self.out.read_text().splitlines():
            when, ms = line.split()
            if ms == "failed":
                failed += 1
            else:
                turns.append((float(when), float(ms)))
        return turns, failed


async def talker(url: str, ca_file: Path, out: Path) -> None:
    """--talker: one call through the gateway until stdin closes."""
    key = sys.stdin.readline().strip()
    talk = Talk(Server(url, key, ssl.create_default_context(cafile=str(ca_file))), 1)
    talk.start()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # returns when the parent closes it
    await talk.finish()
    lines = [f"{t} {ms}" for t, ms in talk.turns] + [f"{time.monotonic()} failed" for _ in talk.failed]
    out.write_text("\n".join(lines) + "\n")


async def sweep_run(args: argparse.Namespace, tmp: Path) -> None:
    settings = settings_for(tmp, rotation={"drain_timeout_s": 3.0})
    settings = settings.model_copy(
        update={
            "serve": [Serve(model="tiny", region="eu")],
            "gateway": settings.gateway.model_copy(
                update={"directory": str(tmp / "gateway"), "port": free_port(), "metrics_port": 0}
            ),
        }
    )
    spans: list[tuple[str, float, float]] = []  # (window, start, end)
    probed, left = 0, 0
    async with fleet_for(settings) as fleet:
        try:
            up = await fleet.up(UpRequest("tiny", "eu", count=2))
            assert len(up.ready) == 2, up.failures
            await gateway.start(fleet)
            key = await gateway.add_key(fleet, "soak")
            url = f"https://localhost:{settings.gateway.port}"
            talk = Talker(url, key, fleet.ca_file, tmp / "turns.txt")
            try:
                await asyncio.sleep(3)  # the call's first turns: its host's cache warm
                if args.apart:
                    await set_apart(fleet, tmp / "cloud")
                    os.nice(19)  # this process runs the probes' clients, as the daemon does on a machine of its own
                for r in range(args.rounds):
                    start = time.monotonic()
                    await asyncio.sleep(args.window_s)
                    spans.append(("free", start, time.monotonic()))
                    start = time.monotonic()
                    reports = await thermal.thermal_sweep(fleet)
                    spans.append(("sweep", start, time.monotonic()))
                    probed += sum(1 for r in reports if not r.reason.startswith(thermal.LEFT))
                    left += sum(1 for r in reports if r.reason.startswith(thermal.LEFT))
                    # the hold alone: the call's host held from new calls, its call waited for, let go; no probe
                    start = time.monotonic()
                    for live in [r.name for r in reports if r.reason.startswith(thermal.LEFT)]:
                        host = fleet.record.hosts(names=[live])[0]
                        if await thermal.quiet(fleet, host) is None:
                            await thermal.let_go(fleet, fleet.record.hosts(names=[live])[0])
                    spans.append(("hold", start, time.monotonic()))
                    # what the sweep did before issue 38: the same probe on the host that carries the call
                    start = time.monotonic()
                    for live in [r.name for r in reports if r.reason.startswith(thermal.LEFT)]:
                        await fleet.probe(live, only=["thermal"])
                    spans.append(("beside", start, time.monotonic()))
                    print(f"round {r + 1}: {len(reports)} hosts swept, {probed} probed so far", file=sys.stderr)
            finally:
                turns, failed = talk.finish()
        finally:
            await gateway.stop(fleet)
            await fleet.destroy(None)
    windows: dict[str, list[float]] = {"free": [], "sweep": [], "hold": [], "beside": []}
    spent = {name: 0.0 for name in windows}  # seconds each kind of window lasted
    for kind, start, end in spans:
        windows[kind] += [ms for t, ms in turns if start < t <= end]
        spent[kind] += end - start
    free, sweep, beside = windows["free"], windows["sweep"], windows["beside"]
    print(f"\none call talking without pause through the gateway (a process of its own), two tiny hosts; "
          f"{args.rounds} rounds")  # fmt: skip
    print(f"of a {args.window_s:g} s window with no housekeeping, a thermal sweep (fleet's: the idle host probed, the")
    print("call's host held and left), then the same probe run on the call's host (what sweeps did before);")
    shared = "the hosts without the call and the probes' clients at nice 19 (--apart)" if args.apart else "shared"
    print(f"{os.cpu_count()} cores here, {shared}\n")
    print("| window | turns | the call's turns a second | first content p50 | p95 | max |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = (
        ("no housekeeping", "free"),
        ("thermal sweep", "sweep"),
        ("the call's host held, no probe", "hold"),
        ("probe beside the call", "beside"),
    )
    for name, kind in rows:
        values = windows[kind]
        if not values:
            print(f"| {name} | 0 | - | - | - | - |")
            continue
        print(f"| {name} | {len(values)} | {len(values) / spent[kind]:.1f} | {statistics.median(values):.1f} ms "
              f"| {pct(values, 0.95):.1f} ms | {max(values):.1f} ms |")  # fmt: skip
    print(f"\nhosts probed: {probed}; hosts left for a later sweep (they carried the call): {left}; "
          f"failed turns: {failed}")  # fmt: skip
    if free and sweep and beside:
        base = pct(free, 0.95)
        print(f"first content p95 during sweeps / without: {pct(sweep, 0.95) / base:.3f} (target <= 1.10); "
              f"with the probe beside the call / without: {pct(beside, 0.95) / base:.3f}")  # fmt: skip


# ---- --soak ----------------------------------------------------------------------------------------------


def soak_config(tmp: Path, calls: int, cache_ram_mib: int | None) -> dict[str, str]:
    text = without_shipped_serve(write_config(tmp).read_text())
    if cache_ram_mib is not None:
        text = text.replace("[models.tiny]\n", f"[models.tiny]\ncache_ram_mib = {cache_ram_mib}\n", 1)
    text = text.replace("[rotation]\n", "[rotation-defaults]\n", 1)
    text = text[: text.index("[rotation-defaults]")] + text[text.index("[plan]") :]
    text += SCHEDULES + f'endpoints_file = "{tmp}/endpoints.json"\n'
    text += f'\n[[serve]]\nmodel = "tiny"\nregion = "eu"\ncalls = {calls}\n'
    gateway_dir, port = tmp / "gateway", free_port()
    text = re.sub(r"(?m)^port = \d+.*$", f"port = {port}", text, count=1)
    text = re.sub(r"(?m)^metrics_port = 9465.*$", "metrics_port = 0", text, count=1)
    text = text.replace("[gateway]\n", f'[gateway]\ndirectory = "{gateway_dir}"\n', 1)
    assert f"port = {port}" in text and str(gateway_dir) in text, "fleet.toml's [gateway] table is not as expected"
    (tmp / "fleet.toml").write_text(text)
    return {**os.environ, "FLEET_CONFIG": str(tmp / "fleet.toml"), "PYTHONUNBUFFERED": "1"}


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    found = subprocess.run([sys.executable, "-m", "fleet.cli", *args], env=env, capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"fleet {' '.join(args)}: {found.stderr.strip()[-500:]}")
    return found


def ready(db: Path) -> list[int]:
    with sqlite3.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT instance_id FROM hosts WHERE state = 'ready'")]


def sample(db: Path, cloud_dir: Path, daemon: int, haproxy: int | None) -> dict[str, float | None]:
    with sqlite3.connect(db) as conn:
        rows = {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("job_runs", "events")}
    servers = []
    for instance in ready(db):
        pid_file = next((cloud_dir / "hosts" / str(instance)).rglob("llama-server.pid"), None)
        if pid_file is not None and (found := rss_mib(int(pid_file.read_text()))) is not None:
            servers.append(found)
    db_bytes = sum(p.stat().st_size for p in db.parent.glob(db.name + "*") if p.is_file())
    return {
        "fleet daemon RSS (MiB)": rss_mib(daemon),
        "HAProxy RSS (MiB)": rss_mib(haproxy),
        "llama-server RSS, mean of the hosts (MiB)": statistics.mean(servers) if servers else None,
        "database with its WAL (KiB)": db_bytes / 1024,
        "job_runs rows": rows["job_runs"],
        "events rows": rows["events"],
    }


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least squares through (seconds, value): the growth per hour."""
    mean_t = statistics.mean(t for t, _ in points)
    mean_v = statistics.mean(v for _, v in points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread * 3600 if spread else 0.0


async def soak_run(args: argparse.Namespace, tmp: Path) -> None:
    env = soak_config(tmp, args.calls, args.cache_ram_mib)
    env["FLEET_LOCALCLOUD_DIR"] = str(tmp / "cloud")
    db, cloud_dir = tmp / "fleet.db", tmp / "cloud"
    log = (tmp / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "fleet.cli", "daemon", "--metrics-port", "0"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    samples: list[tuple[float, dict[str, float | None]]] = []
    talk = None
    try:
        for _ in range(1200):  # the daemon rents the target's hosts (a tiny host holds one call)
            if db.exists() and len(ready(db)) >= args.calls:
                break
            if daemon.poll() is not None:
                raise SystemExit(f"fleet daemon exited: {(tmp / 'daemon.log').read_text()[-800:]}")
            await asyncio.sleep(0.5)
        cli(env, "gateway", "start", "--json")
        key = json.loads(cli(env, "gateway", "key", "add", "soak", "--json").stdout)["key"]
        async with fleet_for(registry.load(tmp / "fleet.toml")) as fleet:  # the CA and the port the CLI reads
            server = Server(f"https://localhost:{fleet.settings.gateway.port}", key, fleet.tls)
            haproxy = running_pid(files_for(fleet.settings))
            talk = Talk(server, args.calls)
            talk.start()
            started = time.monotonic()
            turns_before, at_before = 0, 0.0
            while (elapsed := time.monotonic() - started) < args.minutes * 60:
                found = sample(db, cloud_dir, daemon.pid, haproxy)
                done = len(talk.turns)  # the calls' turns a minute since the last sample
                found["the calls' turns a minute"] = (done - turns_before) / max(elapsed - at_before, 1e-9) * 60
                turns_before, at_before = done, elapsed
                samples.append((elapsed, found))
                print(f"{elapsed / 60:5.1f} min: {len(talk.turns)} turns, {len(talk.failed)} failed", file=sys.stderr)
                await asyncio.sleep(args.sample_s)
            await talk.finish()
    finally:
        if talk is not None and not talk.stop.is_set():
            await talk.finish()
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        log.close()
        subprocess.run([sys.executable, "-m", "fleet.cli", "gateway", "stop"], env=env, capture_output=True)
        subprocess.run([sys.executable, "-m", "fleet.cli", "destroy", "--all", "--yes"], env=env, capture_output=True)
    report_soak(args, samples, talk, (tmp / "daemon.log").read_text())


def report_soak(args: argparse.Namespace, samples: list[tuple[float, dict]], talk: Talk | None, log: str) -> None:
    kept = samples[len(samples) // 3 :]
    ram = "its profile's" if args.cache_ram_mib is None else f"{args.cache_ram_mib} MiB"
    print(f"\n{args.minutes:g} minutes, schedules {COMPRESSION}x the defaults' rate, {args.calls} calls talking, "
          f"llama-server's RAM prompt cache {ram}")  # fmt: skip
    print(f"without pause through the gateway; a sample every {args.sample_s:g} s, the first third warm-up\n")
    print("| what | after warm-up | at the end | growth per hour of the run | per day at the default schedules |")
    print("|---|---:|---:|---:|---:|")
    for name in samples[0][1]:
        points = [(t, s[name]) for t, s in kept if s[name] is not None]
        if len(points) < 3:
            print(f"| {name} | - | - | - | - |")
            continue
        hourly = slope_per_hour(points)
        # what the calls drive (a server's prompt cache) grows with them, not with housekeeping's schedules
        by_calls = name.startswith("llama-server") or name.startswith("the calls")
        daily = "(calls, not schedules)" if by_calls else f"{hourly * 24 / COMPRESSION:+.1f}"
        print(f"| {name} | {points[0][1]:.1f} | {points[-1][1]:.1f} | {hourly:+.1f} | {daily} |")
    turns = len(talk.turns) if talk else 0
    failed = talk.failed if talk else []
    print(f"\nturns: {turns}, failed: {len(failed)} (target 0)" + (f"; the first: {failed[0][:160]}" if failed else ""))
    warnings = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line or "Traceback" in line]
    print(f"daemon log: {len(warnings)} warning or error lines")
    kinds: dict[str, int] = {}
    for line in warnings:  # by what they say, the times and the job's next run left out
        kind = re.sub(r"\d[\d:., -]*", "#", line.split(" ", 2)[-1])[:110]
        kinds[kind] = kinds.get(kind, 0) + 1
    for kind, count in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {count} x {kind}")


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        os.environ["FLEET_LOCALCLOUD_DIR"] = str(tmp / "cloud")
        os.environ["FLEET_STATE_DIR"] = str(tmp / "state")
        control.start(tmp / "cloud", timeout_s=120)
        try:
            await (sweep_run(args, tmp) if args.sweep else soak_run(args, tmp))
        finally:
            control.stop(tmp / "cloud")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="live calls' first content beside thermal sweeps")
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--sample-s", type=float, default=15)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--window-s", type=float, default=8)
    parser.add_argument(
        "--apart",
        action="store_true",
        help="--sweep: hosts without the call at the lowest CPU priority (no shared cores)",
    )
    parser.add_argument("--cache-ram-mib", type=int, help="the tiny profile's cache_ram_mib (default: its own)")
    parser.add_argument("--talker", nargs=3, metavar=("URL", "CA_FILE", "OUT"), help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.talker:
        asyncio.run(talker(parsed.talker[0], Path(parsed.talker[1]), Path(parsed.talker[2])))
        sys.exit(0)
    for flag, value in (("--minutes", parsed.minutes), ("--sample-s", parsed.sample_s), ("--calls", parsed.calls),
                        ("--rounds", parsed.rounds), ("--window-s", parsed.window_s)):  # fmt: skip
        if value <= 0:
            parser.error(f"{flag} must be positive")
    asyncio.run(main(parsed))
