"""An instance's end as vast.ai answers it, on the strict local cloud: gone in each of its forms after a destroy,
error bodies of every shape, a destroy answered `success: false`, and writes by id inside a new instance's read
lag. fleet reads each answer for what it says: gone only when the instance is."""

import asyncio
import time

import pytest

from fleet.core.models import utcnow
from fleet.host import teardown
from fleet.market import MarketError
from tests.fleetkit import fleet_for, settings_for
from tests.helpers import cheapest_offer, destroy, polite, rent, shown


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


async def test_show_after_destroy_in_each_of_its_forms_reads_as_gone(cloud, tmp_path):
    # null, a 404, or the instance's last row saying `destroyed` (vast-cli's fixtures): all three, by id
    """vast.ai shows a destroyed instance in three forms: fleet's get and listing read each as gone, before parsing."""
    async with cloud.client() as api:
        offer = await cheapest_offer(api)
        ids = []
        for _ in range(3):  # three ids in a row: one of each form
            ids.append(await rent(api, offer["id"], label="other:x"))
            await destroy(api, ids[-1])
        forms = set()
        for instance_id in ids:
            r = await polite(api, "GET", f"/api/v0/instances/{instance_id}/")
            row = r.json().get("instances") if r.status_code == 200 else None
            forms.add("404" if r.status_code == 404 else "null" if row is None else row["actual_status"])
    assert forms == {"404", "null", "destroyed"}
    async with fleet_for(settings_for(tmp_path)) as fleet:
        assert [await fleet.market.get(i) for i in ids] == [None, None, None]
        report = await fleet.reconcile()  # nothing of its own, and no raise on the destroyed row
        assert report["strays_destroyed"] == []


async def test_error_bodies_of_every_shape_are_read_by_their_status(cloud, tmp_path):
    """vast.ai's error bodies omit `success`, carry `message` alone, or are plain text: fleet reads them by status."""
    async with fleet_for(settings_for(tmp_path)) as fleet, cloud.client() as api:
        offer = await cheapest_offer(api)
        gone = await rent(api, offer["id"], label="other:gone")
        await destroy(api, gone)
        again = await polite(api, "DELETE", f"/api/v0/instances/{gone}/", json={})
        assert again.status_code == 404 and "success" not in again.json()  # no `success`
        await fleet.market.destroy(gone)  # idempotent: a 404 is gone, whatever the body says
        text = await polite(api, "POST", f"/api/v0/instances/{gone}/ssh/", json={"ssh_key": fleet.ssh_key.public})
        assert text.status_code == 404 and text.headers["Content-Type"].startswith("text/plain")
        with pytest.raises(MarketError, match="Not Found"):
            await fleet.market.attach_ssh_key(gone, fleet.ssh_key.public)  # a plain-text body, no crash
        missing = await polite(api, "DELETE", "/api/v0/ssh/999999/")
        assert missing.status_code == 404 and set(missing.json()) == {"message"}  # only `message`


async def test_a_destroy_answered_success_false_is_a_refusal_and_the_instance_stays(cloud, tmp_path):
    """A destroy answered `success: false` destroyed nothing: fleet used to take it as done, the instance billing on."""
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
