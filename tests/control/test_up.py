"""`fleet up` end to end on the local cloud: real sshd, aria2c, llama-server, SQLite."""

import asyncio
import os
import stat
import time

import pytest

from fleet.control.up import UpRequest
from fleet.core.models import HostState
from tests.fleetkit import fleet_for, ranked_offers, settings_for, with_variant
from tests.helpers import cheapest_offer, destroy, host_processes, listed_instances, rent


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env, cloud):
    yield
    # the module's tests share one cloud and each ends with nothing rented: a test that failed midway (run 25)
    # is charged with what it left, which is ended here, not with the failures of every test after it
    if left := asyncio.run(_end_every_instance(cloud)):
        pytest.fail(f"the test left instances {left} rented; ended them")


async def live_instances(cloud) -> list[dict]:
    async with cloud.client() as api:
        return await listed_instances(api)


async def _end_every_instance(cloud) -> list[int]:
    async with cloud.client() as api:
        left = [i["id"] for i in await listed_instances(api)]
        for instance_id in left:
            await destroy(api, instance_id)
    return left


async def test_happy_path_ready_host_answers_with_its_key_only(cloud, tmp_path):
    settings = settings_for(tmp_path)
    async with fleet_for(settings) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        assert [h.state for h in result.ready] == [HostState.READY]
        host = result.ready[0]
        assert host.host_key and host.api_key_nonce and host.api_key is None and host.api_url
        assert host.geolocation[-2:] in settings.regions["eu"]
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert host.api_url.startswith("https://")
        async with fleet.server(host).client(timeout=10) as client:
            ok = await client.post("/v1/chat/completions", json=body)
            assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
        async with fleet.server(host).without_key().client(timeout=10) as client:
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 401

        status = fleet.status()
        assert status[0]["state"] == "ready" and status[0]["instance_id"] == host.instance_id
        assert {
            "id",
            "state",
            "model",
            "region",
            "instance_id",
            "machine_id",
            "dph_total",
            "accrued_usd",
            "endpoint",
        } <= set(status[0])
        events = [(e.kind, e.action) for e in fleet.record.events(host.id)]
        assert events.index(("intent", "create")) < events.index(("answer", "create"))
        runs = {r.name: r.passed for r in fleet.record.probe_runs(host.id)}
        assert runs == {"smoke": True, "cache": True, "keepalive": True}

        mode = stat.S_IMODE(os.stat(settings.database.file).st_mode)
        assert mode == 0o600
        assert stat.S_IMODE(os.stat(settings.database.file.parent / "ssh" / "id_ed25519").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(settings.database.file.parent / "ssh").st_mode) == 0o700

        done = (await fleet.destroy([host.name])).done
        assert done[0].state == HostState.DESTROYED and done[0].accrued_usd > 0
        again = (await fleet.destroy([host.name])).done  # idempotent
        assert again[0].state == HostState.DESTROYED
    assert await live_instances(cloud) == []


async def test_offer_vanishing_at_create_moves_to_the_next_without_a_duplicate(cloud, tmp_path):
    settings = settings_for(tmp_path)
    first = (await ranked_offers(settings))[0]
    cloud.set_faults({"vanish_at_create": [first.id]})
    async with fleet_for(settings) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        assert len(result.ready) == 1
        assert [a.outcome for a in result.attempts] == ["failed", "ready"]
        assert result.attempts[0].offer_id == first.id and "offer gone" in result.attempts[0].reason
        assert result.ready[0].offer_id != first.id
        assert first.machine_id not in fleet.record.blacklisted_machines(fleet.market.url, fleet_now())
        assert len(await live_instances(cloud)) == 1
        await fleet.destroy(None)
    assert await live_instances(cloud) == []


def fleet_now():
    from fleet.core.models import utcnow

    return utcnow()


async def test_host_stuck_in_loading_is_destroyed_blacklisted_and_replaced(cloud, tmp_path):
    settings = settings_for(tmp_path)
    stuck = (await ranked_offers(settings))[0]
    cloud.set_faults({"stuck_loading": [stuck.machine_id]})
    # fleet is told the image is empty: no pull allowance beyond create_to_running (the cloud pulls in seconds)
    settings = settings_for(tmp_path, timeouts={"create_to_running": 15.0})
    settings = settings.model_copy(update={"provider": settings.provider.model_copy(update={"image_gb": 0.0})})
    async with fleet_for(settings) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        assert len(result.ready) == 1
        failed = result.attempts[0]
        assert (failed.offer_id, failed.phase) == (stuck.id, "boot") and "loading" in failed.reason
        blacklist = fleet.record.blacklist()
        assert [(b.machine_id, b.phase) for b in blacklist] == [(stuck.machine_id, "boot")]
        failed_host = fleet.record.hosts(names=[failed.host])[0]
        assert failed_host.state == HostState.FAILED and failed_host.destroyed_at is not None
        assert len(await live_instances(cloud)) == 1
        await fleet.destroy(None)


