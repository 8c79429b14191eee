"""A rented host's SSH host key: the host makes it, announces its public half on its console, and fleet pins what
the instance's logs say before it first connects. The create call carries no key (vast.ai shows its onstart to
every reader of the instance); logs that announce two keys, or none, bring no connection."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from fleet.control.up import UpRequest
from fleet.host import hostkey
from fleet.host.remote import connect
from tests.fleetkit import first_machine, fleet_for, settings_for
from tests.helpers import cheapest_offer, destroy, polite, rent, shown, wait_status


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


async def test_the_first_ssh_connection_is_pinned_to_the_key_the_host_announced_in_its_logs(cloud, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        try:
            directory = cloud.info.state_dir / "hosts" / str(host.instance_id)
            etc = directory / "etc"
            # the platform made its own key at boot; the host's own, made by its onstart, replaced it
            assert (etc / "ssh_host_ed25519_key.pub").read_text().strip() == host.host_key
            console = (directory / "log" / "console.log").read_text()
            assert console.splitlines() == [f"fleet-host-key: {host.host_key}"]
            # and it asked vast.ai's SSH runtype for no tmux around fleet's SSH sessions (SkyPilot's onstart too)
            assert (directory / "root" / ".no_auto_tmux").exists()
            conn, presented = await connect(host.ssh_host, host.ssh_port, fleet.ssh_key, host.host_key, 30)
            conn.close()
            assert presented == host.host_key
            # what the marketplace shows every reader of the instance holds no key at all
            async with cloud.client() as api:
                read = await shown(api, host.instance_id)
            assert read is not None and read["onstart"] == hostkey.onstart()
            assert "PRIVATE KEY" not in str(read) and host.host_key.split()[1] not in str(read)
            # the private half never left the host: in no file of fleet's, in none of the local cloud's but
            # the host's own key folder
            body = (etc / "ssh_host_ed25519_key").read_text().splitlines()[2:4]  # past the header every key shares
            for path in [*tmp_path.rglob("*"), *cloud.info.state_dir.rglob("*")]:
                if path.is_file() and etc not in path.parents:
                    assert not any(line.encode() in path.read_bytes() for line in body), path
        finally:
            await fleet.destroy(None)


@contextlib.asynccontextmanager
async def refused_at_connect(cloud, tmp_path, fault: str, **sections):
    """`fleet up` with `fault` on the machine it would rent first: that machine fails at connect and the next
    serves. Yields the fleet, the machine and its failed attempt; destroys everything after."""
    settings = settings_for(tmp_path, **sections)
    machine = await first_machine(settings)
    cloud.set_faults({fault: [machine]})
    try:
        async with fleet_for(settings) as fleet:
            result = await fleet.up(UpRequest("tiny", "eu"))
            try:
                failed, ready = result.attempts
                assert (failed.machine_id, failed.phase) == (machine, "connect"), failed
                assert ready.outcome == "ready" and ready.machine_id != machine
                yield fleet, machine, failed
            finally:
                await fleet.destroy(None)
    finally:
        cloud.set_faults({})


async def test_a_host_that_answers_ssh_with_another_key_at_first_contact_is_refused(cloud, tmp_path):
    # someone else answers its SSH from the start
    async with refused_at_connect(cloud, tmp_path, "foreign_host_key", timeouts={"ssh": 20}) as (
        fleet,
        machine,
        failed,
    ):
        assert "a host key other than the pinned one" in failed.reason
        assert [b.machine_id for b in fleet.record.blacklist()] == [machine]


async def test_logs_that_announce_two_keys_bring_no_connection_and_blame_the_machine(cloud, tmp_path):
    """Another key is announced on the host's console before the host's own. fleet reads both and pins neither,
    or, reading between the two lines, pins the other one and the host's sshd never presents it: either way no
    connection is made and the machine is blamed."""
    async with refused_at_connect(cloud, tmp_path, "forged_host_key", timeouts={"ssh": 15}) as (fleet, machine, failed):
        assert (
            "announce 2 different SSH host keys" in failed.reason
            or "a host key other than the pinned one" in failed.reason
        ), failed.reason
        [refused] = [h for h in fleet.record.hosts() if h.machine_id == machine]
        assert refused.connected_at is None
        assert [b.machine_id for b in fleet.record.blacklist()] == [machine]


async def test_logs_that_never_announce_a_key_fail_the_host_and_blame_no_machine(cloud, tmp_path):
    # its logs hold the platform's lines alone
    async with refused_at_connect(cloud, tmp_path, "logs_without_console", timeouts={"host_key": 6}) as (
        fleet,
        _,
        failed,
    ):
        assert "announced no SSH host key within 6s" in failed.reason, failed.reason
        assert "timeouts.host_key" in failed.reason
        assert fleet.record.blacklist() == []  # the marketplace's logs may be at fault as much


@pytest.mark.parametrize(
    ("log", "keys"),
    [
        ("Starting sshd\nfleet-host-key: {a}\n", ["{a}"]),
        ("fleet-host-key: {a}\nfleet-host-key: {a}\n", ["{a}"]),  # announced again at a restart: one key
        ("fleet-host-key: {a}\nfleet-host-key: {b}\n", ["{a}", "{b}"]),
        ("2026-12-06T20:00:00Z fleet-host-key: {a}\n", ["{a}"]),  # a prefix the platform may add
        ("fleet-host-key: {a} trailing words\n", []),
        ("fleet-host-key: ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC0\n", []),
        ("fleet-host-key: ssh-ed25519 AAAAnot-base64!!\n", []),
        ("fleet-host-key: ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA\n", []),  # cut short
        ("xfleet-host-key: {a}\n", []),
    ],
)
def test_only_whole_ed25519_keys_announced_on_their_own_line_are_read(log, keys):
    import asyncssh

    a, b = (asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip() for _ in range(2))
    assert hostkey.announced(log.format(a=a, b=b)) == [k.format(a=a, b=b) for k in keys]


async def test_the_logs_are_the_consoles_last_lines_as_they_were_when_asked(cloud, api):
    """The local cloud's request_logs as vast-cli's `logs` reads it: a URL that answers 404 at first, then the
    platform's lines and the container's console (its PID 1's output), the last `tail` of them, as they were
    when asked for. What onstart prints goes to its own file, never to the logs."""
    offer = await cheapest_offer(api)
    onstart = 'echo "onstart says"; for i in 1 2 3 4 5; do echo "console $i" >> "$FLEET_CONSOLE"; done'
    instance_id = await rent(api, offer["id"], onstart=onstart)
    console = cloud.info.state_dir / "hosts" / str(instance_id) / "log" / "console.log"
    try:
        await wait_status(api, instance_id, "running")
        for _ in range(100):
            if console.exists() and console.read_text().count("\n") == 5:
                break
            await asyncio.sleep(0.1)

        async def logs(tail: str) -> httpx.Response:
            r = await polite(api, "PUT", f"/api/v0/instances/request_logs/{instance_id}/", json={"tail": tail})
            assert r.status_code == 200 and r.json()["success"] is True, r.text
            return r

        url = (await logs("3")).json()["result_url"]
        with console.open("a") as f:
            f.write("console 6\n")  # after the request: not in what it answers
        async with httpx.AsyncClient() as anonymous:  # another server's URL, read without the key
            for _ in range(50):  # 404 for a moment (as long as a busy machine takes to ask twice, not asserted)
                if (answer := await anonymous.get(url)).status_code == 200:
                    break
                await asyncio.sleep(0.1)
            assert answer.text.splitlines() == ["console 3", "console 4", "console 5"]
            url = (await logs("1000")).json()["result_url"]
            await asyncio.sleep(1.1)
            whole = (await anonymous.get(url)).text.splitlines()
        assert whole[0].startswith(f"Starting container {instance_id}") and whole[-1] == "console 6"
        assert "onstart says" not in whole and len(whole) == 8
    finally:
        await destroy(api, instance_id)
