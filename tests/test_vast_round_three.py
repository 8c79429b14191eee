"""vast.ai as it really is, round three (issue 35), on the strict local cloud: rate limits counted per calling
address and drawn on by every process of an install from one budget in the record; a bring-up that the
marketplace throttles waits within its phase's deadline and blames no machine."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import time
from datetime import timedelta

import pytest

from fleet.control import rotation
from fleet.control.up import UpRequest
from fleet.core.models import HostState, as_utc, utcnow
from fleet.economics.offers import MAINTENANCE_UNKNOWN
from fleet.market import AuthError, reads_gone
from fleet.market.pacing import Pacer
from fleet.market.vast import VastMarket
from fleet.market.watch import InstanceWatch
from tests.fleetkit import first_machine, fleet_for, ranked_offers, settings_for, write_config
from tests.helpers import cheapest_offer, listed_instances, polite, rent, wait_status


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


async def refused(cloud) -> int:
    async with cloud.client() as api:
        return (await api.get("/admin/stats")).json()["rate_limited"]


LISTER = """
import asyncio, sys
from fleet.app import open_fleet
from fleet.core import config
from fleet.engines import registry

async def main():
    settings = registry.load(sys.argv[1])
    async with open_fleet(settings) as fleet:
        for _ in range(int(sys.argv[2])):
            await fleet.market.list("fleet:")
        print(fleet.market.pacer.counters.total_rate_limited())

