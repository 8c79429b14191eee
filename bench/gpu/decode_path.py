"""Where served decode is lost on fleet's path (bench/gpu/run path): one fleet host, then the same server
taken apart one difference at a time, each driven by fleet's own bench code at 1 and 2 callers.

  host, through the forwarder       the fleet host as `fleet bench` reaches it: public port, the local
                                    cloud's NAT forwarder, TLS, the host's key
  host, its own address             the same server, skipping the forwarder
  then the host's llama-server is ended (by its PID) and started again by this script, fresh each time, on
  the host's own address and port (so the forwarder still leads to it), with the host's environment:
  replay, host's environment        the host's exact command line, started by this script
  replay, then fleet's up-probes    the same, with what `fleet up` runs on a new server (smoke, cache,
                                    keep-alive) before the bench: the host's history
  replay, as fleet-serve starts it  the same command line as the host's SSH session starts it: a background
                                    job of a non-interactive shell (SIGINT, SIGQUIT ignored), umask 077
  replay with -kvu, then up-probes  the same with one unified KV cache for every slot (bench/slots.py)
  profile flags, HTTP               the profile's flags alone, as llama-server started by hand (no TLS, no
                                    key, none of fleet's exposure flags): the issue's "direct" column
Every server is benched twice in a row (passes 1 and 2): a state the first pass leaves behind shows in the
second. Each level gives the server's claimed decode (its `predicted_per_second`) and what arrived here,
and the CPU the busiest processes and llama-server's busiest threads used meanwhile. STOP_AT (epoch
seconds) ends the run early, every server stopped, with the rows measured so far.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from fleet.engines import registry
from fleet.probes.bench import fit_call, speak_waves
from fleet.probes.call import load_call
from fleet.probes.runner import run_probes
from fleet.probes.server import Server

MAX_TOKENS = 128
LEVELS = (1, 2)  # the loss shows at 2 callers (and 4); a short run leaves device time for the rows of decode
WAVES = 2
STOP_AT = float(os.environ.get("STOP_AT", "inf"))  # epoch seconds: no variant starts after it
CLOCK = os.sysconf("SC_CLK_TCK")


def server_processes() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "llama-server":
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def process_facts(pid: int) -> dict[str, Any]:
    """What differs between two launches of one binary: its arguments, environment, limits, scheduling."""
    proc = Path(f"/proc/{pid}")
    environ = dict(
        item.split("=", 1) for item in proc.joinpath("environ").read_bytes().decode().split("\0") if "=" in item
    )
    status = dict(line.split(":", 1) for line in proc.joinpath("status").read_text().splitlines() if ":" in line)
    stat = proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()
    return {
        "argv": proc.joinpath("cmdline").read_bytes().decode().split("\0")[:-1],
        "environ": environ,
        "cwd": os.readlink(proc / "cwd"),
        "cgroup": proc.joinpath("cgroup").read_text().strip(),
        "limits": proc.joinpath("limits").read_text(),
        "cpus_allowed": status.get("Cpus_allowed_list", "").strip(),
        "nice": int(stat[16]),
        "policy": int(stat[38]),
        "threads": int(status.get("Threads", "0")),
        "sig_ignored": status.get("SigIgn", "").strip(),
    }


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of every process (comm[pid]) and of llama-server's threads (thread comm[tid])."""
    seconds: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            head, tail = entry.joinpath("stat").read_text().rsplit(")", 1)
            fields = tail.split()
            comm = head.split("(", 1)[1]
            seconds[f"{comm}[{entry.name}]"] = (int(fields[11]) + int(fields[12])) / CLOCK
            if comm == "llama-server":
                for task in entry.joinpath("task").iterdir():
                    thead, ttail = task.joinpath("stat").read_text().rsplit(")", 1)
                    tf = ttail.split()
                    seconds[f"  thread {thead.split('(', 1)[1]}[{task.name}]"] = (int(tf[11]) + int(tf[12])) / CLOCK
        except (OSError, IndexError, ValueError):
            continue
    return seconds


