"""A rented local host is a real machine: sshd with the account key, the image's host scripts,
aria2c pulling from the hub, llama-server answering; destroy leaves nothing running."""

import asyncio
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path

import asyncssh
import httpx
import pytest

from fleet.localcloud import network, procs
from fleet.localcloud.cloud import Cloud
from fleet.localcloud.hosts import LocalHost, port_open
from fleet.localcloud.server import DEFAULT_OFFERS_DIR
from fleet.localcloud.state import CloudSettings
from tests.helpers import (
    SERVICE_PORT,
    TINY_REPO,
    cheapest_offer,
    destroy,
    host_processes,
    mapped,
    processes_mentioning,
    rent,
    wait_health,
    wait_status,
)

KIND_CLOUD = (
    "drives hosts through raw API calls to test what runs on them; late SSH keys, read lag and rate limits "
    "are shown in tests/localcloud/test_vast_fidelity.py"
)


async def hub_file(cloud, filename: str) -> tuple[str, str, int]:
    """(url, sha256, size) as a client learns them from the hub's first answer."""
    url = f"{cloud.url}/{TINY_REPO}/resolve/main/{filename}"
    async with httpx.AsyncClient() as client:
        r = await client.head(url)
    assert r.status_code == 302
    return url, r.headers["X-Linked-Etag"].strip('"'), int(r.headers["X-Linked-Size"])


@pytest.fixture
async def host(cloud, api, ssh_keypair):
    await api.post("/api/v0/ssh/", json={"ssh_key": ssh_keypair[1]})
    offer = await cheapest_offer(api)
    onstart = 'echo booted > onstart.txt; echo "$MODE $VAST_TCP_PORT_18080" > onstart-env.txt; sleep 600 &'
    instance_id = await rent(api, offer["id"], onstart=onstart, env={"MODE": "test", "-p 18080:18080": "1"})
    row = await wait_status(api, instance_id, "running")
    token = cloud.state()["instances"][str(instance_id)]["token"]
    yield {"id": instance_id, "row": row, "token": token}
    await destroy(api, instance_id)


async def connect(row, key_path: Path, proxy: bool = False) -> asyncssh.SSHClientConnection:
    """SSH as vast.ai offers it: the direct mapping of port 22 on the public IP, or the proxy."""
    host, port = (row["ssh_host"], row["ssh_port"]) if proxy else mapped(row, 22)
    return await asyncssh.connect(host, port=port, username="root", client_keys=[str(key_path)], known_hosts=None)


async def test_host_runs_sshd_with_the_account_key_direct_and_through_the_proxy(cloud, host, ssh_keypair):
    for proxy in (False, True):
        async with await connect(host["row"], ssh_keypair[0], proxy=proxy) as conn:
            presented = conn.get_server_host_key().export_public_key().decode().split()[1]
            r = await conn.run(
                'echo "[$MODE][$VAST_TCP_PORT_18080]"; which llama-server aria2c fleet-pull fleet-serve; '
                "cat onstart.txt onstart-env.txt",
                check=True,
            )
        on_disk = (cloud.info.state_dir / "hosts" / str(host["id"]) / "etc/ssh_host_ed25519_key.pub").read_text()
        assert presented == on_disk.split()[1]  # host keys made by the platform at first start
        lines = r.stdout.splitlines()
        assert lines[0] == "[][]"  # the create call's env is not in an SSH session (vast.ai's docs) ...
        assert [Path(p).name for p in lines[1:5]] == ["llama-server", "aria2c", "fleet-pull", "fleet-serve"]
        assert lines[5] == "booted"
        assert lines[6] == f"test {mapped(host['row'], SERVICE_PORT)[1]}"  # ... but onstart has it
    # the host's own address is nowhere in what the API says
    private_ip = cloud.state()["instances"][str(host["id"])]["private_ip"]
    assert private_ip not in json.dumps(host["row"])


async def test_host_refuses_an_unknown_key(host, tmp_path):
    other = asyncssh.generate_private_key("ssh-ed25519")
    other.write_private_key(str(tmp_path / "other"))
    with pytest.raises(asyncssh.PermissionDenied):
        await connect(host["row"], tmp_path / "other")


