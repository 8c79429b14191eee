"""What a new user met (issue 21): bad input refused in one line with exit 2 (and `{"error": ...}` under
--json); every file fleet writes under one state directory; commands that need no marketplace start no
cloud; stopping the local cloud settles its hosts; a dead host leaves the endpoints even when no
replacement can be made. All through the `fleet` command, on the real local cloud."""

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fleetkit import ROOT, cli_env, write_config
from tests.helpers import kill_llama_server


def fleet(env, *args, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "fleet.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def env(cloud, tmp_path):
    return cli_env(cloud, tmp_path)


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_bad_input_is_one_line_and_exit_2_and_json_under_json(env, tmp_path):
    folder = fleet(env, "status", "--config", str(tmp_path))
    assert folder.returncode == 2 and "a folder, not a config file" in one_line(folder)
    latin = tmp_path / "latin.toml"
    latin.write_bytes((ROOT / "fleet.toml").read_bytes() + b"\n# caf\xe9\n")
    encoded = fleet(env, "status", "--config", str(latin))
    assert encoded.returncode == 2 and "not UTF-8 text" in one_line(encoded)
    price = fleet(env, "offers", "--model", "tiny", "--region", "eu", "--max-price", "-5")
    assert price.returncode == 2 and "--max-price must be positive" in one_line(price)
    future = fleet(env, "report", "--since", "2030-01-01")
    assert future.returncode == 2 and "in the future" in one_line(future)
    nowhere = fleet(env, "offers", "--model", "tiny", "--region", "XX")
    assert nowhere.returncode == 2 and "ISO 3166" in one_line(nowhere)
    as_json = fleet(env, "offers", "--model", "tiny", "--region", "XX", "--json")
    assert as_json.returncode == 2 and "ISO 3166" in json.loads(as_json.stdout)["error"]
    # a country code in any case is a region; fleet records it in capitals
    germany = fleet(env, "offers", "--model", "tiny", "--region", "de", "--json")
    assert germany.returncode == 0, germany.stderr
    offers = json.loads(germany.stdout)["offers"]
    assert offers and all(o["geolocation"].endswith("DE") for o in offers)


def test_files_follow_one_state_directory_and_status_starts_no_cloud(tmp_path, cloud):
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k not in ("FLEET_STATE_DIR", "FLEET_LOCALCLOUD_DIR")}
    env.update(XDG_STATE_HOME=str(state), FLEET_CONFIG=str(ROOT / "fleet.toml"))
    home = state / "fleet"
    status = fleet(env, "status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout) == []
    assert (home / "fleet.db").exists()  # the record, where the rule says
    assert not (home / "localcloud" / "server.json").exists() and not (home / "ssh").exists()  # nothing started
    for command in (("endpoints", "--json"), ("machines", "--json")):
        assert fleet(env, *command).returncode == 0
    assert not (home / "localcloud" / "server.json").exists()
    try:
        up = fleet(env, "up", "--model", "tiny", "--region", "eu")  # needs the marketplace: starts it, says so
        assert up.returncode == 0, up.stderr
        assert "starting the local cloud" in up.stderr and (home / "localcloud" / "server.json").exists()
        assert (home / "ssh" / "id_ed25519").exists() and (home / "endpoints.json").exists()
        saved = json.loads(fleet(env, "offers", "-m", "tiny", "-r", "eu", "--save", "--json").stdout)["saved"]
        assert Path(saved).parent == home / "offers" and Path(saved).exists()
        report = json.loads(fleet(env, "report", "--json").stdout)
        assert Path(report["html"]).parent.parent == home / "reports"
    finally:
        stopped = fleet(env, "cloud", "stop", "--json")  # the cloud goes, and its hosts with it
    assert stopped.returncode == 0, stopped.stderr
    assert len(json.loads(stopped.stdout)["destroyed"]) == 1
    [host] = json.loads(fleet(env, "status", "--all", "--json").stdout)
    assert host["state"] == "destroyed" and host["destroyed_at"]
    assert json.loads(fleet(env, "endpoints", "--json").stdout) == []
    assert not (home / "localcloud" / "server.json").exists()


async def test_a_dead_host_leaves_the_endpoints_at_the_cap_and_health_exits_1(cloud, tmp_path):
    config = write_config(tmp_path, caps={"max_hosts_per_model": 1}, rotation={"unhealthy_after_sweeps": 1})
    env = {**os.environ, "FLEET_CONFIG": str(config), "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir)}
    up = fleet(env, "up", "--model", "tiny", "--region", "eu")
    assert up.returncode == 0, up.stderr
    [host] = json.loads(fleet(env, "status", "--json").stdout)
    with sqlite3.connect(tmp_path / "fleet.db") as db:
        ssh_host, ssh_port = db.execute("SELECT ssh_host, ssh_port FROM hosts").fetchone()
    await kill_llama_server(ssh_host, ssh_port, tmp_path / "ssh" / "id_ed25519")
    health = fleet(env, "health")
    assert health.returncode == 1, health.stdout + health.stderr  # a failing host is a failure
    assert "cap reached" in health.stderr and "retired all the same" in health.stderr
    assert json.loads(fleet(env, "endpoints", "--json").stdout) == []  # gone from the endpoints regardless
    [gone] = json.loads(fleet(env, "status", "--all", "--json").stdout)
    assert gone["name"] == host["name"] and gone["state"] == "destroyed"
    assert fleet(env, "destroy", "--all", "--yes").returncode == 0