asyncio.run(main())
"""


async def test_every_process_of_an_install_draws_on_one_budget_of_calls(cloud, tmp_path):
    """Three processes listing at once, as a daemon and two commands beside it do: the marketplace counts their
    calls as one caller's (its limits are per calling address), and the record's budget spaces them so that it
    never has to refuse one."""
    config_path = write_config(tmp_path)
    before = await refused(cloud)
    env = {**os.environ, "FLEET_CONFIG": str(config_path)}
    listers = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            LISTER,
            str(config_path),
            "4",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for _ in range(3)
    ]
    outputs = [await p.communicate() for p in listers]
    assert all(p.returncode == 0 for p in listers), [err.decode()[-500:] for _, err in outputs]
    assert [out.decode().strip() for out, _ in outputs] == ["0", "0", "0"]  # none of them met a 429
    assert await refused(cloud) == before
    with sqlite3.connect(settings_for(tmp_path).database.file) as db:
        reserved = dict(db.execute("SELECT key, next_at FROM market_pace").fetchall())
    assert list(reserved) == [f"list {cloud.info.url}"]  # the calls were reserved in the record


async def test_a_bring_up_the_marketplace_throttles_waits_and_blames_no_machine(cloud, tmp_path):
    """Eight listings in a row refused (429, no Retry-After) while the host boots (more than fleet retried before
    it gave the bring-up up with "an unexpected error"): it waits them out within the phase's deadline; nothing is
    blacklisted and the host comes up."""
    cloud.set_faults({"rate_limit": {"count": 8, "paths": ["/api/v1/instances"]}})
    try:
        async with fleet_for(settings_for(tmp_path)) as fleet:
            fleet.market.pacer = Pacer()
            result = await fleet.up(UpRequest("tiny", "eu"))
            limited = fleet.market.pacer.counters.total_rate_limited()
            assert len(result.ready) == 1, result
            assert fleet.record.blacklist() == []
            await fleet.destroy(None)
    finally:
        cloud.set_faults({})
    assert limited >= 8


async def test_a_key_that_may_not_search_is_named_before_anything_is_rented(cloud, tmp_path):
    """A scoped key without `misc` cannot search offers (vast-cli's api_scopes.json: POST /bundles/ needs it), nor
    without `user_read` read the credit: `fleet up` names both in one line before it rents or searches."""
    scoped = "scoped-key-0b7e4c1a9d2f6e83"
    cloud.set_faults({"scoped_keys": {scoped: ["instance_read", "instance_write"]}})
    try:
        async with fleet_for(settings_for(tmp_path)) as fleet:
            await fleet.watch.close()
            await fleet.market.close()
            fleet.market = VastMarket(fleet.market.url, scoped)
            fleet.watch = InstanceWatch(fleet.market)
            with pytest.raises(AuthError) as refused:
                await fleet.up(UpRequest("tiny", "eu"))
            said = str(refused.value)
            assert "misc (searching offers)" in said and "user_read (" in said and "instance_read (" not in said
            assert "\n" not in said and scoped not in said
            assert fleet.record.hosts() == []
            await fleet.market.close()
        async with cloud.client() as api:
            assert await listed_instances(api) == []
    finally:
        cloud.set_faults({})


async def arm64_offers(cloud) -> list[dict]:
    async with cloud.client() as api:
        body = {"cpu_arch": {"eq": "arm64"}, "rentable": {"eq": True}, "order": [["dph_total", "asc"]]}
        return (await api.post("/api/v0/bundles/", json=body)).json()["offers"]


async def test_arm64_machines_are_left_out_however_cheap_and_an_image_of_another_cpu_stops_at_once(cloud, tmp_path):
    """Three GH200s (compute 9.0, arm64) made the cheapest offers: fleet asks for amd64 machines, counts what the
    CPU filter removed, and rents an amd64 one; an image its hosts cannot run (the profile's machines told to be
    arm64) fails once, blames no machine and stops the bring-up, saying so."""
    gh200 = await arm64_offers(cloud)
    assert len(gh200) == 3 and {o["gpu_name"] for o in gh200} == {"GH200"}
    async with cloud.client() as api:
        for o in gh200:
            (await api.put(f"/admin/offers/{o['id']}", json={"dph_base": 0.01})).raise_for_status()
    settings = settings_for(tmp_path, up={"max_attempts": 5})
    async with fleet_for(settings) as fleet:
        explained = await fleet.offers("tiny", "eu", explain=True)
        assert ("CPU amd64 (the image's)", 3) in explained.removed
        assert not {o.id for o in explained.passed} & {o["id"] for o in gh200}
        [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        assert host.machine_id not in {o["machine_id"] for o in gh200}
        await fleet.destroy(None)
    arm = settings.model_copy(update={"provider": settings.provider.model_copy(update={"image_arch": "arm64"})})
    async with fleet_for(arm) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        assert result.ready == [] and len(result.attempts) == 1, result
        [attempt] = result.attempts
        assert attempt.machine_id in {o["machine_id"] for o in gh200} and "exec format error" in attempt.reason
        assert "cannot be pulled or run" in result.failures[0] and fleet.record.blacklist() == []
        await fleet.destroy(None)


async def test_a_stop_is_read_in_each_form_vast_ai_says_it(cloud, tmp_path):
    """Three hosts stopped for the standby pool, their instances saying so in each of vast.ai's forms (`exited`,
    `stopped`, and only the contract's states, the container reading `offline`): each is STANDBY well before
    timeouts.stop, and each serves again when taken."""
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


async def test_a_contract_its_host_extended_keeps_the_host_serving(cloud, tmp_path):
    """A READY host whose rental ends within the margin would be replaced; its machine's host moved the end a
    year out ("Instance contract extended"): the health sweep reads the new end and keeps it."""
    async with fleet_for(settings_for(tmp_path)) as fleet:
        [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        soon = utcnow() + timedelta(hours=2)
        fleet.record.update(host, contract_end_at=soon)  # as rented: the machine's offer ended in 2 hours
        later = time.time() + 400 * 86400  # past the end its machine's offer had
        async with cloud.client() as api:
            earlier = await api.put(f"/admin/instances/{host.instance_id}/contract", json={"end_date": 1.0})
            assert earlier.status_code == 400  # a rental's end moves forward only
            (
                await api.put(f"/admin/instances/{host.instance_id}/contract", json={"end_date": later})
            ).raise_for_status()
        [report] = await rotation.health_sweep(fleet)
        assert report.healthy and report.replaced_by is None, report
        [kept] = fleet.record.hosts(names=[host.name])
        assert kept.state == HostState.READY and abs(as_utc(kept.contract_end_at).timestamp() - later) < 1
        await fleet.destroy(None)


async def test_an_expired_pool_host_is_never_started_and_is_destroyed(cloud, tmp_path):
    """A standby host whose rental contract ended: vast.ai never starts it again and deletes it 48 h later.
    `fleet up` brings a host up cold instead of trying it, reconcile destroys it blaming no machine, and the
    local cloud refuses its start."""
    settings = settings_for(tmp_path, filters={"min_contract_hours": 0})
    offer = (await ranked_offers(settings))[0]
    async with cloud.client() as api:
        (await api.put(f"/admin/offers/{offer.id}", json={"end_date": time.time() + 25})).raise_for_status()
    async with fleet_for(settings) as fleet:
        [parked] = (await fleet.up(UpRequest("tiny", "eu", standby=True))).ready
        assert parked.offer_id == offer.id and parked.state == HostState.STANDBY
        while as_utc(parked.contract_end_at).timestamp() > time.time():
            await asyncio.sleep(0.5)
        async with cloud.client() as api:
            start = await polite(api, "PUT", f"/api/v0/instances/{parked.instance_id}/", json={"state": "running"})
            assert start.status_code == 400 and "expired" in start.json()["msg"]
        [fresh] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        assert fresh.name != parked.name and fresh.offer_id != offer.id  # a cold bring-up, elsewhere
        report = await fleet.reconcile()
        assert parked.name in report["failed"]
        [gone] = fleet.record.hosts(names=[parked.name])
        assert gone.destroyed_at is not None and fleet.record.blacklist() == []
        await fleet.destroy(None)


async def test_the_local_cloud_deletes_an_expired_instance_when_its_time_is_up(cloud):
    async with cloud.client() as api:
        offer = await cheapest_offer(api)
        end = time.time() + 15  # time to boot first, on a busy machine too
        (await api.put(f"/admin/offers/{offer['id']}", json={"end_date": end})).raise_for_status()
        cloud.set_faults({"expired_kept_s": 3})  # vast.ai's 48 h, shortened
        try:
            instance_id = await rent(api, offer["id"], label="other:expiring")
            await wait_status(api, instance_id, "running", timeout_s=60)
            deadline = time.monotonic() + 60
            while True:  # gone: null, a 404, or a row that says it was destroyed (vast.ai's three forms)
                r = await polite(api, "GET", f"/api/v0/instances/{instance_id}/")
                row = r.json().get("instances") if r.status_code == 200 else None
                if row is None or reads_gone(row):
                    break
                assert time.monotonic() < deadline, row
                await asyncio.sleep(0.2)
            assert time.time() >= end + 3  # not before its time
        finally:
            cloud.set_faults({})


async def test_a_big_image_on_a_slow_link_is_waited_for_and_its_bytes_are_billed(cloud, tmp_path):
    """A 30 GB image on a machine that lists 130 Mbit/s: its pull takes half an hour on vast.ai (18 s on the local
    cloud's clock), far past timeouts.create_to_running. fleet gives the boot the pull's time at the listed
    link, blames no machine, and bills the image's bytes with the files'."""
    base = settings_for(tmp_path)
    tiny = base.models["tiny"].model_copy(update={"disk_gb": 40.0})  # the disk holds the image too
    settings = base.model_copy(
        update={
            "provider": base.provider.model_copy(update={"image_gb": 30.0}),
            "timeouts": base.timeouts.model_copy(update={"create_to_running": 10}),
            "models": {**base.models, "tiny": tiny},
        }
    )
    offer = (await ranked_offers(settings))[0]
    async with cloud.client() as api:
        (await api.put(f"/admin/offers/{offer.id}", json={"inet_down": 130.0})).raise_for_status()
    cloud.set_faults({"image_sizes": {settings.provider.image: 30_000_000_000}})
    try:
        async with fleet_for(settings) as fleet:
            started = time.monotonic()
            result = await fleet.up(UpRequest("tiny", "eu"))
            assert [a.outcome for a in result.attempts] == ["ready"], result.attempts
            [host] = result.ready
            assert host.offer_id == offer.id and host.image_bytes == 30_000_000_000
            assert time.monotonic() - started > 10  # longer than create_to_running alone allowed
            charges = [c for c in cloud.state()["charges"] if c["instance_id"] == host.instance_id]
            [traffic] = [c for c in charges if c["kind"] == "bandwidth"]
            assert traffic["bytes_down"] >= 30_000_000_000
            [line] = fleet.session(host.created_at).bill.lines
            image_usd = 30.0 * host.inet_down_usd_per_gb
            assert line.pull_usd == pytest.approx(
                image_usd + (host.pulled_bytes or 0) / 1e9 * host.inet_down_usd_per_gb
            )
            assert fleet.record.blacklist() == []
            await fleet.destroy(None)
    finally:
        cloud.set_faults({})


async def test_a_machine_announced_for_maintenance_is_not_rented_and_a_host_on_one_moves_ahead(cloud, tmp_path):
    """vast.ai's maintenance windows (`show maints`): a machine whose host takes it down within the time a new
    host must serve is left out (the funnel says so); a READY host whose machine goes down in two hours moves,
    make before break, blaming no machine; a machine in its window is down in the local cloud."""
    settings = settings_for(tmp_path)
    first = await first_machine(settings)
    answered = {"renter_reads_maintenances": True}  # where vast.ai answers a renter's key (no source says)
    cloud.set_faults({"maintenances": {first: [time.time() + 3600, 2.0]}, **answered})
    try:
        async with fleet_for(settings) as fleet:
            funnel = await fleet.offers("tiny", "eu")
            assert ("no maintenance announced within 48 h", 1) in funnel.removed
            [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
            assert host.machine_id != first
            cloud.set_faults({"maintenances": {host.machine_id: [time.time() + 2 * 3600, 1.0]}, **answered})
            [report] = await rotation.health_sweep(fleet)
            assert "maintenance starts at" in report.reason and report.replaced_by, report
            [new] = fleet.record.hosts(names=[report.replaced_by])
            assert new.state == HostState.READY and new.machine_id != host.machine_id
            assert fleet.record.blacklist() == []
            # the local cloud takes a machine down for its window
            cloud.set_faults({"maintenances": {new.machine_id: [time.time() + 1, 1.0]}, **answered})
            async with cloud.client() as api:
                deadline = time.monotonic() + 30
                while (await polite(api, "GET", f"/api/v0/instances/{new.instance_id}/")).json()["instances"][
                    "actual_status"
                ] != "offline":
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.5)
            await fleet.destroy(None)
    finally:
        cloud.set_faults({})


async def test_maintenance_windows_a_renter_may_not_read_are_unknown_and_stop_no_search_or_sweep(cloud, tmp_path):
    """vast.ai round four: vast-cli labels `show maints` a host's command. fleet read it on every search and every
    health sweep and raised on a refusal, so `fleet up` died at the search and every sweep aborted. A refusal
    (the local cloud's default, the harder reading) is "windows unknown": said in the funnel, and nothing stops."""
    settings = settings_for(tmp_path)
    first = await first_machine(settings)
    cloud.set_faults({"maintenances": {first: [time.time() + 3600, 2.0]}})  # announced, but not to a renter
    try:
        async with fleet_for(settings) as fleet:
            funnel = await fleet.offers("tiny", "eu")
            assert funnel.unknown == [MAINTENANCE_UNKNOWN] and funnel.passed
            assert not any(name.startswith("no maintenance announced") for name, _ in funnel.removed)
            [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
            [report] = await rotation.health_sweep(fleet)  # the sweep runs to its end
            assert report.name == host.name and report.healthy and report.replaced_by is None, report
            await fleet.destroy(None)
    finally:
        cloud.set_faults({})


async def test_the_local_cloud_holds_creates_to_vast_ais_input_limits_and_bills_no_offline_time(cloud):
    """vast.ai's create validation (args, args_str and onstart 4096 characters together; an env value 256, all
    of env 32768), and its billing: "You are not charged active rental or storage costs for instances that are
    currently offline"."""
    async with cloud.client() as api:
        offer = await cheapest_offer(api)
        ask = f"/api/v0/asks/{offer['id']}/"
        for body, says in (
            ({"onstart": "x" * 3000, "args_str": "y" * 1200}, "4096"),
            ({"env": {"TOKEN": "z" * 257}}, "256"),
            ({"env": {f"K{i}": "v" * 200 for i in range(200)}}, "32768"),
        ):
            refused = await polite(api, "PUT", ask, json={"image": "x", "disk": 10, **body})
            assert refused.status_code == 400 and refused.json()["error"] == "invalid_args", refused.text
            assert says in refused.json()["msg"]
        instance_id = await rent(api, offer["id"], label="other:offline")
        try:
            await wait_status(api, instance_id, "running", timeout_s=60)
            cloud.set_faults({"offline_after_s": {offer["machine_id"]: 0}})
            await wait_status(api, instance_id, "offline", timeout_s=30)
            charges = [c for c in cloud.state()["charges"] if c["instance_id"] == instance_id]
            assert {c["kind"] for c in charges if c["end"] is None} == {"bandwidth"}  # no GPU, no disk while offline
        finally:
            cloud.set_faults({})
            await polite(api, "DELETE", f"/api/v0/instances/{instance_id}/")


async def test_destroying_an_instance_under_an_open_connection_logs_no_traceback(cloud, tmp_path):
    """A forwarder that stops under a live connection ends it quietly: the local cloud logged a CancelledError
    traceback for every destroyed instance that had one (issue 38)."""
    log = cloud.info.state_dir / "server.log"
    async with fleet_for(settings_for(tmp_path)) as fleet:
        [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        before = log.read_text(errors="replace")
        async with fleet.server(host).client(timeout=30) as client:
            assert (await client.get("/health")).status_code == 200  # a kept connection through the forwarder
            await fleet.destroy([host.name])
    after = log.read_text(errors="replace")[len(before) :]
    assert "destroy" in after.lower() or "instance" in after.lower()  # the cloud did log the destroy
    assert "Traceback" not in after and "CancelledError" not in after, after[-2000:]
