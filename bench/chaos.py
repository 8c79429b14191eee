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
import asyncio
import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from fleet.localcloud import control
from tests.control.test_rotation import RoundRobinClient
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
    own: dict[str, int] = field(default_factory=dict)  # the fault's own bar (each must be 0): blacklistings, ...


@dataclass
class Bed:
    """One run's cloud, config and database."""

    directory: Path
    cloud: control.CloudInfo
    env: dict[str, str] = field(default_factory=dict)
    asked: set[str] = field(default_factory=set)  # hosts a user command (or vast.ai itself) took away
    own: dict[str, int] = field(default_factory=dict)  # what the fault's own bar counted
    databases: list[Path] = field(default_factory=list)  # other installs' records on the same account

    @property
    def config(self) -> Path:
        return Path(self.env["FLEET_CONFIG"])

    def configure(self, old: str, new: str) -> None:
        text = self.config.read_text()
        assert old in text, old
        self.config.write_text(text.replace(old, new))

    def blacklisted(self) -> int:
        with sqlite3.connect(self.directory / "fleet.db") as db:
            return db.execute("SELECT COUNT(*) FROM blacklist").fetchone()[0]

    def hosts(self) -> list[dict]:
        return json.loads(self.fleet("status", "--json").stdout)

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


def pool_host_exited(bed: Bed, rng: random.Random) -> None:
    # vast.ai shows the stopped pool host `exited`: it stays in the pool and `up` takes it first
    bed.fleet(*STANDBY)
    up = json.loads(bed.fleet(*UP, "--json").stdout)
    bed.own["pool host not taken"] = int(not any(a["resumed"] and a["outcome"] == "ready" for a in up["attempts"]))


def destroyed_rows(bed: Bed, rng: random.Random) -> None:
    # after a destroy, show answers null, a 404 or a row saying `destroyed`, by id: three hosts meet all three
    bed.fleet("up", "--model", "tiny", "--region", "eu", "--count", "3")
    bed.asked |= {h["name"] for h in bed.hosts()}
    bed.fleet("destroy", "--all", "--yes")
    bed.own["reconcile errors"] = int(bed.fleet("reconcile").returncode != 0)


def image_not_pulled(bed: Bed, rng: random.Random) -> None:
    image = next(line for line in bed.config.read_text().splitlines() if line.startswith("image = ")).split('"')[1]
    bed.faults({"missing_images": [image]})
    bed.fleet(*UP)
    bed.own["machines blacklisted"] = bed.blacklisted()
    bed.faults({})


def lying_listing(bed: Bed, rng: random.Random) -> None:
    # a machine whose listing names the ports of a host fleet serves on: no certificate, the next offer serves
    bed.fleet("up", "--model", "tiny", "--region", "eu")
    [first] = bed.hosts()
    [liar] = bed.first_machines(1)
    bed.faults({"lying_ports": {str(liar): first["instance_id"]}})
    bed.fleet("up", "--model", "tiny", "--region", "eu")  # the liar fails at its certificate; the next serves
    bed.own["machine lied, not blacklisted"] = int(bed.blacklisted() != 1)
    bed.faults({})


def maintenance_announced(bed: Bed, rng: random.Random) -> None:
    # the cheapest machine goes down for maintenance in an hour: never rented, and nothing is blamed
    [first] = bed.first_machines(1)
    bed.faults({"maintenances": {str(first): [time.time() + 3600, 2.0]}, "renter_reads_maintenances": True})
    bed.fleet(*UP)
    bed.own["machine in maintenance rented"] = int(any(h["machine_id"] == first for h in bed.hosts()))
    bed.own["machines blacklisted"] = bed.blacklisted()
    bed.faults({})


def a_big_image(bed: Bed, rng: random.Random) -> None:
    # a 60 GB image: its pull lasts past create_to_running on every link, and blames no machine
    image = next(line for line in bed.config.read_text().splitlines() if line.startswith("image = ")).split('"')[1]
    bed.configure("image_gb = 5.0", "image_gb = 60.0")
    bed.configure("create_to_running = 600", "create_to_running = 5  ")
    bed.faults({"image_sizes": {image: 60_000_000_000}})
    bed.fleet(*UP)
    bed.own["machines blacklisted"] = bed.blacklisted()
    bed.faults({})