async def test_pull_serve_and_chat_then_destroy_leaves_nothing(cloud, api, host, ssh_keypair):
    url, sha, size = await hub_file(cloud, "tiny-llama-bytes.gguf")
    public_ip, port = mapped(host["row"], SERVICE_PORT)
    api_key = secrets.token_hex(16)
    async with await connect(host["row"], ssh_keypair[0]) as conn:
        pulled = await conn.run(shlex.join(["fleet-pull", url, sha, "models/tiny.gguf", "4"]))
        assert pulled.exit_status == 0, pulled.stderr
        assert pulled.stdout.strip().splitlines()[-1] == f"ok {sha} {size}"
        served = await conn.run(
            shlex.join(
                [
                    "fleet-serve",
                    "run",
                    "--",
                    "-m",
                    "models/tiny.gguf",
                    "--port",
                    str(SERVICE_PORT),
                    "-np",
                    "1",
                    "-c",
                    "2048",
                    "-t",
                    "1",
                    "-a",
                    "tiny",
                ]
            ),
            input=api_key + "\n",
        )
        assert served.exit_status == 0, served.stderr
        ps = await conn.run("ps -eo args", check=True)
        assert api_key not in ps.stdout  # the key is in a file, never on a command line

    base = f"http://{public_ip}:{port}"  # through the mapping: the server listens on the host's own address
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        await wait_health(client)
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
        r = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"})
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"]
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 401
    with pytest.raises(httpx.TransportError):  # the internal port is not open on the public address
        async with httpx.AsyncClient(timeout=2) as client:
            await client.get(f"http://{public_ip}:{SERVICE_PORT}/health")

    assert len(procs.pids_with_marker(host["token"])) >= 2  # at least the onstart sleep and llama-server
    await destroy(api, host["id"])
    assert host_processes(cloud.info.state_dir, host["id"], host["token"]) == []
    assert not (cloud.info.state_dir / "hosts" / str(host["id"])).exists()
    with pytest.raises(httpx.TransportError):
        async with httpx.AsyncClient(timeout=2) as client:
            await client.get(f"{base}/health")


async def test_fleet_pull_rejects_a_wrong_checksum(cloud, host, ssh_keypair):
    url, _sha, _ = await hub_file(cloud, "tiny-llama-bytes.gguf")
    async with await connect(host["row"], ssh_keypair[0]) as conn:
        r = await conn.run(shlex.join(["fleet-pull", url, "0" * 64, "models/bad.gguf"]))
        assert r.exit_status == 3
        assert "sha256 mismatch" in r.stderr
        assert (await conn.run("test -e models/bad.gguf")).exit_status == 1


def test_a_host_gets_the_machines_ssh_keygen_and_openssl_where_the_system_path_has_none(tmp_path, monkeypatch):
    """The image ships ssh-keygen and openssl (fleet-host-key and fleet-tls call them). A machine that keeps
    its own off the system's PATH (the GPU bench carries OpenSSH in a folder of its own) still gives them to
    its hosts: found on this process's PATH, the host runs them from its own bin/."""
    from fleet.localcloud.hosts import LocalHost

    carried = tmp_path / "carried"
    carried.mkdir()
    ran = tmp_path / "ran"
    for program, real in (("ssh-keygen", "/usr/bin/ssh-keygen"), ("openssl", "/usr/bin/openssl")):
        wrapper = carried / program
        wrapper.write_text(f'#!/bin/sh\necho {program} >> {ran}\nexec {real} "$@"\n')
        wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{carried}:{os.environ['PATH']}")
    host = LocalHost(tmp_path / "host", "token", "127.0.0.1", 22, None)
    host.prepare()
    key = tmp_path / "key"
    script = f"ssh-keygen -q -t ed25519 -N '' -f {key} && openssl version"
    done = subprocess.run(["/bin/sh", "-c", script], env=host.base_env(), capture_output=True)
    assert done.returncode == 0, done.stderr
    assert ran.read_text().split() == ["ssh-keygen", "openssl"]
    assert key.exists()


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_ending_a_host_waits_for_a_child_that_outlives_its_parent(tmp_path):
    # The child takes its time to end on SIGTERM, and its parent dies at once: from then on it is below no
    # root, and it carries no marker (as sshd's children do not), yet it is still one of the host's.
    child_pid = tmp_path / "child.pid"
    script = (
        "sh -c 'trap \"sleep 2; exit 0\" TERM; while :; do sleep 0.1; done' & "
        f"echo $! > {shlex.quote(str(child_pid))}; wait"
    )
    parent = subprocess.Popen(["sh", "-c", script], env={"PATH": os.environ["PATH"]}, start_new_session=True)
    while not child_pid.exists() or not child_pid.read_text().strip():
        assert parent.poll() is None
        time.sleep(0.01)
    child = int(child_pid.read_text())
    found = procs.end_host_processes(secrets.token_hex(8), [parent.pid])
    assert found >= 2  # the parent, the child, and the sleep its trap started
    assert not _running(child)
    assert parent.poll() is not None