def busiest(before: dict[str, float], after: dict[str, float], wall: float, n: int = 8) -> list[str]:
    used = {k: (after[k] - before.get(k, 0.0)) / wall for k in after}
    return [f"{k} {v * 100:.0f}%" for k, v in sorted(used.items(), key=lambda kv: -kv[1])[:n] if v >= 0.02]


async def bench_pass(server: Server) -> tuple[list[dict[str, Any]], list[str], float]:
    """fleet's bench callers at each of LEVELS at once (its call fitted to the server, a cold wave and a warm-up
    discarded, WAVES measured): per level fleet's decode reading, the server's claim and what arrived here,
    medians over callers and waves; and the CPU the busiest processes and threads used meanwhile."""
    call, _ = await fit_call(server, load_call())
    before, started = cpu_seconds(), time.monotonic()
    rows = []
    for n in LEVELS:
        measured, _ = await speak_waves(server, call, n, WAVES, 1, MAX_TOKENS)
        replies = [r for _, wave in measured for r in wave]
        good = [r for r in replies if r.status == 200 and not r.error]
        rows.append(
            {
                "callers": n,
                "errors": len(replies) - len(good),
                "decode_per_caller_tok_s": _median([r.decode_tok_s for r in good]),
                "claimed_tok_s": _median([r.served.predicted_per_second for r in good]),
                "delivered_tok_s": _median([r.delivered_tok_s for r in good]),
                "first_content_ms": _median([r.timing.first_content_ms for r in good]),
                "prompt_tokens": _median([r.usage.get("prompt_tokens") for r in good]),
                "cache_n": _median([r.served.cache_n for r in good]),
            }
        )
    wall = time.monotonic() - started
    return rows, busiest(before, cpu_seconds(), wall), wall


def _median(values: list[Any]) -> float | None:
    numbers = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return statistics.median(numbers) if numbers else None