async def test_a_boot_past_its_deadline_says_why_even_when_the_listing_answers_late(cloud, tmp_path):
    """Run 25: on a busy machine the listing that would show the deadline passed came after the phase's backstop,
    and the attempt read only "not done after 15s" where it used to say the instance was still loading."""
    settings = settings_for(
        tmp_path, timeouts={"create_to_running": 6.0, "instance_visible": 4.0}, up={"max_attempts": 1}
    )
    settings = settings.model_copy(update={"provider": settings.provider.model_copy(update={"image_gb": 0.0})})
    async with fleet_for(settings) as fleet:

        async def listings_late_once_created() -> None:
            while not any(h.instance_id for h in fleet.record.hosts()):
                await asyncio.sleep(0.02)
            # every listing from now on answers 20 s late, past the boot's backstop (create_to_running + 5 s)
            cloud.set_faults({"slow": {"share": 1.0, "paths": ["/api/v1/instances"], "delay_s": 20.0}})

        late = asyncio.create_task(listings_late_once_created())
        try:
            result = await fleet.up(UpRequest("tiny", "eu"))
        finally:
            late.cancel()
            cloud.set_faults({})
        assert late.done() and result.ready == [] and [a.phase for a in result.attempts] == ["boot"]
        assert result.attempts[0].reason == "not listed 4s after create (timeouts.instance_visible)"
        await fleet.destroy(None)


async def test_pull_reset_mid_file_is_resumed_and_verified(cloud, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        await fleet.plan("tiny")  # the header is read (and kept) before the resets start
        cloud.set_faults({"pull_reset": {"after_bytes": 100_000, "count": 2}})
        result = await fleet.up(UpRequest("tiny", "eu"))
        assert len(result.ready) == 1 and len(result.attempts) == 1
        async with cloud.client() as api:
            assert (await api.get("/admin/faults")).json()["pull_reset"]["count"] == 0
        await fleet.destroy(None)


async def test_corrupted_file_fails_the_host_in_pull(cloud, tmp_path):
    cloud.set_faults({"corrupt_files": ["tiny-llama-bytes.gguf"]})
    settings = settings_for(tmp_path, up={"max_attempts": 2})
    async with fleet_for(settings) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        assert result.ready == []
        assert [(a.phase, "sha256 mismatch" in a.reason) for a in result.attempts] == [("pull", True)] * 2
        assert "gave up after 2 attempts" in result.failures[0]
        assert len(fleet.record.blacklist()) == 2
    assert await live_instances(cloud) == []


async def test_count_three_comes_up_concurrently_on_distinct_machines(cloud, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu", count=3))
        assert len(result.ready) == 3
        assert len({h.machine_id for h in result.ready}) == 3
        assert len({h.api_url for h in result.ready}) == 3
        tokens = [(i, v["token"]) for i, v in cloud.state()["instances"].items()]
        done = (await fleet.destroy(None)).done
        assert {h.state for h in done} == {HostState.DESTROYED}
    assert await live_instances(cloud) == []
    assert [p for i, t in tokens for p in host_processes(cloud.info.state_dir, i, t)] == []


async def test_caps_refuse_a_create(cloud, tmp_path):
    settings = settings_for(tmp_path, caps={"max_hosts_total": 1})
    async with fleet_for(settings) as fleet:
        first = await fleet.up(UpRequest("tiny", "eu"))
        assert len(first.ready) == 1
        second = await fleet.up(UpRequest("tiny", "eu"))
        assert second.ready == [] and second.attempts == []
        assert "caps.max_hosts_total = 1" in second.failures[0]
        assert len(await live_instances(cloud)) == 1
        await fleet.destroy(None)
    settings = settings_for(tmp_path, caps={"max_usd_per_hour": 0.1})
    async with fleet_for(settings) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        assert result.ready == [] and "caps.max_usd_per_hour" in result.failures[0]
    assert await live_instances(cloud) == []


async def test_dry_run_rents_nothing(cloud, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu", count=2, dry_run=True))
        assert result.planned and result.attempts == []
        assert fleet.record.hosts() == []
    assert await live_instances(cloud) == []


async def test_reconcile_destroys_strays_and_marks_vanished_hosts(cloud, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        host = result.ready[0]
        async with cloud.client() as api:
            offer = await cheapest_offer(api)
            stray = await rent(api, offer["id"], label=f"{fleet.label_prefix}lost-one")  # ours: this install's label
            await destroy(api, host.instance_id)  # vanished behind our back
            # vast.ai's reads lag create: the stray is swept once the listing shows it (a fresh one waits
            # for the next reconcile)
            deadline = time.monotonic() + 20
            while stray not in [i["id"] for i in await listed_instances(api)] and time.monotonic() < deadline:
                await asyncio.sleep(1.0)
        report = await fleet.reconcile()
        assert report["gone"] == [host.name] and report["strays_destroyed"] == [stray]
        assert fleet.record.hosts(names=[host.name])[0].state == HostState.DESTROYED
    assert await live_instances(cloud) == []


async def test_concurrent_bring_ups_share_the_event_loop(cloud, tmp_path):
    """Two independent `up` calls at once: both succeed, no machine rented twice."""
    async with fleet_for(settings_for(tmp_path)) as fleet:
        a, b = await asyncio.gather(fleet.up(UpRequest("tiny", "eu")), fleet.up(UpRequest("tiny", "eu")))
        hosts = a.ready + b.ready
        assert len(hosts) == 2 and hosts[0].machine_id != hosts[1].machine_id
        await fleet.destroy(None)


async def test_a_server_that_exits_at_start_fails_the_host_in_start(cloud, tmp_path):
    settings = with_variant(
        settings_for(tmp_path, up={"max_attempts": 1}), "tiny-broken", extra_args=["--no-such-flag"]
    )
    async with fleet_for(settings) as fleet:
        result = await fleet.up(UpRequest("tiny-broken", "eu"))
        assert result.ready == []
        [attempt] = result.attempts
        assert attempt.phase == "start" and "llama-server exited" in attempt.reason
        assert "no-such-flag" in attempt.reason  # the server's own words, from its log
    assert await live_instances(cloud) == []
