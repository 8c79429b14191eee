"""vast.ai as it really is, round four (issue 46), on the strict local cloud: a wrong key that the search
answers with a 404, a destroy answered `success: false`, an account whose answer names its `balance` and no
`credit`, the create call's body as vast.ai's own SDK sends it, writes by id inside a new instance's read lag,
and a stopped instance's GPU that another renter takes."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleet.core.models import utcnow
from fleet.host import teardown
from fleet.market import AuthError, MarketError
from fleet.market.vast import VastMarket
from fleet.market.watch import InstanceWatch
from tests.fleetkit import fleet_for, settings_for
from tests.helpers import cheapest_offer, destroy, polite, rent, shown, wait_status


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


async def test_a_wrong_key_is_a_key_problem_on_the_search_that_answers_it_with_a_404(cloud, tmp_path):
    async with cloud.client() as api:
        r = await api.post("/api/v0/bundles/", json={"limit": 1}, headers={"Authorization": "Bearer wrong"})
        assert (r.status_code, r.json()["error"], r.json()["msg"]) == (404, "auth_error", "Invalid user key")
        r = await api.get("/api/v0/users/current", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401  # the rest answer a 401, as show_instance.yaml says
    async with fleet_for(settings_for(tmp_path)) as fleet:
        await fleet.watch.close()
        await fleet.market.close()
        fleet.market = VastMarket(fleet.market.url, "wrong")
        fleet.watch = InstanceWatch(fleet.market)
        with pytest.raises(AuthError, match="refused the API key: Invalid user key"):
            await fleet.offers("tiny", "eu")
        with pytest.raises(AuthError):
            await fleet.market.credit()


async def test_a_destroy_answered_success_false_is_a_refusal_and_the_instance_stays(cloud, tmp_path):
    async with cloud.client() as api:
        offer = await cheapest_offer(api)
        instance_id = await rent(api, offer["id"], label="fleet-test:refused")
    cloud.set_faults({"destroy_refused": 1})
    try:
        async with fleet_for(settings_for(tmp_path)) as fleet:
            deadline = time.monotonic() + 30
            while await fleet.market.get(instance_id) is None:  # reads lag a create
                assert time.monotonic() < deadline
                await asyncio.sleep(0.5)
            with pytest.raises(MarketError, match=f"instance {instance_id}: destroy refused: .*could not be destroyed"):
                await fleet.market.destroy(instance_id)
            assert await fleet.market.get(instance_id) is not None  # it is there, and bills
            await fleet.market.destroy(instance_id)  # the next one is done
            assert await fleet.market.get(instance_id) is None
            await fleet.market.destroy(instance_id)  # and one of an instance already gone is too
    finally:
        cloud.set_faults({})


async def test_the_credit_is_read_from_the_balance_when_the_answer_names_no_credit(cloud, tmp_path):
    async with cloud.client() as api:
        user = (await polite(api, "GET", "/api/v0/users/current")).json()
    assert "credit" not in user and user["balance"] > 0  # show_user.yaml's fields
    async with fleet_for(settings_for(tmp_path)) as fleet:
        credit = await fleet.market.credit()
    assert credit is not None and abs(credit - user["balance"]) < 0.01


async def test_writes_by_id_inside_a_new_instances_read_lag_are_not_found_and_fleets_destroy_waits_them_out(
    cloud, tmp_path
):
    """vast.ai's writes by id lag a create as its reads do (the harder reading): a destroy, a stop or an attached
    key right after create answer "not found". fleet's destroy asks again for timeouts.instance_visible: a 404
    there once read as gone, and a create that answered an error naming its contract, or a Ctrl-C right after
    one, left an instance billing."""
    cloud.set_faults({"read_lag_s": 8.0})
    try:
        async with fleet_for(settings_for(tmp_path)) as fleet, cloud.client() as api:
            offer = await cheapest_offer(api)
            sent = utcnow()
            instance_id = await rent(api, offer["id"], label=f"{fleet.label_prefix}lagged")
            gone = await polite(api, "DELETE", f"/api/v0/instances/{instance_id}/", json={})
            stop = await polite(api, "PUT", f"/api/v0/instances/{instance_id}/", json={"state": "stopped"})
            key = await polite(
                api, "POST", f"/api/v0/instances/{instance_id}/ssh/", json={"ssh_key": fleet.ssh_key.public}
            )
            assert (gone.status_code, stop.status_code, key.status_code) == (404, 404, 404)
            assert await shown(api, instance_id) is None  # all three inside the lag: it is not shown yet either
            assert await fleet.market.destroy(instance_id) is False  # "no such instance", read as such
            assert str(instance_id) in cloud.state()["instances"]  # ... while it is there, and bills
            await teardown.destroy_known(fleet, instance_id, sent)
            assert str(instance_id) not in cloud.state()["instances"]
    finally:
        cloud.set_faults({})


async def test_a_stopped_instance_holds_no_gpu_and_its_start_waits_while_another_renter_has_it(cloud):
    """ "Stopped instances have no GPU reservation": the offer under a stopped instance is rentable again, anyone
    may take it, and a start then waits in `scheduling` until that renter lets the GPU go."""
    async with cloud.client() as api:
        offer = await cheapest_offer(api)
        mine = await rent(api, offer["id"], label="other:stopped")
        others = None
        try:
            await wait_status(api, mine, "running", timeout_s=60)
            r = await polite(api, "PUT", f"/api/v0/instances/{mine}/", json={"state": "stopped"})
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 60
            while (row := await shown(api, mine)) is None or row["cur_state"] != "stopped":
                assert time.monotonic() < deadline, row
                await asyncio.sleep(0.5)
            again = await cheapest_offer(api, machine_id={"eq": offer["machine_id"]})
            assert again["id"] == offer["id"] and again["rentable"] is True
            others = await rent(api, offer["id"], label="other:took-the-gpu")
            await wait_status(api, others, "running", timeout_s=60)
            r = await polite(api, "PUT", f"/api/v0/instances/{mine}/", json={"state": "running"})
            assert r.status_code == 200, r.text
            for _ in range(3):  # the other renter holds the GPU: no start
                await asyncio.sleep(1.0)
                assert (await shown(api, mine))["actual_status"] == "scheduling"
            await destroy(api, others)
            others = None
            await wait_status(api, mine, "running", timeout_s=60)
        finally:
            if others is not None:
                await destroy(api, others)
            await destroy(api, mine)