def credit_spent(bed: Bed, rng: random.Random) -> None:
    bed.fleet(*UP)
    user = httpx.get(
        f"{bed.cloud.url}/api/v0/users/current", headers={"Authorization": f"Bearer {bed.cloud.api_key()}"}
    ).json()
    bed.faults({"credit_usd": 100.0 - user["credit"] + 1e-6})  # spent a moment from now: vast.ai stops them all
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(i["cur_state"] != "stopped" for i in _instances(bed)):
        time.sleep(0.5)
    bed.asked |= {h["name"] for h in bed.hosts()}  # vast.ai took them away, not fleet
    bed.fleet("health")  # no replacement can be rented; no machine is blamed
    bed.fleet("reconcile")
    bed.own["machines blacklisted"] = bed.blacklisted()
    bed.faults({})  # the account is topped up: recovery rents again


def contract_ends(bed: Bed, rng: random.Random) -> None:
    # the first machine's contract ends in 11.5 h; fleet moves off it 12 h ahead while a caller keeps talking
    bed.configure("min_contract_hours = 48 ", "min_contract_hours = 11 ")
    bed.configure("contract_margin_hours = 6 ", "contract_margin_hours = 12")
    [machine] = bed.first_machines(1)
    headers = {"Authorization": f"Bearer {bed.cloud.api_key()}"}
    offers = httpx.post(f"{bed.cloud.url}/api/v0/bundles/", json={"machine_id": {"eq": machine}}).json()["offers"]
    httpx.put(
        f"{bed.cloud.url}/admin/offers/{offers[0]['id']}", json={"end_date": time.time() + 11.5 * 3600}, headers=headers
    ).raise_for_status()
    bed.fleet(*UP)
    ending = [h["name"] for h in bed.hosts() if h["machine_id"] == machine]
    bed.asked |= set(ending)
    client = RoundRobinClient(bed.config.parent / "endpoints.json")
    calls = threading.Thread(target=asyncio.run, args=(client.run(),))
    calls.start()
    try:
        bed.fleet("health")
    finally:
        client.stop = True
        calls.join()
    still = [h["name"] for h in bed.hosts() if h["name"] in ending and h["state"] == "ready"]
    bed.own["calls dropped"] = client.failed
    bed.own["ending host kept"] = len(still)


def second_install(bed: Bed, rng: random.Random) -> None:
    # a laptop on the same account with its own database: neither install takes the other's hosts
    other = bed.directory / "laptop"
    other.mkdir()
    env = {**bed.env, "FLEET_CONFIG": str(write_config(other))}
    laptop = Bed(other, bed.cloud, env)
    bed.databases.append(other / "fleet.db")
    laptop.fleet("up", "--model", "tiny", "--region", "eu")
    theirs = {h["instance_id"] for h in laptop.hosts()}
    bed.fleet(*UP)
    bed.fleet("reconcile")
    bed.fleet("destroy", "--all", "--yes")
    bed.asked |= {h["name"] for h in json.loads(bed.fleet("status", "--all", "--json").stdout)}
    alive = {i["id"] for i in _instances(bed)}
    bed.own["others' hosts destroyed"] = len(theirs - alive)
    laptop.fleet("destroy", "--all", "--yes")


def _instances(bed: Bed) -> list[dict]:
    return json.loads((bed.cloud.state_dir / "state.json").read_text())["instances"].values()


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
    "pool host stopped as exited": pool_host_exited,
    "destroyed rows after destroy": destroyed_rows,
    "an image that cannot be pulled": image_not_pulled,
    "credit spent mid-session": credit_spent,
    "a contract ends under READY": contract_ends,
    "a second install, one account": second_install,
    "a listing lends a host's ports": lying_listing,
    "maintenance announced": maintenance_announced,
    "a big image on every link": a_big_image,
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
        findings = settled(cloud.state_dir, [directory / "fleet.db", *bed.databases])
        run.leaked, run.duplicates, run.lost = len(findings.leaked), len(findings.duplicates), len(findings.lost)
        run.wrongly_destroyed = len(served - bed.asked)
        run.own = bed.own
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
    header = (
        "fault",
        "runs",
        "READY",
        "leaked",
        "duplicates",
        "healthy destroyed",
        "records lost",
        "recovery s",
        "its own bar",
    )
    widths = (32, 5, 6, 7, 11, 18, 13, 11, 30)
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
            ", ".join(f"{k} {sum(r.own.get(k, 0) for r in runs)}" for k in runs[0].own) or "-",
        )
        bad += sum(int(c) for c in cells[3:7]) + sum(sum(r.own.values()) for r in runs)
        print("".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)))
    print(f"leaked + duplicates + healthy destroyed + records lost + the faults' own bars = {bad} (the bar: 0)")


if __name__ == "__main__":
    main()