def _process_at(pid: int, argv: list[str]) -> subprocess.Popen:
    """Start `argv` as the process with this PID (the kernel's next PID set through ns_last_pid, as CRIU does;
    other processes of the machine may take it first, so it tries again)."""
    for _ in range(200):
        try:
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        except OSError as e:  # not root, or /proc/sys mounted read-only (a container's default)
            pytest.skip(f"the next PID cannot be set here ({e.strerror}): scripts/test runs as root")
        process = subprocess.Popen(argv, start_new_session=True)
        if process.pid == pid:
            return process
        process.kill()
        process.wait()
    raise AssertionError(f"PID {pid} could not be taken")


def test_ending_a_host_never_signals_the_process_that_took_a_pid_its_onstart_left(tmp_path):
    """Found failing the suite: a host keeps the PIDs it spawned (sshd, the onstart script) to end their trees.
    An onstart that has ended is reaped and its PID is free, soon another's (PIDs wrap at 32,768, and a suite
    forks ~100k times); ending the host then sent that stranger, and all below it, SIGTERM."""
    host = LocalHost(
        directory=tmp_path / "host", token=secrets.token_hex(8), private_ip="127.0.0.1", ssh_port=0, llama_server=None
    )
    host.prepare()
    onstart = host.run_onstart("exit 0", {})
    while _running(onstart):
        time.sleep(0.01)
    subprocess.run(["true"], check=True)  # the next child this process starts reaps the ended one: its PID is free
    assert not Path(f"/proc/{onstart}").exists()
    stranger = _process_at(onstart, ["sleep", "600"])
    try:
        host.stop()
        assert stranger.poll() is None, "ending the host signalled the process that holds its onstart's old PID"
    finally:
        stranger.kill()
        stranger.wait()


async def test_a_port_taken_while_the_container_loads_is_mapped_anew(cloud, api, ssh_keypair):
    # create picks the external ports free; any process may bind one before the container runs (an outgoing
    # connection's local port among them). The instance must still run, on ports that are free then.
    await api.post("/api/v0/ssh/", json={"ssh_key": ssh_keypair[1]})
    offer = await cheapest_offer(api)
    seconds = 4.0  # of the image's pull, at the offer's link and the cloud's clock: time to take its ports
    image = "fleet/port-taken:test"
    size = int(seconds / 0.01 * offer["inet_down"] * 1e6 / 8)
    cloud.set_faults({"image_sizes": {image: size}})
    held: list[socket.socket] = []
    try:
        onstart = f'echo "$VAST_TCP_PORT_{SERVICE_PORT}" > onstart-env.txt'
        # the disk holds the image too
        instance_id = await rent(api, offer["id"], image=image, onstart=onstart, disk=size / 1e9 + 10)
        deadline = time.monotonic() + 30
        while (inst := cloud.state()["instances"][str(instance_id)])["status"] != "loading":
            assert time.monotonic() < deadline, "the instance never started loading"
            await asyncio.sleep(0.05)
        taken = {(network.PUBLIC_HOST, port) for port in inst["ports"].values()} | {
            (network.PROXY_HOST, inst["ssh_port"])
        }
        for address in taken:
            s = socket.socket()
            s.bind(address)
            s.listen()
            held.append(s)
        row = await wait_status(api, instance_id, "running", timeout_s=60)
        assert row is not None, "the instance never ran"
        listed = {(network.PUBLIC_HOST, mapped(row, 22)[1]), (network.PUBLIC_HOST, mapped(row, SERVICE_PORT)[1])}
        listed.add((network.PROXY_HOST, row["ssh_port"]))
        assert not listed & taken
        conn = await connect(row, ssh_keypair[0])  # the new mapping reaches the container ...
        async with conn:
            told = await conn.run("for i in $(seq 100); do [ -s onstart-env.txt ] && break; sleep 0.1; done; "
                                  "cat onstart-env.txt", check=True)  # fmt: skip
        assert told.stdout.strip() == str(mapped(row, SERVICE_PORT)[1])  # ... and its environment names it
        await destroy(api, instance_id)
    finally:
        for s in held:
            s.close()
        cloud.set_faults({})


