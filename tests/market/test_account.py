"""The account fleet rents with, as vast.ai answers for it, on the strict local cloud: a wrong key (the search
answers it with a 404), scoped keys (no `misc`, no `user_write`), the credit (read from `balance`, spent before
and during a session) and a second install of fleet on the same account."""

import asyncio
import time

import pytest

from fleet.control import rotation
from fleet.control.account import check_credit
from fleet.control.up import UpRequest
from fleet.core.models import HostState
from fleet.market import AuthError, CreditSpent, MarketError
from fleet.market.vast import VastMarket
from fleet.market.watch import InstanceWatch
from tests.fleetkit import fleet_for, settings_for
from tests.helpers import listed_instances, polite


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


async def test_a_wrong_key_is_a_key_problem_on_the_search_that_answers_it_with_a_404(cloud, tmp_path):
    """vast.ai's search answers a wrong key with a 404: fleet reads its `auth_error` as the key refused, not gone."""
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


async def test_a_key_without_user_write_attaches_fleets_key_to_each_instance(cloud, tmp_path):
    """A key without `user_write` cannot add fleet's SSH key to the account: fleet attaches it to each instance."""
    scoped = "scoped-key-5c1d8e2f9a7b4e3c"
    cloud.set_faults({"scoped_keys": {scoped: ["instance_read", "instance_write", "user_read", "misc"]}})
    try:
        async with fleet_for(settings_for(tmp_path)) as fleet:
            await fleet.watch.close()
            await fleet.market.close()
            fleet.market = VastMarket(fleet.market.url, scoped)
            fleet.watch = InstanceWatch(fleet.market)
            with pytest.raises(MarketError, match="user_write"):
                await fleet.market.ensure_ssh_key(fleet.ssh_key.public)
            [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready  # reached over SSH with the attached key
            assert fleet.key_per_instance and host.host_key
            await fleet.destroy(None)
            await fleet.market.close()
    finally:
        cloud.set_faults({})


async def test_the_credit_is_read_from_the_balance_when_the_answer_names_no_credit(cloud, tmp_path):
    """vast.ai's account answer names `balance` and no `credit` (show_user.yaml): fleet reads the credit there."""
    async with cloud.client() as api:
        user = (await polite(api, "GET", "/api/v0/users/current")).json()
    assert "credit" not in user and user["balance"] > 0  # show_user.yaml's fields
    async with fleet_for(settings_for(tmp_path)) as fleet:
        credit = await fleet.market.credit()
    assert credit is not None and abs(credit - user["balance"]) < 0.01


async def test_spent_credit_stops_up_with_one_line_and_creates_nothing(cloud, tmp_path):
    """vast.ai rents nothing once the credit is spent: fleet reads it first and stops in one line, creating nothing."""
    cloud.set_faults({"credit_usd": -0.5})
    try:
        async with fleet_for(settings_for(tmp_path)) as fleet:
            with pytest.raises(CreditSpent, match="credit is spent"):
                await fleet.up(UpRequest("tiny", "eu"))
            assert fleet.record.hosts() == []
            credit = await check_credit(fleet)
            assert credit.usd is not None and credit.usd < 0 and credit.warn
        async with cloud.client() as api:
            assert await listed_instances(api) == []
    finally:
        cloud.set_faults({})


async def test_credit_spent_mid_session_stops_the_host_and_blames_no_machine(cloud, tmp_path):
    """vast.ai stops every instance when the credit runs out: the host is retired and no machine is blamed."""
    async with fleet_for(settings_for(tmp_path, rotation={"unhealthy_after_sweeps": 1})) as fleet:
        [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        async with cloud.client() as api:
            spent = 100.0 - (await api.get("/api/v0/users/current")).json()["balance"]
        cloud.set_faults({"credit_usd": spent + 1e-6})  # what is left runs out in a moment
        try:
            deadline = time.monotonic() + 60
            while (instance := await fleet.market.get(host.instance_id)) is None or not instance.stopped:
                assert time.monotonic() < deadline, "vast.ai did not stop the instance"
                await asyncio.sleep(0.5)
            assert "credit" in (instance.status_msg or "")
            [report] = await rotation.health_sweep(fleet)  # no replacement can be rented without credit
            assert not report.healthy and not report.blame and report.replaced_by is None
            # retired all the same (a stopped host serves no one), and no machine blamed: the account's doing
            assert fleet.record.host(host.id).state == HostState.DESTROYED
            assert fleet.record.blacklist() == []
            assert fleet.endpoints() == []
        finally:
            cloud.set_faults({})
            await fleet.destroy(None)


async def test_a_second_install_on_the_same_account_never_takes_the_others_hosts(cloud, tmp_path):
    """Two installs of fleet on one account: each reconcile takes only its own install's strays, never the other's."""
    laptop, daemon = settings_for(tmp_path / "laptop"), settings_for(tmp_path / "daemon")
    async with fleet_for(laptop) as a, fleet_for(daemon) as b:
        assert a.label_prefix != b.label_prefix and a.label_prefix.startswith("fleet:")
        [mine] = (await a.up(UpRequest("tiny", "eu"))).ready
        [theirs] = (await b.up(UpRequest("tiny", "eu"))).ready
        try:
            assert (await a.reconcile())["strays_destroyed"] == []
            assert (await b.reconcile())["strays_destroyed"] == []
            for fleet, host in ((a, mine), (b, theirs)):
                instance = await fleet.market.get(host.instance_id)
                assert instance is not None and instance.status == "running"
        finally:
            await a.destroy(None)
            await b.destroy(None)
