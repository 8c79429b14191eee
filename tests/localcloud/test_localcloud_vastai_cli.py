"""The official vastai CLI (1.9.1), pointed at the strict local cloud (vast.ai's rate limits, read lag, late
SSH keys), searches, creates, shows, gives an ssh-url that leads to a working sshd, and destroys."""

import asyncio
import json
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import asyncssh

from tests.helpers import host_processes

SHOW_INTERVAL_S = 2.2  # vast.ai allows one show every 2 s per key; the CLI's own retries give up after ~0.4 s


def vastai(vastai_bin, env, cloud, *args: str) -> subprocess.CompletedProcess:
    """The CLI with the key in its key file, as a user keeps it (never on a command line, where ps shows it)."""
    run_env = {**env, "VAST_URL": cloud.url}
    key_file = Path(env["XDG_CONFIG_HOME"]) / "vastai" / "vast_api_key"
    key_file.parent.mkdir(parents=True, exist_ok=True)
    key_file.write_text(cloud.key)
    key_file.chmod(0o600)
    return subprocess.run(
        [vastai_bin, "--url", cloud.url, *args],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_vastai_cli_search_create_show_destroy(cloud, vastai_bin, vastai_env, ssh_keypair):
    query = (
        "reliability > 0.98 cuda_vers >= 12.8 direct_port_count >= 2 inet_down_cost <= 0.05 "
        "geolocation in [SE,DE,NL,PL,CZ,FI,FR,IT,ES,BE]"
    )
    found = vastai(vastai_bin, vastai_env, cloud, "search", "offers", query, "-o", "dph", "--raw")
    assert found.returncode == 0, found.stderr
    offers = json.loads(found.stdout)
    assert offers, found.stderr
    assert all(o["geolocation"][-2:] in {"SE", "DE", "NL", "PL", "CZ", "FI", "FR", "IT", "ES", "BE"} for o in offers)
    assert all(o["reliability"] > 0.98 and o["direct_port_count"] >= 2 for o in offers)
    assert [o["dph_total"] for o in offers] == sorted(o["dph_total"] for o in offers)
    # the offers that fail one filter each are not there
    assert not any(o["inet_down_cost"] > 0.05 or o["cuda_max_good"] < 12.8 for o in offers)

    key = vastai(vastai_bin, vastai_env, cloud, "create", "ssh-key", ssh_keypair[1])
    assert key.returncode == 0 and "success" in key.stdout, key.stderr

    created = vastai(
        vastai_bin,
        vastai_env,
        cloud,
        "create",
        "instance",
        str(offers[0]["id"]),
        "--image",
        "fleet/llama-server:test",
        "--disk",
        "20",
        "--env",
        "-e MODE=test -p 22:22 -p 8080:8080",
        "--label",
        "fleet:cli",
        "--ssh",
        "--direct",
        "--raw",
    )
    assert created.returncode == 0, created.stderr
    instance_id = json.loads(created.stdout)["new_contract"]

    deadline = time.monotonic() + 30
    row = None
    while True:
        time.sleep(SHOW_INTERVAL_S)
        shown = vastai(vastai_bin, vastai_env, cloud, "show", "instance", str(instance_id), "--raw")
        assert shown.returncode == 0, shown.stderr
        row = json.loads(shown.stdout) if shown.stdout.strip().startswith("{") else None  # not yet visible
        if (row and row.get("actual_status") == "running") or time.monotonic() > deadline:
            break
    assert row and row["actual_status"] == "running" and row["label"] == "fleet:cli"
    assert dict(row["extra_env"])["MODE"] == "test"  # the SDK turned the pairs into a dict

    time.sleep(1.1)
    listed = vastai(vastai_bin, vastai_env, cloud, "show", "instances", "--raw")
    assert instance_id in [i["id"] for i in json.loads(listed.stdout)]
    time.sleep(SHOW_INTERVAL_S)
    url = vastai(vastai_bin, vastai_env, cloud, "ssh-url", str(instance_id))
    direct = int(row["ports"]["22/tcp"][0]["HostPort"])
    assert url.stdout.strip() == f"ssh://root@127.0.0.1:{direct}"  # the -p 22:22 mapping, on the public IP
    assert asyncio.run(ssh_echo(url.stdout.strip(), ssh_keypair[0])) == "hello"

    token = cloud.state()["instances"][str(instance_id)]["token"]
    time.sleep(SHOW_INTERVAL_S)
    destroyed = vastai(vastai_bin, vastai_env, cloud, "destroy", "instance", str(instance_id), "-y")
    assert destroyed.returncode == 0, destroyed.stderr
    time.sleep(SHOW_INTERVAL_S)
    gone = vastai(vastai_bin, vastai_env, cloud, "show", "instance", str(instance_id))
    assert gone.returncode in (0, 1), gone.stderr  # the CLI reads each form vast.ai answers after a destroy
    assert "not found" in gone.stderr or "destroyed" in gone.stdout, gone.stdout + gone.stderr
    assert host_processes(cloud.info.state_dir, instance_id, token) == []


async def ssh_echo(url: str, key) -> str:
    """Connect where an ssh-url points, with the account's key; retried while the platform installs it."""
    parts = urlparse(url)
    deadline = time.monotonic() + 15
    while True:
        try:
            async with asyncssh.connect(
                parts.hostname, port=parts.port, username=parts.username, client_keys=[str(key)], known_hosts=None
            ) as conn:
                return (await conn.run("echo hello", check=True)).stdout.strip()
        except (asyncssh.PermissionDenied, OSError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def show(vastai_bin, env, cloud, instance_id: int) -> dict | None:
    time.sleep(SHOW_INTERVAL_S)
    shown = vastai(vastai_bin, env, cloud, "show", "instance", str(instance_id), "--raw")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout) if shown.stdout.strip().startswith("{") else None


def wait_for(vastai_bin, env, cloud, instance_id: int, status: str, within_s: float = 40) -> dict:
    deadline = time.monotonic() + within_s
    while True:
        row = show(vastai_bin, env, cloud, instance_id)
        # during vast.ai's read lag the CLI prints the 404 answer (an object without a status)
        if row and row.get("actual_status") == status:
            return row
        assert time.monotonic() < deadline, row and (row.get("actual_status"), row.get("status_msg"))


async def ssh_run(port: int, key, command: str) -> str:
    deadline = time.monotonic() + 15
    while True:
        try:
            async with asyncssh.connect(
                "127.0.0.1", port=port, username="root", client_keys=[str(key)], known_hosts=None
            ) as conn:
                return (await conn.run(command, check=True)).stdout.strip()
        except (asyncssh.PermissionDenied, OSError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def test_vastai_cli_stop_keeps_the_disk_and_bills_it_start_boots_again(cloud, vastai_bin, vastai_env, ssh_keypair):
    found = vastai(vastai_bin, vastai_env, cloud, "search", "offers", "direct_port_count >= 2", "-o", "dph", "--raw")
    offer = json.loads(found.stdout)[0]
    assert vastai(vastai_bin, vastai_env, cloud, "create", "ssh-key", ssh_keypair[1]).returncode == 0
    time.sleep(1.1)
    created = vastai(
        vastai_bin, vastai_env, cloud, "create", "instance", str(offer["id"]), "--image", "fleet/llama-server:test",
        "--disk", "20", "--env", "-p 22:22", "--ssh", "--direct", "--raw",
        "--onstart-cmd", 'date >> "$HOME/onstart-runs"',
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    instance_id = json.loads(created.stdout)["new_contract"]
    running = wait_for(vastai_bin, vastai_env, cloud, instance_id, "running")
    port = int(running["ports"]["22/tcp"][0]["HostPort"])
    # (the host's root is $HOME here: the local cloud's hosts share this machine's filesystem)
    asyncio.run(ssh_run(port, ssh_keypair[0], 'echo weights > "$HOME/kept"'))
    token = cloud.state()["instances"][str(instance_id)]["token"]
    try:
        stopped = vastai(vastai_bin, vastai_env, cloud, "stop", "instance", str(instance_id))
        assert stopped.returncode == 0 and f"stopping instance {instance_id}" in stopped.stdout, stopped.stderr
        row = wait_for(vastai_bin, vastai_env, cloud, instance_id, "exited")  # how vast.ai shows a stop
        assert (row["intended_status"], row["cur_state"], row["ports"]) == ("stopped", "stopped", None)
        assert host_processes(cloud.info.state_dir, instance_id, token) == []  # nothing runs, nothing answers
        kinds = [c for c in cloud.state()["charges"] if c["instance_id"] == instance_id]
        # the disk while it loaded, its traffic, the GPU while it ran, the disk alone again now
        assert [(c["kind"], c["end"] is None) for c in kinds] == [
            ("storage", False),
            ("bandwidth", True),
            ("gpu", False),
            ("storage", True),
        ]
        assert 0 < kinds[3]["dph_total"] < row["dph_total"]  # the disk alone keeps billing

        # another renter takes the GPU meanwhile: the start waits in scheduling until it is free again
        cloud.set_faults({"gpu_taken": [offer["machine_id"]]})
        time.sleep(1.1)
        started = vastai(vastai_bin, vastai_env, cloud, "start", "instance", str(instance_id))
        assert started.returncode == 0 and f"starting instance {instance_id}" in started.stdout, started.stderr
        waiting = wait_for(vastai_bin, vastai_env, cloud, instance_id, "scheduling")
        assert "waiting for the machine's GPU" in waiting["status_msg"]
        assert show(vastai_bin, vastai_env, cloud, instance_id).get("actual_status") == "scheduling"
        cloud.set_faults({})
        again = wait_for(vastai_bin, vastai_env, cloud, instance_id, "running")
        new_port = int(again["ports"]["22/tcp"][0]["HostPort"])
        assert new_port != port  # a restarted container is mapped anew
        # the disk was kept, and the platform's init ran onstart again
        assert asyncio.run(ssh_run(new_port, ssh_keypair[0], 'cat "$HOME/kept"; wc -l < "$HOME/onstart-runs"')) == (
            "weights\n2"
        )
    finally:
        cloud.set_faults({})
        time.sleep(SHOW_INTERVAL_S)
        vastai(vastai_bin, vastai_env, cloud, "destroy", "instance", str(instance_id), "-y")
    assert host_processes(cloud.info.state_dir, instance_id, token) == []
