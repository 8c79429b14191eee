"""The PostgreSQL path against a real server: the same migrations, fleet up on it, and two daemons
sharing it: each tick of a job runs once, and a dead host is replaced once."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, text
from sqlmodel import SQLModel

from fleet.control.up import UpRequest
from fleet.core import record as db
from fleet.core.models import HostState
from tests.fleetkit import fleet_for, settings_for, write_config
from tests.helpers import kill_llama_server


def test_migrations_build_the_models_schema_on_postgres(postgres_url):
    engine = db.open_database(postgres_url)
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), SQLModel.metadata) == []
    db.migrate(engine)  # again: a no-op
    engine.dispose()


async def test_fleet_up_and_destroy_on_postgres(cloud, local_cloud_env, postgres_url, tmp_path):
    settings = settings_for(tmp_path)
    settings = settings.model_copy(update={"database": settings.database.model_copy(update={"url": postgres_url})})
    async with fleet_for(settings) as fleet:
        host = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        assert fleet.record.hosts(names=[host.name])[0].state == HostState.READY
        await fleet.destroy(None)
    assert not (tmp_path / "fleet.db").exists()  # everything went to PostgreSQL
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT state FROM hosts")).scalars().all() == ["destroyed"]
    engine.dispose()


def fleet(env, *args):
    return subprocess.run(
        [sys.executable, "-m", "fleet.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


async def test_two_daemons_share_postgres_without_doubling_work(cloud, postgres_url, tmp_path):
    # A health tick reads the instance listing, which vast.ai allows once a second per key, shared by both
    # daemons and the replacement's own bring-up: ticks every 3 s leave the bring-up room to see its host.
    write_config(tmp_path, rotation={"health_every_s": 3, "drain_timeout_s": 5})
    env = {
        **os.environ,
        "FLEET_CONFIG": str(tmp_path / "fleet.toml"),
        "FLEET_DATABASE_URL": postgres_url,
        "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir),
        "PYTHONUNBUFFERED": "1",
    }
    assert fleet(env, "up", "--model", "tiny", "--region", "eu").returncode == 0
    [old] = json.loads(fleet(env, "status", "--json").stdout)
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        ssh_host, ssh_port = conn.execute(text("SELECT ssh_host, ssh_port FROM hosts")).one()

    logs = [tmp_path / "daemon-a.log", tmp_path / "daemon-b.log"]
    daemons = [
        subprocess.Popen(
            [sys.executable, "-m", "fleet.cli", "daemon", "--metrics-port", "0"],
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for log in logs
    ]
    try:
        deadline = time.monotonic() + 30
        while not all("daemon started" in log.read_text() for log in logs):
            assert all(d.poll() is None for d in daemons), [log.read_text() for log in logs]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(3)
        await kill_llama_server(ssh_host, ssh_port, tmp_path / "ssh" / "id_ed25519")
        deadline = time.monotonic() + 150
        while True:
            with engine.connect() as conn:
                ready = conn.execute(text("SELECT name FROM hosts WHERE state = 'ready'")).scalars().all()
            if ready and ready != [old["name"]]:
                break
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            time.sleep(0.2)
        time.sleep(2)
    finally:
        for d in daemons:
            d.send_signal(signal.SIGTERM)
        codes = [d.wait(60) for d in daemons]
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], texts
    with engine.connect() as conn:
        ticks = conn.execute(text("SELECT tick, daemon FROM job_runs WHERE job = 'health'")).all()
        replacements = conn.execute(text("SELECT name FROM hosts WHERE replaces IS NOT NULL")).scalars().all()
        states = dict(conn.execute(text("SELECT name, state FROM hosts")).all())
    engine.dispose()
    ran = sum(len(re.findall(r"health: \d+ READY", t)) for t in texts)
    assert ticks and ran == len(ticks)  # each tick of the health job ran on exactly one daemon
    assert len({d for _, d in ticks}) == 2  # and both daemons took turns
    assert sum(t.count("skipped") for t in texts) >= 1
    assert len(replacements) == 1 and states[old["name"]] == "destroyed"
    assert fleet(env, "destroy", "--all", "--yes").returncode == 0


def test_turns_at_the_marketplace_on_postgres(postgres_url):
    from fleet.core.record import Record
    from tests.market.test_market_turns import check_turns

    engine = db.open_database(postgres_url)
    check_turns(Record(engine))
    engine.dispose()


async def test_a_machine_whose_clock_runs_ahead_stalls_no_other_at_the_marketplace(postgres_url, monkeypatch):
    """Security round four: the install's budget of marketplace calls took each machine's own clock, so one running
    an hour ahead held every turn it took an hour into the others' future. Its times are PostgreSQL's now."""
    from fleet.context import InstallBudget
    from fleet.core.record import Record
    from fleet.market.pacing import Pace

    engine = db.open_database(postgres_url)
    try:
        pace = Pace(interval_s=0.5)
        ahead = InstallBudget(Record(engine), "http://market", 30.0)
        right = InstallBudget(Record(engine), "http://market", 30.0)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3600.0)  # this process's clock, an hour ahead
        token, wait = await ahead.claim("list", pace)
        assert token is not None and wait == 0.0
        await ahead.release("list", pace, token)
        monkeypatch.setattr(time, "time", real)
        started = time.monotonic()
        while (turn := await right.claim("list", pace))[0] is None:  # the other machine, its clock right
            assert turn[1] < 5, f"asked to wait {turn[1]:.0f}s"
            await asyncio.sleep(turn[1])
        assert time.monotonic() - started < 5
    finally:
        engine.dispose()
