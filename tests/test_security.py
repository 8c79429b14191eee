"""Security on real parts (issue 20): nothing of the operator's SSH setup reaches a host, a host's words
never drive the operator's terminal, and what a host serves hands no transcript to anyone."""

import asyncio
import os
import signal
import subprocess
import sys

import httpx
import pytest

from fleet.control.up import UpRequest
from fleet.host.remote import connect, run
from tests.fleetkit import cli_env, fleet_for, settings_for


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


async def test_the_operators_ssh_config_and_agent_never_reach_a_host(cloud, tmp_path, monkeypatch):
    # an operator whose ~/.ssh/config forwards the agent to every host, with an agent running
    home = tmp_path / "operator"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Host *\n    ForwardAgent yes\n    User nobody\n    Port 1\n")
    agent = subprocess.Popen(
        ["ssh-agent", "-D", "-a", str(tmp_path / "agent.sock")], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        while not (tmp_path / "agent.sock").exists():
            assert agent.poll() is None
            await asyncio.sleep(0.05)
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.setenv("SSH_AUTH_SOCK", str(tmp_path / "agent.sock"))
        async with fleet_for(settings_for(tmp_path)) as fleet:
            [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready  # reached despite User nobody, Port 1
            try:
                conn, _ = await connect(host.ssh_host, host.ssh_port, fleet.ssh_key, host.host_key, 30)
                try:
                    seen = await run(conn, ["sh", "-c", 'echo "agent=${SSH_AUTH_SOCK:-none}"'])
                finally:
                    conn.close()
                assert str(seen.stdout).strip() == "agent=none"  # no agent was forwarded to the host
            finally:
                await fleet.destroy(None)
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        agent.wait(10)


def test_a_hosts_log_with_markup_and_escape_codes_is_shown_as_text(cloud, tmp_path):
    # llama-server repeats an unknown argument in its error: the log tail carries what the "host" chose
    weird = (
        "\n[models.tiny-weird]\ngpu_ram_gb = 0\ndisk_gb = 10\nslots = 1\nctx_per_slot = 2048\n"
        'files = [{ key = "main", repo = "fleet-local/tiny-models", file = "tiny-llama-bytes.gguf" }]\n'
        'args = ["-c", "2048", "--[/INST]\\u001b[2J\\u001b[31mpwned"]\n'
    )
    env = cli_env(cloud, tmp_path)
    config = tmp_path / "fleet.toml"
    config.write_text(config.read_text() + weird)
    up = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "up", "--model", "tiny-weird", "--region", "eu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert up.returncode == 1, up.stdout + up.stderr
    assert "Traceback" not in up.stderr and "MarkupError" not in up.stderr
    assert "[/INST]" in up.stderr and "pwned" in up.stderr  # shown, as text
    assert "\x1b" not in up.stderr + up.stdout  # no escape sequence reaches the terminal
    subprocess.run([sys.executable, "-m", "fleet.cli", "destroy", "--all", "--yes"], env=env, timeout=300)


async def test_no_transcript_is_readable_through_a_host_and_the_drain_sees_calls_in_flight(cloud, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        try:
            key = {"Authorization": f"Bearer {host.api_key}"}
            async with httpx.AsyncClient(base_url=host.api_url, timeout=30) as client:
                for path in ("/slots", "/slots/0"):
                    assert (await client.get(path, headers=key)).status_code >= 400  # not even with the key
                assert (await client.get("/metrics")).status_code == 401  # without the key, nothing
                metrics = (await client.get("/metrics", headers=key)).text
                assert "llamacpp:requests_processing" in metrics
                page = await client.get("/", headers=key)
                assert page.status_code >= 400 or "<html" not in page.text.lower()  # no web UI
        finally:
            await fleet.destroy(None)
