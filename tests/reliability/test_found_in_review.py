"""The faults found by reading the code (issue 10), each shown on real parts: our own housekeeping must
never hurt our own hosts, and nothing may keep billing after fleet lost track of it."""

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.control import rotation
from fleet.control.up import UpRequest
from fleet.core.config import Traffic
from fleet.core.models import HostState
from fleet.engines.metrics import requests_in_flight
from fleet.host import teardown
from tests.fleetkit import fleet_for, settings_for, with_variant, write_config
from tests.helpers import listed_instances, polite


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


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
    async with fleet_for(settings_for(tmp_path)) as fleet:
        up = asyncio.create_task(fleet.up(UpRequest("tiny", "eu")))
        await wait_state(fleet, None, (HostState.CONNECTING, HostState.PULLING, HostState.STARTING))
        reconciled = await asyncio.to_thread(cli, tmp_path, cloud, "reconcile", "--json")
        assert reconciled.returncode == 0, reconciled.stderr
        result = await up
        assert len(result.ready) == 1 and [a.outcome for a in result.attempts] == ["ready"]
        assert fleet.record.blacklist() == []
        await fleet.destroy(None)


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


async def test_a_destroy_that_fails_leaves_the_host_for_reconcile_to_finish(cloud, tmp_path):
    # three tries of each destroy (1.5 s of backoff), not the shipped minute: the fault outlasts any number
    settings = settings_for(tmp_path, up={"max_attempts": 1}, provider={"error_attempts": 3})
    settings = with_variant(settings, "tiny-broken", extra_args=["--no-such-flag"])
    async with fleet_for(settings) as fleet:
        # the server will not start, and every destroy answers 503 (beyond the client's retries)
        destroys = {"count": 1000, "status": 503, "paths": ["/api/v0/instances/"], "methods": ["DELETE"]}
        cloud.set_faults({"server_error": destroys})
        try:
            result = await fleet.up(UpRequest("tiny-broken", "eu"))
        finally:
            cloud.set_faults({})
        [attempt] = result.attempts
        assert result.ready == [] and attempt.phase == "start"
        host = fleet.record.hosts(names=[attempt.host])[0]
        async with cloud.client() as api:
            assert host.instance_id in [i["id"] for i in await listed_instances(api)]  # still billing
        assert host.destroyed_at is None  # and the record says so: billing is not closed without proof
        report = await fleet.reconcile()
        assert host.name in report["destroyed"]
        host = fleet.record.hosts(names=[attempt.host])[0]
        assert host.destroyed_at is not None and host.accrued_usd > 0
        async with cloud.client() as api:
            assert await listed_instances(api) == []