def wait_health(url: str, context: ssl.SSLContext | None, pid: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            raise SystemExit(f"llama-server (pid {pid}) exited before it served")
        try:
            if httpx.get(f"{url}/health", verify=context or True, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"llama-server did not serve {url} within {timeout_s:.0f} s")


def run(up: Callable[[], tuple[str, float]], tear_down: Callable[[], None], out: Path, logs: Path) -> None:
    variants: list[dict[str, Any]] = []
    try:
        _run(up, logs, variants)
    finally:
        (out / "path.json").write_text(json.dumps(variants, indent=1))
        tear_down()
    print(table(variants))
    (out / "path.md").write_text(table(variants))


def _run(up: Callable[[], tuple[str, float]], logs: Path, variants: list[dict[str, Any]]) -> None:
    settings = registry.load()
    host_name, _ = up()
    listed = subprocess.run([sys.executable, "-m", "fleet", "status", "--json"], capture_output=True, text=True)
    host = next(h for h in json.loads(listed.stdout) if h["name"] == host_name)
    pids = server_processes()
    if len(pids) != 1:
        raise SystemExit(f"expected the host's one llama-server, found {pids}")
    facts = process_facts(pids[0])
    argv = [os.readlink(f"/proc/{pids[0]}/exe"), *facts["argv"][1:]]  # the host found it on its own PATH
    address, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    key = Path(facts["cwd"], argv[argv.index("--api-key-file") + 1]).read_text().strip()
    context = ssl.create_default_context(cafile=str(settings.database.file.parent / "tls" / "ca.pem"))
    context.check_hostname = False  # the host's certificate names its public address; here it is reached at others
    public = host["endpoint"].rstrip("/")
    private = f"https://{address}:{port}"

    def measure(name: str, server: Server, launch: dict[str, Any]) -> None:
        if time.time() > STOP_AT:
            print(f"{name}: not measured (STOP_AT passed: the device call's time is nearly spent)", flush=True)
            return
        for n in (1, 2):
            rows, cpu, wall = asyncio.run(bench_pass(server))
            variants.append({"variant": name, "pass": n, "levels": rows, "cpu": cpu, "wall_s": wall, "launch": launch})
            (logs.parent / "path.json").write_text(json.dumps(variants, indent=1))  # a run cut short keeps its rows
            line = ", ".join(
                f"{r['callers']}: {r['decode_per_caller_tok_s'] or 0:.1f} (claimed {r['claimed_tok_s'] or 0:.1f}, "
                f"arrived {r['delivered_tok_s'] or 0:.1f})"
                for r in rows
            )
            print(f"[{time.strftime('%H:%M:%S')}] {name}, pass {n}: {line}; cpu {'; '.join(cpu[:5])}", flush=True)

    host_launch = {k: v for k, v in facts.items() if k != "environ"} | {"environ_keys": sorted(facts["environ"])}
    measure("host, through the forwarder", Server(public, key, context), host_launch)
    measure("host, its own address", Server(private, key, context), host_launch)
    os.kill(pids[0], signal.SIGTERM)
    _wait_gone(pids[0])
    profile = settings.profile(host["model"])
    model = argv[argv.index("-m") + 1]
    direct = [argv[0], "-m", model, "--host", address, "--port", str(port), *profile.args]
    env = facts["environ"]
    # the host's own launch: sshd's session runs fleet-serve, whose `setsid llama-server ... &` is a background
    # job of a non-interactive shell (SIGINT and SIGQUIT ignored) under umask 077
    as_fleet_serve = ["/bin/sh", "-c", 'umask 077; setsid "$@" >/dev/null 2>&1 </dev/null &', "sh", *argv]
    unified = ["-kvu", "--kv-unified-per-slot", str(profile.ctx_per_slot)]
    launches = [
        ("replay, host's environment", argv, False, True),
        ("replay, then fleet's up-probes", argv, True, True),
        ("replay, as fleet-serve starts it", as_fleet_serve, False, True),
        # one KV buffer for every slot: no gap between busy slots splits a step (bench/slots.py), at the price of
        # each step's attention reading every cached call's cells (the idle ones too)
        ("replay with -kvu, then fleet's up-probes", [*argv, *unified], True, True),
        ("profile flags, HTTP", direct, False, False),
    ]
    for name, command, probed, tls in launches:
        if time.time() > STOP_AT:
            print(f"{name}: not measured (STOP_AT passed: the device call's time is nearly spent)", flush=True)
            continue
        with (logs / f"path-{len(variants)}.log").open("w") as log:
            starter = subprocess.Popen(
                command, env=env, cwd=facts["cwd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        if command is as_fleet_serve:
            starter.wait(timeout=30)
            pid = _one_server(timeout_s=30)
        else:
            pid = starter.pid
        try:
            own = private if tls else f"http://{address}:{port}"
            wait_health(own, context if tls else None, pid)
            launch = {k: v for k, v in process_facts(pid).items() if k != "environ"}
            through = Server(public, key, context) if tls else Server(public.replace("https://", "http://"))
            if probed:
                results = asyncio.run(run_probes(profile.probes.on_up, through, profile, settings, None))
                print(f"  up-probes: {', '.join(f'{r.name} {r.passed}' for r in results)}", flush=True)
            if tls:
                measure(f"{name}, through the forwarder", through, launch)
            else:
                measure(f"{name}, its own address", Server(own), launch)
        finally:
            os.killpg(pid, signal.SIGTERM)
            if starter.pid == pid:
                starter.wait(timeout=60)
            else:
                _wait_gone(pid)


def _one_server(timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = server_processes()
        if len(pids) == 1:
            return pids[0]
        time.sleep(0.2)
    raise SystemExit("the server fleet-serve's way did not start")


def _wait_gone(pid: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def table(variants: list[dict[str, Any]]) -> str:
    lines = [
        "| path | pass | 1 caller | 2 callers |",
        "| --- | ---: | ---: | ---: |",
    ]
    for v in variants:
        cells = {r["callers"]: r for r in v["levels"]}
        row = [
            f"{c['decode_per_caller_tok_s'] or 0:.1f} ({c['claimed_tok_s'] or 0:.1f} / {c['delivered_tok_s'] or 0:.1f})"
            if (c := cells.get(n))
            else "-"
            for n in LEVELS
        ]
        lines.append(f"| {v['variant']} | {v['pass']} | " + " | ".join(row) + " |")
    lines.append("")
    lines.append("tok/s per caller: fleet's reading (the server's claim / what arrived here), medians over waves.")
    return "\n".join(lines) + "\n"
