"""A host's end, on the strict local cloud: a drain waits for the call in flight as the server counts it, a
destroy the marketplace keeps refusing leaves the host billing on the record for reconcile to finish, and an
interrupted `fleet up` destroys every sibling's instance before it exits. Nothing bills after fleet lost track
of it."""

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.control import rotation
from fleet.control.up import UpRequest
from fleet.engines.metrics import requests_in_flight
from fleet.market import MarketError
from tests.fleetkit import fleet_for, settings_for, with_variant, write_config
from tests.helpers import listed_instances


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


async def test_drain_waits_for_the_call_in_flight_read_from_metrics(cloud, tmp_path):
    # every host serves /metrics and no /slots (which would hand each caller's transcript to any key holder):
    # a drain reads the requests in flight there, and waits for the one under way
    """A drain used to read the refused /slots as idle and cut the call in flight: it reads /metrics, and waits."""
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


async def test_a_destroy_that_fails_leaves_the_host_for_reconcile_to_finish(cloud, tmp_path):
    # three tries of each destroy (1.5 s of backoff), not the shipped minute: the fault outlasts any number
    """A destroy that failed used to close the host's bill while its instance went on billing, unrecorded."""
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
        # and once: the listing it read before still showed the instance, which is no stray (a second destroy,
        # logged as a closed bill with a live instance, followed every host a reconcile ended)
        assert host.name in report["destroyed"] and report["strays_destroyed"] == []
        assert not [e for e in fleet.record.events() if e.action == "reconcile" and "stray_destroyed" in e.detail]
        host = fleet.record.hosts(names=[attempt.host])[0]
        assert host.destroyed_at is not None and host.accrued_usd > 0
        async with cloud.client() as api:
            assert await listed_instances(api) == []


async def test_a_host_the_marketplace_will_not_destroy_holds_up_none_of_the_others(cloud, tmp_path):
    """`fleet destroy` ends its hosts side by side; one whose destroy the marketplace keeps refusing is named in
    the error and left billing on the record for reconcile, and the others are destroyed all the same (one at a
    time, the first refusal used to leave every host after it running)."""
    settings = settings_for(tmp_path, provider={"error_attempts": 3})
    async with fleet_for(settings) as fleet:
        ready = (await fleet.up(UpRequest("tiny", "eu", count=3))).ready
        assert len(ready) == 3
        first, *others = sorted(ready, key=lambda h: h.id or 0)  # the order destroy takes them in
        refused = {"count": 1000, "paths": [f"/api/v0/instances/{first.instance_id}/"], "methods": ["DELETE"]}
        cloud.set_faults({"server_error": refused})
        try:
            with pytest.raises(MarketError, match=rf"1 of 3 host\(s\) not destroyed.*\(2 destroyed\): {first.name}"):
                await fleet.destroy(None)
        finally:
            cloud.set_faults({})
        now = {h.name: h for h in fleet.record.hosts()}
        assert now[first.name].destroyed_at is None and all(now[h.name].destroyed_at for h in others)
        async with cloud.client() as api:
            assert [i["id"] for i in await listed_instances(api)] == [first.instance_id]
        report = await fleet.reconcile()
        assert report["destroyed"] == [first.name]
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