async def test_an_interrupted_up_destroys_every_siblings_instance_before_it_exits(cloud, tmp_path):
    """Ctrl-C in `fleet up --count 2`: each bring-up destroys what it created, all of them before the process
    closes its marketplace client (the siblings used to be left running after it closed)."""
    env = {
        **os.environ,
        "FLEET_CONFIG": str(write_config(tmp_path)),
        "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir),
    }
    # neither pull ever finishes: the interrupt lands mid bring-up however slow this machine is
    cloud.set_faults({"pull_stall": {"files": ["tiny-llama-bytes.gguf"], "count": 2}})
    up = subprocess.Popen(
        [sys.executable, "-m", "fleet.cli", "up", "--model", "tiny", "--region", "eu", "--count", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a user's Ctrl-C comes from a terminal where SIGINT is never ignored; a test worker may ignore it (its
        # children would inherit that, and Python keeps an inherited ignore): the up must hear the interrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    async with fleet_for(settings_for(tmp_path)) as fleet:
        try:
            deadline = asyncio.get_running_loop().time() + 90
            # both bring-ups under way: one has its instance, the other waits on vast.ai's create interval
            while len(hosts := fleet.record.hosts()) < 2 or not any(h.instance_id for h in hosts):
                assert asyncio.get_running_loop().time() < deadline and up.poll() is None, up.stderr
                await asyncio.sleep(0.05)
            ignored = int(Path(f"/proc/{up.pid}/status").read_text().split("SigIgn:")[1].split()[0], 16)
            assert not ignored & (1 << (signal.SIGINT - 1)), "the up ignores SIGINT: the interrupt would be lost"
            up.send_signal(signal.SIGINT)
            _, err = await asyncio.to_thread(up.communicate, timeout=120)
            assert up.returncode == 130, err
            assert "interrupted" in err
            hosts = fleet.record.hosts()
            assert len(hosts) == 2 and all(h.destroyed_at for h in hosts), [(h.name, h.state) for h in hosts]
        finally:
            cloud.set_faults({})
            await fleet.destroy(None)
    async with cloud.client() as api:
        assert await listed_instances(api) == []


async def test_drain_waits_for_the_call_in_flight_read_from_metrics(cloud, tmp_path):
    # every host serves /metrics and no /slots (which would hand each caller's transcript to any key holder):
    # a drain reads the requests in flight there, and waits for the one under way
    settings = settings_for(tmp_path, rotation={"drain_timeout_s": 120})
    async with fleet_for(settings) as fleet:
        host = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        try:
            async with fleet.server(host).client(timeout=120) as client:
                assert (await client.get("/slots")).status_code >= 400
                finished: list[float] = []

                async def long_call() -> None:
                    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000, "ignore_eos": True}
                    (await client.post("/v1/chat/completions", json=body)).raise_for_status()
                    finished.append(asyncio.get_running_loop().time())

                call = asyncio.create_task(long_call())
                while requests_in_flight((await client.get("/metrics")).text) != 1:
                    assert not call.done(), "the call ended before it was seen in flight"
                    await asyncio.sleep(0.02)
                await rotation.drain(fleet, host)
                drained = asyncio.get_running_loop().time()
                await call
            assert finished and finished[0] <= drained  # it waited for the call, and no longer than that
        finally:
            await fleet.destroy(None)


async def test_caps_hold_across_processes(cloud, tmp_path):
    write_config(tmp_path, caps={"max_hosts_total": 1})
    env = {
        **os.environ,
        "FLEET_CONFIG": str(tmp_path / "fleet.toml"),
        "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir),
    }
    argv = [sys.executable, "-m", "fleet.cli", "up", "--model", "tiny", "--region", "eu"]
    runs = [
        await asyncio.create_subprocess_exec(*argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    outcomes = [await r.communicate() for r in runs]
    codes = [r.returncode for r in runs]
    assert sorted(codes) == [0, 1, 1], outcomes
    assert all(b"caps.max_hosts_total = 1" in err for (_, err), code in zip(outcomes, codes, strict=True) if code)
    async with cloud.client() as api:
        assert len(await listed_instances(api)) == 1
    done = subprocess.run([*argv[:3], "destroy", "--all", "--yes"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


async def test_reprice_never_moves_a_host_to_a_dearer_offer(cloud, tmp_path):
    settings = settings_for(tmp_path)  # a profile whose traffic costs count: 50 GB/h each way
    heavy = settings.models["tiny"].model_copy(update={"traffic_gb_per_hour": Traffic(up=50, down=50)})
    settings = settings.model_copy(update={"models": {**settings.models, "tiny": heavy}})
    async with fleet_for(settings) as fleet:
        old = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        ranked = (await fleet.offers("tiny", "eu", exclude_unusable=True)).passed
        cheap, dear = ranked[0], ranked[-1]
        async with cloud.client() as api:
            # the best offer is much cheaper; another is cheaper per hour but dearer once traffic is paid
            await polite(api, "PUT", f"/admin/offers/{cheap.id}", json={"dph_base": 0.001})
            await polite(
                api,
                "PUT",
                f"/admin/offers/{dear.id}",
                json={"dph_base": old.dph_total / 2, "inet_up_cost": 0.049, "inet_down_cost": 0.049},
            )
        cloud.set_faults({"vanish_at_create": [cheap.id]})  # rented by someone else at the last moment
        moves = await rotation.reprice(fleet, dry_run=False)
        assert [m.best_offer for m in moves] == [cheap.id]
        new = fleet.record.hosts(names=[moves[0].new_host])[0] if moves[0].new_host else None
        assert new is None or new.effective_usd_per_hour < old.effective_usd_per_hour
        await fleet.destroy(None)
