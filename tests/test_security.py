"""Security on real parts (issue 20): nothing of the operator's SSH setup reaches a host, a host's words
never drive the operator's terminal, and what a host serves hands no transcript to anyone."""

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fleet.control.up import UpRequest
from fleet.core.errors import FleetError
from fleet.host import hubfile
from fleet.host.phase import PhaseFailed
from fleet.host.remote import connect, run
from fleet.localcloud.hub import TINY_REPO
from tests.fleetkit import cli_env, fleet_for, settings_for
from tests.helpers import listed_instances


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


def _processes_carrying(secret: str) -> list[str]:
    """Every other process whose command line or environment holds `secret`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            for part in ("cmdline", "environ"):
                try:
                    if secret.encode() in (entry / part).read_bytes():
                        found.append(f"{entry.name} {part}")
                except OSError:
                    continue
    return found


async def _hub_stats(cloud) -> dict:
    async with cloud.client() as api:
        return (await api.get("/admin/hub-stats")).json()


async def test_a_gated_models_token_opens_the_hub_for_fleet_and_reaches_no_host(
    cloud, tmp_path, monkeypatch, secrets_watch
):
    token = "hf_" + "g4t3d" * 7
    secrets_watch.register(token)
    cloud.set_faults({"gated_repos": {TINY_REPO: token}})
    try:
        # without the token: one clear error before anything is rented (the plan reads the file's header)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        async with fleet_for(settings_for(tmp_path / "none")) as fleet:
            with pytest.raises(FleetError, match=r"HTTP 401 GatedRepo: the hub refuses it .*\$HF_TOKEN"):
                await fleet.up(UpRequest("tiny", "eu"))
        async with cloud.client() as api:
            assert await listed_instances(api) == []
        # and where a host would pull it, the hub's refusal blames neither the machine nor the next offer
        url = f"{cloud.url}/{TINY_REPO}/resolve/main/tiny-llama-bytes.gguf"
        for given, why in (("", "gated or private, and $HF_TOKEN is not set"), ("hf_wrong", "does not open it")):
            with pytest.raises(PhaseFailed, match=re.escape(why)) as refused:
                await hubfile.resolve(url, given)
            assert refused.value.blacklist is False and refused.value.retry is False
        opened = await hubfile.resolve(url, token)
        assert (
            "/cdn/" in opened.download_url and "Signature=" in opened.download_url and token not in opened.download_url
        )

        monkeypatch.setenv("HF_TOKEN", token)
        before = await _hub_stats(cloud)
        seen: list[str] = []
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                seen.extend(_processes_carrying(token))
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        try:
            async with fleet_for(settings_for(tmp_path / "with")) as fleet:
                [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
                stop.set()
                await watcher
                after = await _hub_stats(cloud)
                assert after["token_requests"] > before["token_requests"]  # fleet itself opened the gate
                assert after["host_token_requests"] == before["host_token_requests"]  # no host ever showed it
                assert seen == []  # in no command line or environment, on the host or here
                for path in (cloud.info.state_dir / "hosts" / str(host.instance_id)).rglob("*"):
                    if path.is_file() and path.stat().st_size < 50_000_000:
                        assert token.encode() not in path.read_bytes(), path
                await fleet.destroy(None)
        finally:
            stop.set()
            await watcher
    finally:
        cloud.set_faults({})


async def test_a_pull_that_outlives_its_signed_url_goes_on_with_a_fresh_one(cloud, tmp_path):
    # the cut ends the URL's life: aria2c's retries are refused, and only a new URL from the hub goes on
    cloud.set_faults({"pull_reset": {"after_bytes": 100_000, "count": 1, "expire_url": True}})
    try:
        before = await _hub_stats(cloud)
        async with fleet_for(settings_for(tmp_path, up={"pull_connections": 1})) as fleet:
            result = await fleet.up(UpRequest("tiny", "eu"))
            await fleet.destroy(None)
        assert len(result.ready) == 1 and len(result.attempts) == 1, result.attempts  # the same host, no new rental
        after = await _hub_stats(cloud)
        assert after["refused_urls"] > before["refused_urls"]  # the old URL was refused, as an expired one is
    finally:
        cloud.set_faults({})
