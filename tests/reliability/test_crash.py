"""Crash anywhere: `fleet up`, `fleet destroy` and `fleet reprice` are SIGKILLed at each boundary in turn
(FLEET_CRASH_AT, fleet/core/failpoints.py). Then `fleet reconcile` and `fleet destroy --all` leave nothing running
at the marketplace and no host process, every instance ever made is in the record with its end and its
cost, and no intent bought twice."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fleet.localcloud.catalog import load_offers
from tests.fleetkit import ROOT, write_config
from tests.reliability.invariants import settled

UP = ["up", "--model", "tiny", "--region", "eu"]


def fleet(tmp_path: Path, cloud, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "FLEET_CONFIG": str(tmp_path / "fleet.toml"),
        "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir),
    }
    env.pop("FLEET_CRASH_AT", None)
    if crash_at:
        env["FLEET_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, "-m", "fleet.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def config(tmp_path):
    # vast.ai's read lag here is 3 s: a create that left and was never answered is concluded after 10
    write_config(tmp_path, timeouts={"instance_visible": 10})
    return tmp_path


@pytest.fixture
def cloud(fresh_cloud):
    """A cloud of the test's own: its books hold only this test's instances."""
    return fresh_cloud


def settle_and_check(tmp_path: Path, cloud) -> None:
    reconciled = fleet(tmp_path, cloud, "reconcile")
    assert reconciled.returncode == 0, reconciled.stderr
    destroyed = fleet(tmp_path, cloud, "destroy", "--all", "--yes")
    assert destroyed.returncode == 0, destroyed.stdout + destroyed.stderr
    findings = settled(cloud.info.state_dir, [tmp_path / "fleet.db"])
    assert findings.clean(), findings


@pytest.mark.parametrize(
    "point", ["after_intent", "create_sent", "create_answered", "after_create", "mid_pull", "after_start"]
)
def test_a_crash_of_up_at_each_boundary_is_settled(config, cloud, point):
    crashed = fleet(config, cloud, *UP, crash_at=point)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    settle_and_check(config, cloud)


def test_a_crash_of_destroy_between_the_call_and_the_record_is_settled(config, cloud):
    assert fleet(config, cloud, *UP).returncode == 0
    crashed = fleet(config, cloud, "destroy", "--all", "--yes", crash_at="mid_destroy")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    settle_and_check(config, cloud)


def test_a_crash_of_standby_mid_stop_lands_in_the_pool_and_is_settled(config, cloud):
    # the stop was answered, the record says STOPPING: reconcile sees the instance stopped and puts the host in
    # the pool (still ours, still billed for its disk), and the costs add up across its running and stopped time
    crashed = fleet(config, cloud, "standby", "--model", "tiny", "--region", "eu", crash_at="mid_stop")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    for _ in range(50):  # the local cloud stops it a moment after answering
        if next(iter(cloud.state()["instances"].values()))["cur_state"] == "stopped":
            break
        time.sleep(0.2)
    reconciled = fleet(config, cloud, "reconcile", "--json")
    assert reconciled.returncode == 0, reconciled.stderr
    [host] = json.loads(fleet(config, cloud, "status", "--json").stdout)
    assert host["state"] == "standby"
    settle_and_check(config, cloud)


@pytest.mark.parametrize("point", ["after_start", "mid_destroy"])
def test_a_crash_of_reprice_mid_move_is_settled(config, cloud, point):
    assert fleet(config, cloud, *UP).returncode == 0
    offers = fleet(config, cloud, "offers", "--model", "tiny", "--region", "eu", "--json")
    target = json.loads(offers.stdout)["offers"][-1]["id"]
    original = next(o for o in load_offers(ROOT / "offers") if o["id"] == target)["dph_base"]
    put_offer(cloud, target, {"dph_base": 0.001})  # a move worth making
    try:
        crashed = fleet(config, cloud, "reprice", crash_at=point)
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr
        settle_and_check(config, cloud)
    finally:
        put_offer(cloud, target, {"dph_base": original})


def put_offer(cloud, offer_id: int, fields: dict) -> None:
    r = httpx.put(f"{cloud.url}/admin/offers/{offer_id}", json=fields, headers=cloud.headers, timeout=10)
    r.raise_for_status()
