"""`fleet daemon` as a process: it replaces a dead host on its own, refuses a second daemon on the
same database, serves metrics, and stops cleanly on SIGTERM."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import httpx

from fleet.control.daemon import cron_tick
from fleet.core.record import Record, open_database
from fleet.localcloud.network import free_port
from tests.fleetkit import write_config
from tests.helpers import kill_llama_server

FAST = {
    "unhealthy_after_sweeps": 2,
    "health_timeout_s": 5,
    "drain_timeout_s": 5,
    "health_every_s": 1,
    "reconcile_every_s": 3600,
    "reprice_cron": "0 3 * * *",
}


def daemon_config(cloud, tmp_path, extra: str = "", **rotation: object) -> dict[str, str]:
    """The repo's fleet.toml with a fast [rotation] (and `rotation`'s keys, and `extra`: its [[serve]] tables
    replace the shipped one), and the env a daemon and commands run with."""
    write_config(tmp_path, extra, rotation={**FAST, **rotation})
    return {
        **os.environ,
        "FLEET_CONFIG": str(tmp_path / "fleet.toml"),
        "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir),
        "PYTHONUNBUFFERED": "1",
    }


def fleet(env, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "fleet.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def ready_hosts(db_path) -> list[tuple[str, str]]:
    with sqlite3.connect(db_path) as db:
        return db.execute("SELECT name, state FROM hosts WHERE state = 'ready' ORDER BY id").fetchall()


def ready_and_old(db_path, old_name) -> list[tuple[str, str]]:
    with sqlite3.connect(db_path) as db:
        return db.execute("SELECT name, state FROM hosts WHERE name = ?", (old_name,)).fetchall()


async def test_daemon_replaces_a_dead_host_and_stops_cleanly(cloud, tmp_path):
    env = daemon_config(cloud, tmp_path)
    up = fleet(env, "up", "--model", "tiny", "--region", "eu")
    assert up.returncode == 0, up.stderr
    [host] = json.loads(fleet(env, "status", "--json").stdout)
    db_path = tmp_path / "fleet.db"
    with sqlite3.connect(db_path) as db:
        ssh_host, ssh_port = db.execute(
            "SELECT ssh_host, ssh_port FROM hosts WHERE name = ?", (host["name"],)
        ).fetchone()

    port = free_port()
    log = (tmp_path / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "fleet.cli", "daemon", "--metrics-port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while "daemon started" not in (tmp_path / "daemon.log").read_text():
            assert daemon.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            time.sleep(0.1)
        second = fleet(env, "daemon", "--metrics-port", "0", timeout=30)
        assert second.returncode == 1 and "another fleet daemon" in second.stderr

        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'fleet_hosts{model="tiny",state="ready"} 1.0' in metrics
        assert "fleet_usd_per_hour" in metrics and 'fleet_probe_passed{host="' in metrics

        await kill_llama_server(ssh_host, ssh_port, tmp_path / "ssh" / "id_ed25519")
        killed_at = time.monotonic()
        deadline = killed_at + 40
        while True:
            ready = ready_hosts(db_path)
            if ready and ready[0][0] != host["name"]:
                break
            assert time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            time.sleep(0.2)
        while dict(ready_and_old(db_path, host["name"]))[host["name"]] != "destroyed":
            assert time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            time.sleep(0.2)
        endpoints = json.loads((tmp_path / "endpoints.json").read_text())
        assert [e["name"] for e in endpoints] == [ready[0][0]]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'fleet_replacements_total{reason="unhealthy"} 1.0' in metrics
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(60)
        log.close()
    text = (tmp_path / "daemon.log").read_text()
    assert code == 0, text
    assert "health: 1 READY, 1 failing" in text and "replaced by" in text and "daemon stopped" in text
    assert fleet(env, "destroy", "--all", "--yes").returncode == 0


def states(db_path) -> list[str]:
    try:
        with sqlite3.connect(db_path) as db:
            return sorted(s for (s,) in db.execute("SELECT state FROM hosts WHERE destroyed_at IS NULL"))
    except sqlite3.OperationalError:  # the daemon has not made its database yet
        return []


def test_daemon_keeps_a_serve_target_and_its_standby_pool(cloud, tmp_path):
    serve = '\n[[serve]]\nmodel = "tiny"\nregion = "eu"\ncalls = 1\nheadroom = 0.0\nstandby = 1\n'
    env = daemon_config(cloud, tmp_path, serve)
    log = (tmp_path / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "fleet.cli", "daemon", "--metrics-port", "0"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while states(tmp_path / "fleet.db") != ["ready", "standby"]:
            assert daemon.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            time.sleep(0.5)
        status = fleet(env, "status")
        assert "tiny in eu: target 1 callers (1 calls + headroom), READY capacity 1, in flight 0, standby pool 1/1" in (
            status.stdout
        ), status.stdout
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(120)
        log.close()
        destroyed = fleet(env, "destroy", "--all", "--yes", timeout=300)
    text = (tmp_path / "daemon.log").read_text()
    assert code == 0, text
    assert "serve: tiny in eu" in text and destroyed.returncode == 0


READER = """
import os, signal, sqlite3, sys
path, missing, stop = sys.argv[1], 0, []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
while not stop:
    db = sqlite3.connect(path, timeout=10)
    db.execute("SELECT COUNT(*) FROM hosts").fetchone()
    db.close()
    missing += not os.path.exists(path + "-wal")
