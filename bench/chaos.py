#!/usr/bin/env python3
"""A fixed, seeded matrix of faults against `fleet up --count 2` on the strict local cloud, and one table.

Each run gets a fresh cloud and database, sets its fault, runs the fleet commands a user would (killed by
SIGKILL where the fault is a crash), then `fleet reconcile` and `fleet up` again until two hosts serve, and
finally `fleet destroy --all`. Both books are then compared (tests/reliability/invariants.py): instances
left running, intents that bought twice, hosts destroyed that served and nobody asked to destroy, instances
the record lost. Recovery is the time from the fault to two READY hosts.
The bar: every leaked, duplicate, wrongly-destroyed and lost cell is 0.
Usage: .venv/bin/python bench/chaos.py [--runs N] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from fleet.localcloud import control
from tests.fleetkit import write_config
from tests.reliability.invariants import settled

COUNT = 2


@dataclass
class Run:
    ready: int = 0
    leaked: int = 0
    duplicates: int = 0
    wrongly_destroyed: int = 0
    lost: int = 0
    recovery_s: float = 0.0


@dataclass
class Bed:
    """One run's cloud, config and database."""

    directory: Path
    cloud: control.CloudInfo
    env: dict[str, str] = field(default_factory=dict)
    asked: set[str] = field(default_factory=set)  # hosts a user command asked to destroy

    def fleet(self, *args: str, crash_at: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        env = dict(self.env)
        if crash_at:
            env["FLEET_CRASH_AT"] = crash_at
        return subprocess.run(
            [sys.executable, "-m", "fleet.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
        )

    def faults(self, faults: dict) -> None:
        headers = {"Authorization": f"Bearer {self.cloud.api_key()}"}
        httpx.put(f"{self.cloud.url}/admin/faults", json=faults, headers=headers, timeout=10).raise_for_status()

    def first_machines(self, n: int) -> list[int]:
        out = self.fleet("offers", "--model", "tiny", "--region", "eu", "--json")
        return [o["machine_id"] for o in json.loads(out.stdout)["offers"][:n]]

    def ready(self) -> int:
        return len([h for h in json.loads(self.fleet("status", "--json").stdout) if h["state"] == "ready"])


UP = ["up", "--model", "tiny", "--region", "eu", "--count", str(COUNT)]


def crash(point: str) -> Callable[[Bed, random.Random], None]:
    def act(bed: Bed, rng: random.Random) -> None:
        bed.fleet(*UP, crash_at=point)

    return act


def crash_destroy(bed: Bed, rng: random.Random) -> None:
    bed.fleet(*UP)
    bed.asked |= {h["name"] for h in json.loads(bed.fleet("status", "--json").stdout)}
    bed.fleet("destroy", "--all", "--yes", crash_at="mid_destroy")


def storm(bed: Bed, rng: random.Random) -> None:
    api = ["/api/v0/", "/api/v1/"]
    bed.faults({"rate_limit": {"share": 0.15, "paths": api}, "server_error": {"share": 0.15, "paths": api}})
    bed.fleet(*UP)
    bed.faults({})


def late_create(bed: Bed, rng: random.Random) -> None:
    bed.faults({"slow": {"count": 1, "paths": ["/api/v0/asks"], "delay_s": 6.0}})
    bed.fleet(*UP)


def host_fault(make: Callable[[list[int]], dict]) -> Callable[[Bed, random.Random], None]:
    def act(bed: Bed, rng: random.Random) -> None:
        bed.faults(make(bed.first_machines(2)))
        bed.fleet(*UP)
        bed.faults({})

    return act


STANDBY = ["standby", "--model", "tiny", "--region", "eu", "--count", "1"]


def crash_mid_stop(bed: Bed, rng: random.Random) -> None:
    bed.fleet(*STANDBY, crash_at="mid_stop")  # reconcile finds it stopped and puts it in the pool


def standby_gpu_taken(bed: Bed, rng: random.Random) -> None:
    bed.fleet(*STANDBY)
    [parked] = json.loads(bed.fleet("status", "--json").stdout)
    bed.faults({"gpu_taken": [parked["machine_id"]]})
    bed.fleet(*UP)  # the pool host waits for its GPU past timeouts.standby_start: destroyed, cold hosts instead
    bed.faults({})


def racing_reconcile(bed: Bed, rng: random.Random) -> None:
    racing(bed, rng, UP)


def racing(bed: Bed, rng: random.Random, command: list[str]) -> None:
    argv = [sys.executable, "-m", "fleet.cli", *command]
    with subprocess.Popen(argv, env=bed.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as up:
        while up.poll() is None:
            bed.fleet("reconcile")
            time.sleep(rng.uniform(0.1, 0.6))


FAULTS: dict[str, Callable[[Bed, random.Random], None]] = {
    "crash after the intent": crash("after_intent"),
    "crash with the create answered": crash("create_answered"),
    "crash mid-pull": crash("mid_pull"),
    "crash mid-destroy": crash_destroy,
    "30% 429/5xx": storm,
    "a create answered too late": late_create,
    "container cannot start": host_fault(lambda m: {"oci_error": m[:1]}),
    "host offline mid-pull": host_fault(lambda m: {"offline_after_s": {str(m[0]): 2.5}}),
    "pull never progresses": host_fault(lambda m: {"pull_stall": {"files": ["tiny-llama-bytes.gguf"], "count": 1}}),
    "server never healthy": host_fault(lambda m: {"freeze_server": m[:1]}),
    "heartbeat gap at boot": host_fault(lambda m: {"heartbeat_gap": {str(m[0]): {"after_s": 0, "for_s": 5}}}),
    "reconcile racing up": racing_reconcile,
    "crash mid-stop (standby)": crash_mid_stop,
    "standby host's GPU taken": standby_gpu_taken,
    "reconcile racing standby": lambda bed, rng: racing(bed, rng, STANDBY),
}


def one_run(name: str, seed: int, root: Path) -> Run:
    directory = Path(tempfile.mkdtemp(dir=root))
    cloud = control.start(directory / "cloud", provision_delay_s=0.3, loading_delay_s=0.2)
    config = write_config(directory)
    text = config.read_text()
    # phase timeouts of a test bed, not of a real card: a dead host costs seconds here, not minutes
    text = text.replace("pull_stall = 120 ", "pull_stall = 5   ").replace("load = 600", "load = 20")
    text = text.replace("ssh = 120", "ssh = 20")
    text = text.replace("request_timeout_s = 30 ", "request_timeout_s = 3  ")
    text = text.replace("instance_visible = 60 ", "instance_visible = 10 ")
    text = text.replace("standby_start = 120 ", "standby_start = 5   ")
    config.write_text(text)
    bed = Bed(
        directory, cloud, {**os.environ, "FLEET_CONFIG": str(config), "FLEET_LOCALCLOUD_DIR": str(cloud.state_dir)}
    )
    run = Run()
    try:
        started = time.monotonic()
        FAULTS[name](bed, random.Random(seed))
        bed.faults({})
        for _ in range(4):  # recover: settle what the fault left, then bring the fleet back to COUNT
            bed.fleet("reconcile")
            missing = COUNT - bed.ready()
            if missing <= 0:
                break
            bed.fleet("up", "--model", "tiny", "--region", "eu", "--count", str(missing))
        run.recovery_s = time.monotonic() - started
        run.ready = bed.ready()
        served = _served_hosts(directory / "fleet.db")
        bed.fleet("destroy", "--all", "--yes")
        findings = settled(cloud.state_dir, [directory / "fleet.db"])
        run.leaked, run.duplicates, run.lost = len(findings.leaked), len(findings.duplicates), len(findings.lost)
        run.wrongly_destroyed = len(served - bed.asked)
    finally:
        control.stop(cloud.state_dir)
    return run


def _served_hosts(database: Path) -> set[str]:
    """Hosts that reached READY and were gone before the final destroy --all (by anyone)."""
    with sqlite3.connect(database) as db:
        return {
            n for (n,) in db.execute("SELECT name FROM hosts WHERE ready_at IS NOT NULL AND destroyed_at IS NOT NULL")
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--only", action="append", help="run only this fault (repeatable)")
    args = parser.parse_args()
    names = args.only or list(FAULTS)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            runs = [one_run(name, seed, Path(root)) for seed in range(args.runs)]
            rows.append((name, runs))
            print(f"  {name}: done", file=sys.stderr, flush=True)
    header = ("fault", "runs", "READY", "leaked", "duplicates", "healthy destroyed", "records lost", "recovery s")
    widths = (32, 5, 6, 7, 11, 18, 13, 11)
    print("".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    bad = 0
    for name, runs in rows:
        cells = (
            name,
            len(runs),
            f"{sum(r.ready for r in runs)}/{COUNT * len(runs)}",
            sum(r.leaked for r in runs),
            sum(r.duplicates for r in runs),
            sum(r.wrongly_destroyed for r in runs),
            sum(r.lost for r in runs),
            f"{statistics.median(r.recovery_s for r in runs):.1f}",
        )
        bad += sum(int(c) for c in cells[3:7])
        print("".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)))
    print(f"leaked + duplicates + healthy destroyed + records lost = {bad} (the bar: 0)")


if __name__ == "__main__":
    main()
