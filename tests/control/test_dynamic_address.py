"""Machines on a dynamic public address (vast.ai's `static_ip: false`; the instance's PUBLIC_IPADDR "is not
updated if the IP changes"): a filter and a rank for a fixed address, and a host whose address changed under
it replaced without blaming its machine."""

import asyncio
import dataclasses
import json
import time

import pytest

from fleet.control import healthcheck, rotation
from fleet.control.up import UpRequest
from fleet.core.config import Filters
from fleet.core.models import HostState
from fleet.economics.offers import funnel, query_for
from fleet.localcloud import catalog, network
from fleet.market import Offer
from fleet.market.search import search_filters
from tests.economics.test_offers import CRITERIA, PROFILE, offer
from tests.fleetkit import ROOT, fleet_for, settings_for
from tests.helpers import listed_instances


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


def test_static_ip_only_asks_the_marketplace_for_fixed_addresses_and_checks_each_again():
    rows = json.loads((ROOT / "offers" / "real-vast-a100-sxm4-2026.json").read_text())
    parsed = [Offer.from_raw(row) for row in rows]
    assert 0 < sum(o.static_ip for o in parsed) == sum(row.get("static_ip") is True for row in rows) < len(rows)
    strict = dataclasses.replace(CRITERIA, filters=Filters(static_ip_only=True))
    query = query_for(strict, PROFILE)
    assert query.static_ip_only and search_filters(query)["static_ip"] == {"eq": True}
    assert not query_for(CRITERIA, PROFILE).static_ip_only  # off unless asked
    answered = catalog.search(rows, {"static_ip": {"eq": True}, "limit": 1000}, {})
    assert answered and all(row["static_ip"] is True for row in answered)
    result = funnel([offer(1, static_ip=False), offer(2, static_ip=True)], strict, PROFILE)
    assert [o.id for o in result.passed] == [2] and ("static IP", 1) in result.removed


def test_at_the_same_price_a_fixed_address_ranks_first_and_a_cheaper_dynamic_one_still_wins():
    dynamic, fixed = offer(1, static_ip=False), offer(2, static_ip=True, dph_total=offer(1).dph_total)
    assert [o.id for o in funnel([dynamic, fixed], CRITERIA, PROFILE).passed] == [2, 1]
    cheaper = offer(3, static_ip=False, dph_total=fixed.dph_total - 0.01)
    assert [o.id for o in funnel([fixed, cheaper], CRITERIA, PROFILE).passed] == [3, 2]
    strict = dataclasses.replace(CRITERIA, filters=Filters(static_ip_only=True))
    assert [o.id for o in funnel([fixed, cheaper], strict, PROFILE).passed] == [2]


async def test_a_host_whose_address_changed_is_replaced_and_its_machine_not_blamed(cloud, tmp_path):
    settings = settings_for(tmp_path, rotation={"unhealthy_after_sweeps": 2})
    async with fleet_for(settings) as fleet:
        [old] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        try:
            cloud.set_faults({"address_change": [old.machine_id]})
            deadline = time.monotonic() + 60
            async with cloud.client() as api:
                while not [i for i in await listed_instances(api) if i["public_ipaddr"] == network.MOVED_HOST]:
                    assert time.monotonic() < deadline, "the local cloud did not move the address"
                    await asyncio.sleep(0.3)
            [report] = await rotation.health_sweep(fleet)  # the first sweep that reads it: nothing goes there now
            assert not report.healthy and report.reason.startswith(healthcheck.ADDRESS_CHANGED), report.reason
            assert not report.blame and report.replaced_by is not None
            assert fleet.record.blacklist() == []  # the machine did nothing wrong
            assert fleet.record.hosts(names=[old.name])[0].state == HostState.DESTROYED
            [new] = fleet.record.hosts(states=(HostState.READY,))
            assert new.name == report.replaced_by
        finally:
            cloud.set_faults({})
            await fleet.destroy(None)
