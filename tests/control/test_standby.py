"""The standby pool (issue 13), against the strict local cloud: a host brought up and probed as `fleet up`
does, then stopped (a stop read in each form vast.ai says it); its disk alone billed; left alone by reconcile;
removed by `fleet destroy --all`."""

import asyncio
import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest

from fleet.control import rotation
from fleet.control.up import UpRequest
from fleet.core.models import HostState
from fleet.economics.bill import accrued_usd, bill, hours_billed, pull_usd
from tests.fleetkit import fleet_for, ranked_offers, settings_for, write_config
from tests.helpers import cheapest_offer, destroy, listed_instances, rent, shown, wait_status


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


async def test_a_standby_host_is_probed_stopped_billed_for_its_disk_and_left_alone(cloud, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu", standby=True))
        [host] = result.ready
        try:
            assert host.state == HostState.STANDBY and host.owner is None
            assert host.ready_at is None and host.stopped_at is not None
            assert fleet.endpoints() == []  # never published
            ran = [r.name for r in fleet.record.probe_runs(host.id)]
            assert ran == ["smoke", "cache", "keepalive"]  # the whole path, probes included
            instance = await fleet.market.get(host.instance_id)
            assert instance.status in ("exited", "stopped", "offline") and instance.stopped  # one of vast.ai's forms
            charges = [c for c in cloud.state()["charges"] if c["instance_id"] == host.instance_id]
            assert [c["kind"] for c in charges] == ["storage", "bandwidth", "gpu", "storage"]
            assert charges[-1]["end"] is None
            assert 0 < host.storage_usd_per_hour == pytest.approx(charges[-1]["dph_total"])
            assert host.storage_usd_per_hour < host.dph_total / 10

            # an hour in the pool costs the disk's hour, not the GPU's
            later = host.stopped_at + timedelta(hours=1)
            loading = (host.running_at - host.created_at).total_seconds() / 3600  # the disk alone: no GPU yet
            running = (host.stopped_at - host.running_at).total_seconds() / 3600
            pull = (host.pulled_bytes + host.image_bytes) / 1e9 * host.inet_down_usd_per_gb  # the image too
            assert host.pulled_bytes > 0 and pull > 0
            assert accrued_usd(host, later) == pytest.approx(
                host.dph_total * running + host.storage_usd_per_hour * (1 + loading) + pull
            )
            [line] = bill([host], later).lines
            assert line.standby_hours == pytest.approx(1.0)

            report = await fleet.reconcile()  # a stopped instance of a standby host is no failure
            assert report["failed"] == [] and report["destroyed"] == [] and report["strays_destroyed"] == []
            assert fleet.record.host(host.id).state == HostState.STANDBY
            [row] = fleet.status()
            assert row["state"] == "standby"
            # what it bills now is its disk, and a stopped host has no endpoint that answers
            assert row["usd_per_hour"] == host.storage_usd_per_hour and row["endpoint"] is None
        finally:
            destroyed = await fleet.destroy(None)  # `fleet destroy --all` takes the pool too
        assert await fleet.market.get(host.instance_id) is None
    assert [h.name for h in destroyed.done] == [host.name]
    closed = fleet.record.host(host.id)
    assert closed.state == HostState.DESTROYED and closed.destroyed_at is not None
    assert closed.accrued_usd == pytest.approx(accrued_usd(closed), rel=1e-3)  # the disk's rate while stopped
    assert closed.accrued_usd - pull_usd(closed) < closed.dph_total * hours_billed(closed)  # rent: under the GPU's


async def test_caps_count_a_standby_host_at_its_disks_price(cloud, tmp_path):
    # One host in the pool, and a cap on $/h that the next host fits only if the parked one counts at its
    # disk's price rather than its running price.
    settings = settings_for(tmp_path)
    async with fleet_for(settings) as fleet:
        [parked] = (await fleet.up(UpRequest("tiny", "eu", standby=True))).ready
        try:
            nxt = (await ranked_offers(settings))[0]
            assert nxt.machine_id != parked.machine_id
            cap = nxt.dph_total + 2 * parked.storage_usd_per_hour
            assert nxt.dph_total + parked.dph_total > cap  # counted at its running price, it would block
            capped = settings.model_copy(update={"caps": settings.caps.model_copy(update={"max_usd_per_hour": cap})})
            async with fleet_for(capped) as second:
                result = await second.up(UpRequest("tiny", "eu", max_price=nxt.dph_total))
            assert len(result.ready) == 1, result.failures
        finally:
            await fleet.destroy(None)


def test_standby_refuses_bad_input_with_one_line(tmp_path):
    config = write_config(tmp_path, "")
    for args, message in (
        (["--count", "0"], "--count must be at least 1"),
        (["--max-price", "-1"], "--max-price must be positive"),
    ):
        cli = subprocess.run(
            [sys.executable, "-m", "fleet", "standby", "--model", "tiny", "--region", "eu", *args],
            env={**os.environ, "FLEET_CONFIG": str(config)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 2 and message in cli.stderr and len(cli.stderr.strip().splitlines()) == 1, cli.stderr


async def test_fleet_standby_on_the_command_line_says_what_the_pool_costs(cloud, tmp_path):
    config = write_config(tmp_path, "")
    cli = subprocess.run(
        [sys.executable, "-m", "fleet", "standby", "--model", "tiny", "--region", "eu", "--json"],
        env={**os.environ, "FLEET_CONFIG": str(config)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        assert cli.returncode == 0, cli.stderr
        [row] = json.loads(cli.stdout)["standby"]
        assert 0 < row["storage_usd_per_hour"] < row["running_usd_per_hour"]
    finally:
        subprocess.run(
            [sys.executable, "-m", "fleet", "destroy", "--all", "--yes"],
            env={**os.environ, "FLEET_CONFIG": str(config)},
            capture_output=True,
            timeout=300,
        )


async def test_up_takes_a_standby_host_first_and_it_serves_again(cloud, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        [parked] = (await fleet.up(UpRequest("tiny", "eu", standby=True))).ready
        try:
            result = await fleet.up(UpRequest("tiny", "eu"))
            [host] = result.ready
            [attempt] = result.attempts
            assert (host.name, host.instance_id) == (parked.name, parked.instance_id)  # no new rent
            assert attempt.resumed and attempt.outcome == "ready"
            assert host.state == HostState.READY and host.stopped_at is None and host.stopped_hours > 0
            assert [e["name"] for e in fleet.endpoints()] == [host.name]
            ran = [r.name for r in fleet.record.probe_runs(host.id)]
            assert ran == ["smoke", "cache", "keepalive"] * 2  # probed again once started
            [probe] = await fleet.probe(host.name, only=["smoke"])  # it serves, on its new ports
            assert probe.passed, probe.diagnosis
        finally:
            await fleet.destroy(None)


async def test_a_standby_host_that_waits_for_its_gpu_is_destroyed_and_a_cold_host_takes_its_place(cloud, tmp_path):
    settings = settings_for(tmp_path, timeouts={"standby_start": 3})
    async with fleet_for(settings) as fleet:
        [parked] = (await fleet.up(UpRequest("tiny", "eu", standby=True))).ready
        cloud.set_faults({"gpu_taken": [parked.machine_id]})  # another renter took its GPU meanwhile
        try:
            result = await fleet.up(UpRequest("tiny", "eu"))
            [stuck, cold] = result.attempts
            [host] = result.ready
        finally:
            cloud.set_faults({})
            await fleet.destroy(None)
        assert stuck.resumed and stuck.outcome == "failed" and stuck.phase == "boot"
        assert "still scheduling after 3s (timeouts.standby_start)" in stuck.reason
        assert not cold.resumed and host.name == cold.host != parked.name
        gone = fleet.record.host(parked.id)
        assert gone.state == HostState.FAILED and gone.destroyed_at is not None
        assert await fleet.market.get(parked.instance_id) is None


async def test_make_before_break_takes_the_standby_host(cloud, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        [serving] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        [parked] = (await fleet.up(UpRequest("tiny", "eu", standby=True))).ready
        try:
            new = await rotation.replace(fleet, serving, "unhealthy (test)", blacklist=False)
            assert new is not None and new.name == parked.name  # from the pool, not a new rent
            assert [e["name"] for e in fleet.endpoints()] == [parked.name]
            assert fleet.record.host(serving.id).destroyed_at is not None
        finally:
            await fleet.destroy(None)


async def test_two_bring_ups_racing_for_one_pool_host_take_it_once(cloud, tmp_path):
    # Two `fleet up`s at once (two fleets on one database, as two processes would be) and one host in the pool:
    # the compare-and-set STANDBY -> BOOTING lets exactly one of them take it; the other rents.
    settings = settings_for(tmp_path)
    async with fleet_for(settings) as fleet, fleet_for(settings) as other:
        [parked] = (await fleet.up(UpRequest("tiny", "eu", standby=True))).ready
        try:
            a, b = await asyncio.gather(fleet.up(UpRequest("tiny", "eu")), other.up(UpRequest("tiny", "eu")))
            attempts = [*a.attempts, *b.attempts]
            assert len(a.ready) == len(b.ready) == 1
            assert sorted(x.resumed for x in attempts) == [False, True]
            [resumed] = [x for x in attempts if x.resumed]
            assert resumed.host == parked.name and resumed.outcome == "ready"
            assert len({h.instance_id for h in [*a.ready, *b.ready]}) == 2
        finally:
            await fleet.destroy(None)


async def test_a_pool_host_whose_kept_file_changed_is_destroyed_and_a_cold_host_takes_its_place(cloud, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        [parked] = (await fleet.up(UpRequest("tiny", "eu", standby=True))).ready
        kept = cloud.info.state_dir / "hosts" / str(parked.instance_id) / "root" / "models" / "tiny-llama-bytes.gguf"
        size = kept.stat().st_size
        os.truncate(kept, size // 2)  # the disk kept something else than what was verified
        try:
            result = await fleet.up(UpRequest("tiny", "eu"))
            [stale, cold] = result.attempts
            [host] = result.ready
        finally:
            await fleet.destroy(None)
    assert stale.resumed and stale.phase == "pull"
    assert f"{size // 2} bytes on the kept disk, the hub says {size}" in stale.reason
    assert host.name == cold.host != parked.name


async def test_a_stop_is_read_in_each_form_vast_ai_says_it(cloud, tmp_path):
    """Three hosts stopped for the standby pool, their instances saying so in each of vast.ai's forms (`exited`,
    `stopped`, and only the contract's states, the container reading `offline`): each is STANDBY well before
    timeouts.stop, and each serves again when taken. The third, its stop said by the contract's states alone,
    used to wait timeouts.stop out."""
    settings = settings_for(tmp_path)
    settings = settings.model_copy(update={"timeouts": settings.timeouts.model_copy(update={"stop": 40})})
    async with fleet_for(settings) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu", count=3, standby=True))
        assert len(result.ready) == 3, result
        async with cloud.client() as api:
            rows = {i["id"]: i for i in await listed_instances(api)}
        forms = {rows[h.instance_id]["actual_status"] for h in result.ready}
        assert forms == {"exited", "stopped", "offline"}, forms
        assert all(rows[h.instance_id]["cur_state"] == "stopped" for h in result.ready)
        states = {h.state for h in fleet.record.hosts(names=[h.name for h in result.ready])}
        assert states == {HostState.STANDBY}
        taken = (await fleet.up(UpRequest("tiny", "eu", count=3))).ready
        assert {h.name for h in taken} == {h.name for h in result.ready}  # each resumed from the pool
        await fleet.destroy(None)


async def test_a_pool_host_vast_ai_deleted_for_spent_credit_is_said_lost_by_reconcile_and_the_bill(cloud, tmp_path):
    """vast.ai deletes, not only stops, the instances of an account with no card once its balance stays below zero
    (billing.mdx: "scheduled for deletion"; "Your instances and stored data will be destroyed"): the pool's host
    and the files it kept are gone, and reconcile and the bill say so rather than a bare "gone"."""
    env = {**os.environ, "FLEET_CONFIG": str(write_config(tmp_path)), "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir)}
    async with fleet_for(settings_for(tmp_path)) as fleet:
        [parked] = (await fleet.up(UpRequest("tiny", "eu", standby=True))).ready
    try:
        async with cloud.client() as api:
            spent = 100.0 - (await api.get("/api/v0/users/current")).json()["balance"]
            # a cent below zero, past a buffer of half a cent: the next thing the account asks, it finds nothing
            cloud.set_faults({"credit_usd": spent - 0.01, "credit_buffer_usd": 0.005})
            assert await listed_instances(api) == []
        done = subprocess.run(
            [sys.executable, "-m", "fleet.cli", "reconcile"], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        cloud.set_faults({})
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "lost from the pool: 1" in said and f"lost: {parked.name}: lost from the standby pool" in said, said
    async with fleet_for(settings_for(tmp_path)) as fleet:
        host = fleet.record.host(parked.id)
    assert host.state == HostState.DESTROYED and host.destroyed_at is not None
    assert "its disk and the tiny files on it" in host.failure_reason and "credit" in host.failure_reason
    [line] = bill([host], host.destroyed_at).lines
    assert line.lost == host.failure_reason and line.standby_hours > 0  # what it kept, and what keeping it cost


async def test_a_balance_below_zero_inside_its_buffer_deletes_nothing(cloud):
    """The grace vast.ai gives an account's balance below zero before it deletes: a stopped instance stays."""
    async with cloud.client() as api:
        instance_id = await rent(api, (await cheapest_offer(api))["id"])
        try:
            await wait_status(api, instance_id, "running")
            spent = 100.0 - (await api.get("/api/v0/users/current")).json()["balance"]
            cloud.set_faults({"credit_usd": spent - 0.01, "credit_buffer_usd": 1.0})  # a cent below, a dollar of grace
            for _ in range(3):  # every request looks again: none deletes it (vast.ai stops it)
                assert await shown(api, instance_id) is not None
        finally:
            cloud.set_faults({})
            await destroy(api, instance_id)
