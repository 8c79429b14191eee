"""fleet survives vast.ai as it really is: on the strict local cloud (rate limits, read lag, late SSH keys,
heartbeat gaps, NAT'd ports), `fleet up` brings hosts up without a wasted call, and each hard answer vast.ai
can give ends where it should (docs/vast-fidelity.md)."""

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import pytest

from fleet.control import rotation
from fleet.control.up import UpRequest
from fleet.core.models import HostState
from fleet.economics.offers import effective_price_per_hour
from fleet.market import Instance, MarketError
from fleet.market.pacing import Pacer
from fleet.market.vast import VastMarket
from tests.fleetkit import first_machine, fleet_for, settings_for, write_config
from tests.helpers import listed_instances, polite

CALLS_PER_HOST = 40  # issue 9's bar for `up` on the strict cloud


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


async def test_count_four_comes_up_without_a_429_and_within_the_call_budget(cloud, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        counters = fleet.market.pacer.counters
        calls_before, limited_before = counters.total_calls(), counters.total_rate_limited()
        result = await fleet.up(UpRequest("tiny", "eu", count=4))
        calls = counters.total_calls() - calls_before
        assert len(result.ready) == 4 and all(a.outcome == "ready" for a in result.attempts)
        assert len({h.machine_id for h in result.ready}) == 4
        assert counters.total_rate_limited() == limited_before  # paced: vast.ai never had to say 429
        assert calls <= CALLS_PER_HOST * 4, counters.calls
        assert counters.calls["list"] < 4 * 10  # one listing for all four, not a show per host
        assert "show" not in counters.calls or counters.calls["show"] == 0
        await fleet.destroy(None)
    async with cloud.client() as api:
        assert await listed_instances(api) == []


async def test_a_container_that_cannot_start_fails_fast_and_the_next_offer_serves(cloud, tmp_path):
    settings = settings_for(tmp_path, timeouts={"create_to_running": 300})
    broken = await first_machine(settings)
    cloud.set_faults({"oci_error": [broken]})
    async with fleet_for(settings) as fleet:
        started = time.monotonic()
        result = await fleet.up(UpRequest("tiny", "eu"))
        failed = result.attempts[0]
        assert failed.machine_id == broken and failed.phase == "boot"
        assert "cannot start" in failed.reason and "OCI runtime create failed" in failed.reason
        assert failed.seconds < 30  # not create_to_running (300 s)
        assert len(result.ready) == 1 and result.ready[0].machine_id != broken
        assert [b.machine_id for b in fleet.record.blacklist()] == [broken]
        await fleet.destroy(None)
    assert time.monotonic() - started < 90


async def test_a_heartbeat_gap_is_waited_out_within_its_grace_and_not_beyond(cloud, tmp_path):
    settings = settings_for(tmp_path)
    machine = await first_machine(settings)
    cloud.set_faults({"heartbeat_gap": {str(machine): {"after_s": 0.0, "for_s": 5.0, "status": "unknown"}}})
    async with fleet_for(settings) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        assert [h.machine_id for h in result.ready] == [machine]  # waited the gap out
        # a READY host whose heartbeat is late is healthy while its server answers
        cloud.set_faults({"heartbeat_gap": {str(machine): {"after_s": 0.0, "for_s": 3600.0, "status": "offline"}}})
        [report] = await rotation.health_sweep(fleet)
        assert report.healthy and "offline" in report.reason and report.replaced_by is None
        await fleet.destroy(None)

    strict = settings_for(tmp_path / "strict", timeouts={"heartbeat_gap": 1.0}, up={"max_attempts": 1})
    cloud.set_faults({"heartbeat_gap": {str(machine): {"after_s": 0.0, "for_s": 3600.0, "status": "offline"}}})
    async with fleet_for(strict) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        [attempt] = result.attempts
        assert result.ready == [] and attempt.phase == "boot" and "timeouts.heartbeat_gap" in attempt.reason


async def test_a_create_error_that_made_a_contract_is_destroyed_and_the_next_offer_serves(cloud, tmp_path):
    cloud.set_faults({"create_error_with_contract": 1})
    async with fleet_for(settings_for(tmp_path)) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        failed, ready = result.attempts
        assert failed.phase == "create" and "created but could not be confirmed" in failed.reason
        assert ready.outcome == "ready" and len(result.ready) == 1
        lost = fleet.record.hosts(names=[failed.host])[0]
        assert lost.instance_id is not None and lost.state == HostState.FAILED and lost.destroyed_at is not None
        assert fleet.record.blacklist() == []  # the machine did nothing wrong
        async with cloud.client() as api:
            assert [i["id"] for i in await listed_instances(api)] == [result.ready[0].instance_id]
        await fleet.destroy(None)


async def test_the_instance_price_is_recorded_when_it_differs_from_the_offer(cloud, tmp_path):
    settings = settings_for(tmp_path)
    async with fleet_for(settings) as fleet:
        offer = (await fleet.offers("tiny", "eu", exclude_unusable=True)).passed[0]
        cloud.set_faults({"reprice_at_create": {str(offer.id): 1.5}})
        host = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        assert host.offer_id == offer.id and host.dph_total > offer.dph_total * 1.2
        async with cloud.client() as api:
            row = (await polite(api, "GET", f"/api/v0/instances/{host.instance_id}/")).json()["instances"]
        assert host.dph_total == pytest.approx(row["dph_total"])
        traffic = effective_price_per_hour(offer, settings.profile("tiny")) - offer.dph_total
        assert host.effective_usd_per_hour == pytest.approx(row["dph_total"] + traffic)
        prices = [json.loads(e.detail) for e in fleet.record.events(host.id) if e.action == "price"]
        assert prices == [{"offer_dph_total": offer.dph_total, "instance_dph_total": row["dph_total"]}]
        await fleet.destroy(None)


async def test_fleet_registers_its_key_on_an_account_with_none_and_again_after_a_delete(
    fresh_cloud, tmp_path, monkeypatch
):
    monkeypatch.setenv("FLEET_LOCALCLOUD_DIR", str(fresh_cloud.info.state_dir))
    async with fresh_cloud.client() as api:
        assert (await api.get("/api/v0/ssh/")).status_code == 404
    async with fleet_for(settings_for(tmp_path)) as fleet:
        assert len((await fleet.up(UpRequest("tiny", "eu"))).ready) == 1
        async with fresh_cloud.client() as api:
            [key] = (await polite(api, "GET", "/api/v0/ssh/")).json()
            await polite(api, "DELETE", f"/api/v0/ssh/{key['id']}/")
        assert len((await fleet.up(UpRequest("tiny", "eu"))).ready) == 1  # a deleted key does not count
        async with fresh_cloud.client() as api:
            keys = (await polite(api, "GET", "/api/v0/ssh/")).json()
        assert [bool(k["deleted_at"]) for k in keys] == [True, False]
        await fleet.destroy(None)


async def test_a_429_storm_is_retried_within_bounds_and_logged(cloud, tmp_path, caplog):
    cloud.set_faults({"rate_limit": {"share": 0.3, "paths": ["/api/v1/instances", "/api/v0/instances"]}})
    async with fleet_for(settings_for(tmp_path)) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu", count=2))
        assert len(result.ready) == 2
        assert sum(fleet.market.pacer.counters.retries.values()) > 0
        cloud.set_faults({})
        await fleet.destroy(None)
    assert any("rate limited (429, 1 in a row); retry" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("retry_after", ["nan", "-5", "1e9", "inf", "soon"])
async def test_a_retry_after_no_client_would_wait_is_none(cloud, retry_after):
    """Security round four: Retry-After was taken as it came: `nan` and a negative were retried forever, `1e9`
    and `inf` waited past rate_limited_wait_s, and the wait stayed in the pacer every process shares. Only a
    finite wait within 0..rate_limited_wait_s is honoured; any other answer is a 429 with no Retry-After."""
    cloud.set_faults({"rate_limit": {"count": 2, "paths": ["/api/v0/users/current"], "retry_after": retry_after}})
    market = VastMarket(f"{cloud.info.url}", cloud.info.api_key(), pacer=Pacer(), rate_limited_wait_s=20.0)
    try:
        started = time.monotonic()
        credit = await asyncio.wait_for(market.credit(), timeout=60)
        assert credit is not None and time.monotonic() - started < 30
        assert market.pacer.counters.rate_limited == {"user": 2}
        assert market.pacer._next["user"] - time.monotonic() < 20  # no wait of 1e9 left for the next caller
    finally:
        cloud.set_faults({})
        await market.close()
    # a wait within bounds is honoured as asked
    cloud.set_faults({"rate_limit": {"count": 1, "paths": ["/api/v0/users/current"], "retry_after": "1.5"}})
    market = VastMarket(f"{cloud.info.url}", cloud.info.api_key(), pacer=Pacer(), rate_limited_wait_s=20.0)
    try:
        started = time.monotonic()
        assert await market.credit() is not None and time.monotonic() - started >= 1.5
    finally:
        cloud.set_faults({})
        await market.close()


def test_a_spent_search_quota_stops_with_one_line_and_buys_nothing(cloud, tmp_path):
    cloud.set_faults({"search_quota_left": 0})
    config = write_config(tmp_path)
    env = {**os.environ, "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir)}
    refused_before = httpx.get(f"{cloud.url}/admin/stats", headers=cloud.headers).json()["rate_limited"]
    done = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "up", "--model", "tiny", "--region", "eu", "--config", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "daily search quota" in lines[0] and "00:00 UTC" in lines[0], done.stderr
    refused = httpx.get(f"{cloud.url}/admin/stats", headers=cloud.headers).json()["rate_limited"] - refused_before
    assert refused == 1  # the search was refused once and not asked again (the quota resets at midnight)
    state = json.loads((cloud.info.state_dir / "state.json").read_text())
    assert state["instances"] == {}


async def test_the_market_client_stops_and_starts_an_instance_keeping_its_disk(cloud, tmp_path):
    # The building block of a standby pool (issue 13): stop keeps the disk (the weights) and releases the GPU,
    # start boots it again on new external ports; both answer at once and the listing catches up later.
    async with fleet_for(settings_for(tmp_path)) as fleet:
        [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        try:
            before = await fleet.market.get(host.instance_id)
            await fleet.market.stop(host.instance_id)
            await fleet.market.stop(host.instance_id)  # idempotent
            # vast.ai says a stop in one of several forms (the local cloud gives each instance one, by its id: the
            # test used to wait for `exited` alone, and passed only on an id that drew it); fleet reads each as stopped
            stopped = await _until(fleet, host.instance_id, "stopped", lambda i: i.stopped)
            assert stopped.status in ("exited", "stopped", "offline"), stopped.status
            assert stopped.intended == "stopped" and stopped.cur_state == "stopped"
            assert stopped.ports == {} and stopped.machine_id == before.machine_id
            await fleet.market.start(host.instance_id)
            running = await _until(fleet, host.instance_id, "running", lambda i: i.status == "running" and i.ports)
            assert running.ports and running.ports != before.ports  # a restarted container is mapped anew
        finally:
            await fleet.destroy(None)
        with pytest.raises(MarketError, match="not found"):
            await fleet.market.stop(host.instance_id)


async def _until(fleet, instance_id: int, what: str, seen: Callable[[Instance], bool], timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        instance = await fleet.market.get(instance_id)
        if instance is not None and seen(instance):
            return instance
        await asyncio.sleep(0.5)
    raise AssertionError(f"instance {instance_id} not {what} after {timeout_s:g}s")


async def test_a_malformed_offer_is_skipped_and_counted_and_the_search_goes_on(cloud, tmp_path):
    """vast.ai round four: one row with `gpu_name` or `num_gpus` null made Offer.from_raw raise for the whole answer,
    so every `fleet up` stopped at the search. The row is skipped and counted in the funnel."""
    settings = settings_for(tmp_path)
    async with fleet_for(settings) as fleet:
        before = await fleet.offers("tiny", "eu")
        broken = [o.id for o in before.passed[:2]]
        async with cloud.client() as api:
            for offer_id, bad in zip(broken, ({"gpu_name": None}, {"num_gpus": None}), strict=True):
                (await api.put(f"/admin/offers/{offer_id}", json=bad)).raise_for_status()
        try:
            after = await fleet.offers("tiny", "eu")
        finally:
            async with cloud.client() as api:
                for offer_id, field in zip(broken, ("gpu_name", "num_gpus"), strict=True):
                    good = next(o for o in before.passed if o.id == offer_id)
                    (await api.put(f"/admin/offers/{offer_id}", json={field: good.raw[field]})).raise_for_status()
    assert ("malformed offer (its row skipped)", 2) in after.removed
    assert after.seen == before.seen and {o.id for o in after.passed} == {o.id for o in before.passed} - set(broken)