print(missing)
"""


def test_the_daemon_and_a_stream_of_other_commands_share_the_database_unharmed(cloud, tmp_path):
    """A daemon ticking every second beside `fleet status`, `endpoints` and `machines` run again and again (as
    a person and their scripts do): no job fails, and the database passes SQLite's integrity check. Closing
    any descriptor of the database file drops every POSIX lock the process holds on it, so a process that
    opens the file behind SQLite's back lets another one delete the WAL under the daemon."""
    env = daemon_config(cloud, tmp_path, reconcile_every_s=2)
    assert fleet(env, "up", "--model", "tiny", "--region", "eu").returncode == 0
    db_path = tmp_path / "fleet.db"
    log = (tmp_path / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "fleet.cli", "daemon", "--metrics-port", "0"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    commands = 0
    try:
        while "daemon started" not in (tmp_path / "daemon.log").read_text():
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()
            time.sleep(0.1)
        with sqlite3.connect(db_path) as db:
            ticks_before = db.execute("SELECT COUNT(*) FROM job_runs").fetchone()[0]
        # a script beside them that reads the database many times a second, each time on a new connection:
        # when the daemon has lost its locks, the first of these to close takes the WAL away from under it
        reader = subprocess.Popen([sys.executable, "-c", READER, str(db_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(4):  # a stream of other commands, each its own process and engine
            for args in (("status",), ("endpoints",), ("machines", "--json")):
                done = fleet(env, *args)
                assert done.returncode == 0, done.stderr
                commands += 1
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()
        reader.terminate()
        wal_missing = int(reader.communicate(timeout=30)[0].split()[-1])
        with sqlite3.connect(db_path) as db:
            ticks_after = db.execute("SELECT COUNT(*) FROM job_runs").fetchone()[0]
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(60)
        log.close()
    text = (tmp_path / "daemon.log").read_text()
    assert code == 0, text
    assert commands == 12 and ticks_after - ticks_before >= 10  # the daemon kept working throughout
    assert wal_missing == 0  # the daemon's connections held the database open: no one took the WAL away
    assert "Traceback" not in text and "raised an exception" not in text and "disk I/O error" not in text, text
    assert "alembic" not in text and "another daemon" not in text  # one daemon alone, and no migration chatter
    with sqlite3.connect(db_path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert fleet(env, "destroy", "--all", "--yes").returncode == 0


def test_reprice_claims_each_firing_of_its_cron_and_a_late_run_of_one_firing_is_skipped(tmp_path):
    """A reprice cron every 2 minutes fires 30 times an hour: each firing is its own tick (it used to be claimed
    once an hour whatever the cron said, the other 29 skipped as "a late run of the same tick")."""
    record = Record(open_database(tmp_path / "fleet.db"))
    now = datetime(2026, 12, 5, 4, 7, 30, tzinfo=UTC)
    firing = cron_tick("*/2 * * * *", now)
    assert firing == int(datetime(2026, 12, 5, 4, 6, tzinfo=UTC).timestamp())
    late = cron_tick("*/2 * * * *", now + timedelta(seconds=25))  # the same firing, run late
    following = cron_tick("*/2 * * * *", now + timedelta(minutes=1))
    assert late == firing and following == firing + 120
    assert record.claim_tick("reprice", firing, "daemon-a") is None
    assert record.claim_tick("reprice", late, "daemon-b") == "daemon-a"  # skipped: it ran there
    assert record.claim_tick("reprice", following, "daemon-b") is None  # the next firing runs
    nightly = cron_tick("0 3 * * *", now)
    assert nightly == int(datetime(2026, 12, 5, 3, 0, tzinfo=UTC).timestamp())
