"""`fleet cloud start|status|stop`, and instances surviving a restart of the local cloud."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from fleet.localcloud import control, procs
from tests.helpers import host_processes

FLEET = [sys.executable, "-m", "fleet.cli"]


def fleet(*args: str, state_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLEET_LOCALCLOUD_DIR": str(state_dir)}
    return subprocess.run([*FLEET, *args], env=env, capture_output=True, text=True, timeout=60)


def test_cloud_start_status_stop(tmp_path, llama_server):
    state = tmp_path / "cloud"
    try:
        started = fleet("cloud", "start", "--json", state_dir=state)
        assert started.returncode == 0, started.stderr
        status = json.loads(fleet("cloud", "status", "--json", state_dir=state).stdout)
        assert status["running"] is True and status["instances"] == 0
        assert status["url"].startswith("http://127.0.0.1:")
        key_file = Path(status["api_key_file"])
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        assert key_file.read_text().strip() not in started.stdout + started.stderr
        again = fleet("cloud", "start", "--json", state_dir=state)
        assert json.loads(again.stdout)["pid"] == status["pid"]  # already running: the same server
    finally:
        stopped = fleet("cloud", "stop", state_dir=state)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert json.loads(fleet("cloud", "status", "--json", state_dir=state).stdout)["running"] is False
    assert "not running" in fleet("cloud", "stop", state_dir=state).stdout


def test_instances_survive_a_restart_and_come_back_running(tmp_path, llama_server):
    state = tmp_path / "cloud"
    # kind: raw back-to-back calls; what a restart keeps does not depend on vast.ai's rate limits.
    info = control.start(state, provision_delay_s=0.1, loading_delay_s=0.1, kind=True)
    headers = {"Authorization": f"Bearer {info.api_key()}"}
    try:
        offers = httpx.post(f"{info.url}/api/v0/bundles/", json={"order": [["dph_total", "asc"]]}).json()["offers"]
        body = {"image": "x", "disk": 20, "onstart": "sleep 600"}  # a process of the host that carries its marker
        r = httpx.put(f"{info.url}/api/v0/asks/{offers[0]['id']}/", json=body, headers=headers)
        instance_id = r.json()["new_contract"]
        token = json.loads((state / "state.json").read_text())["instances"][str(instance_id)]["token"]
        deadline = time.monotonic() + 15
        while not procs.pids_with_marker(token) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert procs.pids_with_marker(token), "the host never ran a process"
        control.stop(state)
        assert host_processes(state, instance_id, token) == []  # stopping the cloud ends the hosts' processes

        info = control.start(state, provision_delay_s=0.1, loading_delay_s=0.1, kind=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            row = httpx.get(f"{info.url}/api/v0/instances/{instance_id}/", headers=headers).json()["instances"]
            if row and row["actual_status"] == "running":
                break
            time.sleep(0.1)
        assert row["actual_status"] == "running"
        assert httpx.get(f"{info.url}/api/v1/instances/", headers=headers).json()["total_instances"] == 1
        httpx.delete(f"{info.url}/api/v0/instances/{instance_id}/", headers=headers).raise_for_status()
    finally:
        control.stop(state)


def test_a_cloud_that_died_without_a_word_is_not_mistaken_for_the_process_now_holding_its_pid(tmp_path):
    """Found failing another test: a cloud killed without its shutdown leaves its server.json; the PID in it
    is soon another process's (they wrap at 32,768 here), and `fleet cloud stop` sent that process SIGTERM,
    which had been a fresh cloud of another test. A server.json names its process by PID and start time."""
    state = tmp_path / "cloud"
    state.mkdir()
    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)  # whoever holds the PID now
    try:
        (state / "server.json").write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": stranger.pid, "port": 9}))
        status = json.loads(fleet("cloud", "status", "--json", state_dir=state).stdout)
        assert status["running"] is False
        stopped = fleet("cloud", "stop", state_dir=state)
        assert stopped.returncode == 0 and "not running" in stopped.stdout
        assert stranger.poll() is None, "fleet cloud stop ended a process that was not its cloud"
    finally:
        stranger.kill()
        stranger.wait()
