"""A process's leases outlive a database that stays busy past its timeout: the renewal tries again rather
than dying, so a long bring-up is never taken for an interrupted one (found in the full suite under a CPU
hog: a reconcile failed two hosts "bring-up interrupted in probing" while their `fleet up` ran). And another
process's housekeeping (or another Context's in the same process, as the daemon's jobs) leaves a host alone
while it is held: a reconcile leaves a bring-up in flight and a
draining host to the processes holding them, a failure judged on a stale view is refused, and a claim hands
back the host as it is."""

import asyncio
import json
import os
import sqlite3
import subprocess
import sys

import pytest

from fleet.context import Leases
from fleet.control import rotation
from fleet.control.up import UpRequest
from fleet.core.models import HostState
from fleet.core.record import BUSY_TIMEOUT_MS, Record, open_database
from fleet.engines.metrics import requests_in_flight
from fleet.host import teardown
from tests.control.test_rotation import host
from tests.fleetkit import fleet_for, settings_for, write_config
from tests.helpers import listed_instances


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


def test_a_lease_is_renewed_after_the_database_was_busy_past_its_timeout(tmp_path):
    path = tmp_path / "fleet.db"
    record = Record(open_database(path))
    held = record.add(host(name="h1", label="fleet:h1"))
    lease_s = 3.0  # the least fleet.toml allows: a renewal every second

    async def run() -> tuple[float, float]:
        leases = Leases(record, lease_s, "me/1/1")
        assert leases.claim(held)
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")  # another process writing, longer than the busy timeout
        await asyncio.sleep(BUSY_TIMEOUT_MS / 1000 + 2)  # a renewal waits its timeout in vain meanwhile
        blocker.execute("COMMIT")
        blocker.close()
        after_release = record.host(held.id).lease_until
        await asyncio.sleep(lease_s)  # a live renewal task renews within a lease
        renewed = record.host(held.id).lease_until
        leases.close()
        return after_release.timestamp(), renewed.timestamp()

    after_release, renewed = asyncio.run(run())
    assert renewed > after_release


def cli(tmp_path, cloud, *args: str, extra_toml: str = "") -> subprocess.CompletedProcess:
    """`fleet ...` as another process on the same database (write_config points at tmp_path/fleet.db)."""
    env = {
        **os.environ,
        "FLEET_CONFIG": str(write_config(tmp_path, extra_toml)),
        "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir),
    }
    return subprocess.run(
        [sys.executable, "-m", "fleet.cli", *args], env=env, capture_output=True, text=True, timeout=180
    )