async def test_a_boot_that_fails_unforeseen_leaves_its_instance_exited_saying_why(cloud, api):
    # a boot step that raises what no step expects (here the host's folder taken by a file while the image
    # loads) must not leave the instance in `loading` for a client to wait out: it reads exited, with the error
    offer = await cheapest_offer(api)
    image = "fleet/boot-fails:test"
    size = int(3.0 / 0.01 * offer["inet_down"] * 1e6 / 8)
    cloud.set_faults({"image_sizes": {image: size}})
    taken = None
    try:
        instance_id = await rent(api, offer["id"], image=image, disk=size / 1e9 + 10)  # the disk holds the image
        deadline = time.monotonic() + 30
        while cloud.state()["instances"][str(instance_id)]["status"] != "loading":
            assert time.monotonic() < deadline, "the instance never started loading"
            await asyncio.sleep(0.05)
        taken = cloud.info.state_dir / "hosts" / str(instance_id)
        taken.parent.mkdir(parents=True, exist_ok=True)
        taken.write_text("not a folder\n")
        row = await wait_status(api, instance_id, "exited", timeout_s=60)
        assert row is not None and row["status_msg"].startswith("Error: ")
        assert "FileExistsError" in row["status_msg"] or "NotADirectoryError" in row["status_msg"]
        # the container exited: the ports mapped for it before the failing step no longer answer
        ports = cloud.state()["instances"][str(instance_id)]
        assert not port_open(network.PROXY_HOST, ports["ssh_port"])
        assert not any(port_open(network.PUBLIC_HOST, p) for p in ports["ports"].values())
        taken.unlink()
        taken = None
        await destroy(api, instance_id)
    finally:
        if taken is not None:
            taken.unlink(missing_ok=True)
        cloud.set_faults({})


async def test_the_accounts_environment_variables_reach_every_container(cloud, api):
    """vast.ai's account-level variables (`vastai create env-var`) go into every container the account rents
    (docs/vast-fidelity.md); an instance's own variables of the same name win."""
    created = await api.post("/api/v0/secrets/", json={"key": "team_secret", "value": "from-the-account"})
    assert created.status_code == 200
    try:
        listed = (await api.get("/api/v0/secrets/")).json()
        assert listed == {"secrets": {"TEAM_SECRET": "from-the-account"}}  # the name in upper case, as vast.ai
        offer = await cheapest_offer(api)
        onstart = 'echo "$TEAM_SECRET" > account-env.txt'
        instance_id = await rent(api, offer["id"], onstart=onstart)
        seen = cloud.info.state_dir / "hosts" / str(instance_id) / "root" / "account-env.txt"
        deadline = time.monotonic() + 60
        while not (seen.exists() and seen.read_text()):
            assert time.monotonic() < deadline, "onstart never wrote the variable"
            await asyncio.sleep(0.1)
        assert seen.read_text().strip() == "from-the-account"
        await destroy(api, instance_id)
    finally:
        assert (await api.request("DELETE", "/api/v0/secrets/", json={"key": "TEAM_SECRET"})).status_code == 200
    assert (await api.get("/api/v0/secrets/")).json() == {"secrets": {}}


def test_a_destroy_during_a_boot_step_ends_what_the_step_started(tmp_path, monkeypatch):
    """Found leaking an sshd: a destroy while a boot step ran in its thread (the host's keys being made, say)
    removed the host's folder and processes first; the step then went on and started sshd for an instance
    that no longer existed, which no destroy or shutdown ever ended. A destroy now waits out the step in
    flight, and the boot takes no step after it."""
    gate = tmp_path / "gate"
    slow = tmp_path / "bin"
    slow.mkdir()
    keygen = slow / "ssh-keygen"  # the machine's ssh-keygen, held at a gate the test opens (a slow disk's keygen)
    wait = f"touch {gate}.started\nwhile [ ! -e {gate}.open ]; do sleep 0.02; done"
    keygen.write_text(f'#!/bin/sh\n{wait}\nexec {shutil.which("ssh-keygen")} "$@"\n')
    keygen.chmod(0o755)
    monkeypatch.setenv("PATH", f"{slow}:{os.environ['PATH']}")

    async def run() -> None:
        settings = CloudSettings(state_dir=tmp_path / "cloud", offers_dir=DEFAULT_OFFERS_DIR, kind=True)
        cloud = Cloud(settings)
        body = {
            "image": "ghcr.io/fleet-voice/llama-server:test",
            "disk": 20,
            "label": "fleet-test",
            "runtype": "ssh_direct",
        }
        try:
            instance_id = cloud.create(cloud.offers[0]["id"], body)
            token = cloud.state.instances[instance_id].token
            host_dir = settings.state_dir / "hosts" / str(instance_id)
            while not Path(f"{gate}.started").exists():  # the boot is inside its sshd step, in a thread
                await asyncio.sleep(0.02)
            destroying = asyncio.create_task(cloud.destroy(instance_id))
            await asyncio.wait([destroying], timeout=1.0)
            # a destroy that returned left no step of the host running
            assert not destroying.done() or processes_mentioning(host_dir) == []
            Path(f"{gate}.open").touch()
            await destroying
            assert procs.pids_with_marker(token) == [] and processes_mentioning(host_dir) == []
            assert not host_dir.exists()
        finally:
            Path(f"{gate}.open").touch()
            await cloud.shutdown()
        assert processes_mentioning(settings.state_dir) == [], "the cloud left a host's processes running"

    asyncio.run(run())
