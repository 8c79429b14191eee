"""A profile that fills its card (fill_card): each host gets as many slots as its plan fits on the card it
rented, -np and -c follow, and the record, the server and a resumed standby host agree."""

from pathlib import Path

import httpx
import pytest

from fleet.control.up import UpRequest
from fleet.core import config
from fleet.engines import registry
from fleet.host.profile import sized
from tests.fleetkit import fleet_for, settings_for


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    return local_cloud_env


def test_a_profile_that_fills_its_card_is_checked_at_load(tmp_path):
    tiny = registry.load(Path(__file__).resolve().parents[2] / "fleet.toml").profile("tiny")
    wide = sized(tiny, 6)
    assert wide.slots == 6 and wide.args[wide.args.index("-np") + 1] == "6"
    assert wide.args[wide.args.index("-c") + 1] == str(6 * tiny.ctx_per_slot)
    assert sized(tiny, tiny.slots) is tiny
    for update, says in (
        ({"args": ["-t", "1"]}, "must give -np and -c"),
        ({"max_slots": 0}, "greater than or equal to 1"),
    ):
        with pytest.raises(ValueError, match=says):
            registry.check_profile(config.Profile(**{**tiny.model_dump(), "fill_card": True, **update}))
    two = {**tiny.model_dump(), "fill_card": True, "slots": 2, "args": sized(tiny, 2).args}
    with pytest.raises(ValueError, match="fewer than slots"):
        config.Profile(**{**two, "max_slots": 1})


async def test_a_host_gets_the_slots_its_card_holds_up_to_max_slots(tmp_path):
    settings = settings_for(tmp_path)
    tiny = settings.models["tiny"]
    filling = tiny.model_copy(update={"name": "tinyfill", "fill_card": True, "max_slots": 5})
    settings = settings.model_copy(update={"models": {**settings.models, "tinyfill": filling}})
    async with fleet_for(settings) as fleet:

        async def slots_served(host) -> tuple[int, int]:
            async with httpx.AsyncClient(verify=fleet.tls, timeout=30) as c:
                auth = {"Authorization": f"Bearer {fleet.api_key(host)}"}
                props = (await c.get(f"{host.api_url}/props", headers=auth)).json()
            return props["total_slots"], props["default_generation_settings"]["n_ctx"]

        try:
            host = (await fleet.up(UpRequest("tinyfill", "eu"))).ready[0]
            served = await slots_served(host)
            [row] = fleet.record.hosts(names=[host.name])
            # a standby host, resumed, serves the slots it was rented with
            pooled = (await fleet.up(UpRequest("tinyfill", "eu", standby=True))).ready[0]
            resumed = (await fleet.up(UpRequest("tinyfill", "eu"))).ready[0]
            again = await slots_served(resumed)
        finally:
            await fleet.destroy(None)
    # the tiny model's cache is small beside any card: the plan fits far more, max_slots stops at 5
    assert row.slots == 5 and served == (5, tiny.ctx_per_slot)
    assert resumed.name == pooled.name and again == (5, tiny.ctx_per_slot)