async def wait_state(fleet, name_or_none, states, timeout_s=60.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        hosts = [h for h in fleet.record.hosts() if name_or_none in (None, h.name)]
        if hosts and hosts[-1].state in states:
            return hosts[-1]
        assert asyncio.get_running_loop().time() < deadline, [(h.name, h.state) for h in hosts]
        await asyncio.sleep(0.05)


async def test_reconcile_in_another_process_leaves_a_bring_up_in_flight_alone(cloud, tmp_path):
    """A reconcile in another process used to destroy a bring-up in flight as a stray: it leaves it alone."""
    async with fleet_for(settings_for(tmp_path)) as fleet:
        up = asyncio.create_task(fleet.up(UpRequest("tiny", "eu")))
        await wait_state(fleet, None, (HostState.CONNECTING, HostState.PULLING, HostState.STARTING))
        reconciled = await asyncio.to_thread(cli, tmp_path, cloud, "reconcile", "--json")
        assert reconciled.returncode == 0, reconciled.stderr
        result = await up
        assert len(result.ready) == 1 and [a.outcome for a in result.attempts] == ["ready"]
        assert fleet.record.blacklist() == []
        await fleet.destroy(None)


async def test_a_reconcile_in_the_same_process_leaves_a_bring_up_in_flight_alone(cloud, tmp_path):
    """The daemon runs its jobs side by side in one process: its reconcile, every few seconds, used to take the
    host its reprice or health job was bringing up as its own (one owner a process) and fail it "bring-up
    interrupted" (CI saw it in the race test). Each Context is an owner of its own now."""
    async with fleet_for(settings_for(tmp_path)) as fleet, fleet_for(settings_for(tmp_path)) as beside:
        assert fleet.owner != beside.owner
        up = asyncio.create_task(fleet.up(UpRequest("tiny", "eu")))
        await wait_state(fleet, None, (HostState.CONNECTING, HostState.PULLING, HostState.STARTING))
        report = await beside.reconcile()
        assert report["failed"] == [] and len(report["busy"]) == 1, report
        result = await up
        assert len(result.ready) == 1 and [a.outcome for a in result.attempts] == ["ready"]
        assert report["busy"] == [result.ready[0].name]
        # once the bring-up let go of it, the other Context may take it: a destroy from there ends it
        ended = await beside.destroy([result.ready[0].name])
        assert [h.name for h in ended.done] == report["busy"]


async def test_a_failure_judged_on_a_stale_view_leaves_a_host_that_moved_on_serving(cloud, tmp_path):
    """A process that read a host while it was being probed (a reconcile that took it as interrupted, a
    bring-up preempted) and fails it after another process made it READY: the compare-and-set is against the
    state it saw, so the failure is refused, and the host goes on serving with its instance and its machine
    untouched (CI once saw a served host destroyed as "bring-up interrupted in probing")."""
    async with fleet_for(settings_for(tmp_path)) as fleet:
        host = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        stale = fleet.record.hosts(names=[host.name])[0]
        stale.state = HostState.PROBING  # what the other process read before the bring-up finished
        await teardown.fail(fleet, stale, "probing", "bring-up interrupted in probing", blacklist=False)
        now = fleet.record.hosts(names=[host.name])[0]
        assert (now.state, now.destroyed_at, now.failure_reason) == (HostState.READY, None, None)
        assert fleet.record.blacklist() == []
        async with cloud.client() as api:
            assert host.instance_id in [i["id"] for i in await listed_instances(api)]
        async with fleet.server(now).client(timeout=30) as client:
            assert (await client.get("/health")).status_code == 200
        refused = [e for e in fleet.record.events(host.id) if e.action == "fail_refused"]
        assert len(refused) == 1 and json.loads(refused[0].detail)["now"] == "ready"
        # the same failure on what the host is now is applied: it is failed and its instance destroyed
        await teardown.fail(fleet, now, "health", "gone quiet", blacklist=False)
        assert fleet.record.hosts(names=[host.name])[0].state == HostState.FAILED
        async with cloud.client() as api:
            assert host.instance_id not in [i["id"] for i in await listed_instances(api)]


async def test_a_claim_hands_back_the_host_as_it_is_not_as_it_was_read(cloud, tmp_path):
    """How the reconcile above came to fail a served host: it read every open host at once, the bring-up made one
    READY and let go of it, and the reconcile's claim then succeeded on a view still saying PROBING. A claim now
    reads the host again, so what its taker judges is the host as it is; a host closed meanwhile is seen closed."""
    async with fleet_for(settings_for(tmp_path)) as fleet:
        host = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        stale = fleet.record.hosts(names=[host.name])[0]
        stale.state, stale.ready_at = HostState.PROBING, None  # what a reconcile read before the bring-up ended
        assert fleet.leases.claim(stale)
        assert (stale.state, stale.ready_at is not None) == (HostState.READY, True)
        fleet.leases.release(stale)
        reconciled = await asyncio.to_thread(cli, tmp_path, cloud, "reconcile", "--json")
        assert reconciled.returncode == 0, reconciled.stderr
        assert json.loads(reconciled.stdout)["failed"] == []
        old_view = fleet.record.hosts(names=[host.name])[0]
        await fleet.destroy([host.name])
        assert fleet.leases.claim(old_view) and old_view.destroyed_at is not None
        fleet.leases.release(old_view)


async def test_reconcile_leaves_a_draining_host_to_the_process_draining_it(cloud, tmp_path):
    """A reconcile in another process used to destroy a draining host under the call it was draining."""
    settings = settings_for(tmp_path, rotation={"drain_timeout_s": 20})
    async with fleet_for(settings) as fleet:
        host = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 3000, "ignore_eos": True}
        async with fleet.server(host).client(timeout=60) as client:
            call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            # the call in flight by the server's own count, as the drain reads it (a fixed 0.5 s once let a busy
            # machine's drain find none and destroy the host at once)
            while requests_in_flight((await client.get("/metrics")).text) != 1:
                assert not call.done(), call.result()
                await asyncio.sleep(0.05)
            retiring = asyncio.create_task(rotation.retire(fleet, host, "test", blacklist=False))
            await wait_state(fleet, host.name, (HostState.DRAINING,))
            reconciled = await asyncio.to_thread(cli, tmp_path, cloud, "reconcile", "--json")
            assert reconciled.returncode == 0, reconciled.stderr
            assert host.name not in json.loads(reconciled.stdout)["failed"]
            reply = await call
        assert reply.status_code == 200  # the live call finished: nothing cut it
        await retiring
        assert fleet.record.hosts(names=[host.name])[0].state == HostState.DESTROYED
        assert fleet.record.blacklist() == []
