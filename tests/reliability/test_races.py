"""Concurrency: `fleet up`, `fleet destroy`, `fleet reconcile` and a running daemon (health and reconcile
every second, reprice every minute) race on one SQLite database for a while. The caps are never exceeded,
no intent buys twice, no host is destroyed that was not meant to be, and a final `destroy --all` leaves
nothing alive. Three `fleet up` at once hold to the caps too."""

import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from tests.fleetkit import write_config
from tests.helpers import listed_instances
from tests.reliability.invariants import cloud_books, record_hosts, settled

SECONDS = 45
CAP = 3


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


def reprice_moves(database) -> set[str]:
    """The hosts the daemon's reprice replaced (its answer to each move names the new host)."""
    with sqlite3.connect(database) as db:
        rows = db.execute(
            "SELECT h.name, e.detail FROM events e JOIN hosts h ON h.id = e.host_id"
            " WHERE e.kind = 'answer' AND e.action = 'replace'"
        ).fetchall()
    return {name for name, detail in rows if json.loads(detail)["reason"].startswith("reprice:")}


def host_events(database, host_id: int) -> list[tuple[str, str, str]]:
    with sqlite3.connect(database) as db:
        return db.execute(
            "SELECT kind, action, detail FROM events WHERE host_id = ? AND action != 'credit' ORDER BY id", (host_id,)
        ).fetchall()


def test_up_destroy_reconcile_and_the_daemon_race_without_harm(cloud, tmp_path):
    cloud.set_faults({})
    write_config(
        tmp_path,
        caps={"max_hosts_total": CAP, "max_hosts_per_model": CAP},
        rotation={
            "health_every_s": 1,
            "reconcile_every_s": 1,
            "thermal_every_s": 0,  # tiny hosts share two cores: no thermal verdicts
            "reprice_cron": "* * * * *",
        },
    )
    env = {
        **os.environ,
        "FLEET_CONFIG": str(tmp_path / "fleet.toml"),
        "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir),
    }
    database = tmp_path / "fleet.db"

    def fleet(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "fleet.cli", *args], env=env, capture_output=True, text=True, timeout=600
        )

    most_live = [0]
    watching = threading.Event()

    def watch_the_marketplace() -> None:
        while not watching.is_set():
            with contextlib.suppress(OSError, ValueError):  # the cloud rewrites its books as we read
                most_live[0] = max(most_live[0], len(cloud_books(cloud.info.state_dir)["instances"]))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_the_marketplace, daemon=True)
    watcher.start()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "fleet.cli", "daemon", "--metrics-port", "0"],
        env=env,
        stdout=(tmp_path / "daemon.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    started = time.monotonic() + 60
    while "daemon started" not in (tmp_path / "daemon.log").read_text():
        assert time.monotonic() < started and daemon.poll() is None, (tmp_path / "daemon.log").read_text()
        time.sleep(0.1)
    rng = random.Random(10)
    meant_to_go: set[str] = set()
    outputs: list[str] = []
    try:
        deadline = time.monotonic() + SECONDS
        running: list[tuple[str, subprocess.Popen]] = []
        while time.monotonic() < deadline:
            running = [(kind, p) for kind, p in running if p.poll() is None]
            if len(running) < 3:
                roll = rng.random()
                if roll < 0.45:
                    args = ["up", "--model", "tiny", "--region", "eu", "--count", str(rng.choice([1, 2]))]
                elif roll < 0.7:
                    ready = [h["name"] for h in record_hosts(database) if h["state"] == "ready"]
                    if not ready:
                        continue
                    name = rng.choice(ready)
                    meant_to_go.add(name)
                    args = ["destroy", name]
                else:
                    args = ["reconcile"]
                process = subprocess.Popen(
                    [sys.executable, "-m", "fleet.cli", *args],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                running.append((args[0], process))
            time.sleep(rng.uniform(0.2, 1.5))
        for _, process in running:
            out, err = process.communicate(timeout=300)
            outputs.append(out + err)
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(120) == 0, (tmp_path / "daemon.log").read_text()
    log = (tmp_path / "daemon.log").read_text()
    assert "Traceback" not in log, log

    hosts = record_hosts(database)
    # the daemon's reprice moves a host to a cheaper offer that a destroy freed (make before break): meant too
    moved = reprice_moves(database)
    # no host went that nobody meant to go: every one that served left by a destroy we asked for, or by a move
    served_and_gone = [h for h in hosts if h["ready_at"] and h["destroyed_at"]]
    assert {h["name"] for h in served_and_gone} <= meant_to_go | moved, [
        (h["name"], h["state"], h["failure_reason"], host_events(database, h["id"]))
        for h in served_and_gone
        if h["name"] not in meant_to_go | moved
    ]
    # nothing of ours failed a host under another process's feet, and no machine was blamed
    assert not [h["name"] for h in hosts if "interrupted" in (h["failure_reason"] or "")]
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT COUNT(*) FROM blacklist").fetchone()[0] == 0

    final = fleet("reconcile", "--json")
    assert final.returncode == 0, final.stderr
    assert json.loads(final.stdout)["strays_destroyed"] == []
    done = fleet("destroy", "--all", "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    watching.set()
    watcher.join()
    assert most_live[0] <= CAP, f"{most_live[0]} instances were live at once; the cap is {CAP}"
    findings = settled(cloud.info.state_dir, [database])
    assert findings.clean(), findings
    assert len(hosts) >= 3  # the race did rent


async def test_caps_hold_across_processes(cloud, tmp_path):
    """The caps used to hold within one process alone: three `fleet up` at once under a cap of one rent one host."""
    write_config(tmp_path, caps={"max_hosts_total": 1})
    env = {
        **os.environ,
        "FLEET_CONFIG": str(tmp_path / "fleet.toml"),
        "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir),
    }
    argv = [sys.executable, "-m", "fleet.cli", "up", "--model", "tiny", "--region", "eu"]
    runs = [
        await asyncio.create_subprocess_exec(*argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    outcomes = [await r.communicate() for r in runs]
    codes = [r.returncode for r in runs]
    assert sorted(codes) == [0, 1, 1], outcomes
    assert all(b"caps.max_hosts_total = 1" in err for (_, err), code in zip(outcomes, codes, strict=True) if code)
    async with cloud.client() as api:
        assert len(await listed_instances(api)) == 1
    done = subprocess.run([*argv[:3], "destroy", "--all", "--yes"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
