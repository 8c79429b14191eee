"""Hosts that lie or die. A changed SSH host key is refused and flagged. A host that goes offline mid-pull,
a pull that never progresses, a llama-server that dies loading its model and one that never answers /health:
each ends in a destroyed, blacklisted machine and the next offer, within its phase's timeout."""

import asyncio
from pathlib import Path

import pytest

from fleet.control import thermal
from fleet.control.up import UpRequest
from fleet.core.models import HostState
from fleet.host.remote import HostKeyMismatch
from fleet.localcloud import control
from tests.conftest import CloudHandle, _stop_and_check
from tests.fleetkit import first_machine, fleet_for, settings_for, with_variant
from tests.helpers import listed_instances


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


async def up_under(cloud, fleet, faults: dict):
    """`fleet up` of one tiny host with `faults` set on the local cloud, cleared after."""
    cloud.set_faults(faults)
    try:
        return await fleet.up(UpRequest("tiny", "eu"))
    finally:
        cloud.set_faults({})


async def assert_next_offer_served(fleet, result, machine: int, phase: str, words: str, within_s: float) -> None:
    failed, ready = result.attempts
    assert (failed.machine_id, failed.phase) == (machine, phase) and words in failed.reason, failed
    assert failed.seconds < within_s, failed.seconds
    assert ready.outcome == "ready" and ready.machine_id != machine
    assert [b.machine_id for b in fleet.record.blacklist()] == [machine]
    lost = fleet.record.hosts(names=[failed.host])[0]
    assert lost.state == HostState.FAILED and lost.destroyed_at is not None


async def test_a_changed_host_key_is_refused_flagged_and_the_host_replaced(cloud, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        host = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        cloud.set_faults({"host_key_change": [host.machine_id]})
        await asyncio.sleep(1.0)  # the host's sshd restarts on a new key
        with pytest.raises(HostKeyMismatch):
            await fleet.probe(host.name, only=["thermal"])
        assert [e.action for e in fleet.record.events(host.id) if e.kind == "error"] == ["host_key"]
        assert [b.machine_id for b in fleet.record.blacklist()] == [host.machine_id]
        [report] = await thermal.thermal_sweep(fleet)  # the daemon's re-probe replaces it
        assert not report.healthy and "host key changed" in report.reason and report.replaced_by
        assert fleet.record.hosts(names=[host.name])[0].state == HostState.DESTROYED
        await fleet.destroy(None)


@pytest.fixture
def slow_hub_cloud(tmp_path: Path, llama_server, monkeypatch) -> CloudHandle:
    """A strict cloud whose hub sends 50 kB/s a connection: the tiny model takes ten seconds to pull."""
    info = control.start(tmp_path / "slowcloud", provision_delay_s=0.3, loading_delay_s=0.2, hub_bytes_per_s=50_000)
    handle = CloudHandle(info)
    monkeypatch.setenv("FLEET_LOCALCLOUD_DIR", str(info.state_dir))
    yield handle
    _stop_and_check(handle)


async def test_a_host_that_goes_offline_mid_pull(slow_hub_cloud, tmp_path):
    settings = settings_for(tmp_path, up={"pull_connections": 1})
    machine = await first_machine(settings)
    async with fleet_for(settings) as fleet:
        up = asyncio.create_task(fleet.up(UpRequest("tiny", "eu")))
        # offline once its pull is under way, however long the steps before it took on this machine
        while not any(h.machine_id == machine and h.state == HostState.PULLING for h in fleet.record.hosts()):
            assert not up.done(), up.result()
            await asyncio.sleep(0.05)
        slow_hub_cloud.set_faults({"offline_after_s": {str(machine): 0.0}})
        result = await up
        await assert_next_offer_served(fleet, result, machine, "pull", "", within_s=settings.timeouts.pull)
        await fleet.destroy(None)
    async with slow_hub_cloud.client() as api:
        assert await listed_instances(api) == []


async def test_a_pull_that_never_progresses_fails_at_its_stall_limit(cloud, tmp_path):
    settings = settings_for(tmp_path, up={"pull_connections": 1}, timeouts={"pull_stall": 4.0, "pull": 60.0})
    machine = await first_machine(settings)
    cloud.set_faults({"pull_stall": {"files": ["tiny-llama-bytes.gguf"], "count": 1}})
    async with fleet_for(settings) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        await assert_next_offer_served(fleet, result, machine, "pull", "no progress for 4s", within_s=30)
        await fleet.destroy(None)


async def test_a_server_that_dies_loading_its_model(cloud, tmp_path):
    settings = with_variant(
        settings_for(tmp_path, up={"max_attempts": 2}), "tiny-broken-file", file="tiny-llama-truncated.gguf"
    )
    async with fleet_for(settings) as fleet:
        result = await fleet.up(UpRequest("tiny-broken-file", "eu"))
        assert result.ready == [] and [a.phase for a in result.attempts] == ["start", "start"]
        # the server's own words: it failed as it died, not at timeouts.load
        assert all("failed to load model" in a.reason for a in result.attempts)
        assert len({b.machine_id for b in fleet.record.blacklist()}) == 2
        assert all(h.destroyed_at is not None for h in fleet.record.hosts())


async def test_a_server_that_never_answers_health(cloud, tmp_path):
    settings = settings_for(tmp_path, timeouts={"load": 10.0})
    machine = await first_machine(settings)
    cloud.set_faults({"freeze_server": [machine]})
    async with fleet_for(settings) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        await assert_next_offer_served(fleet, result, machine, "start", "timeouts.load", within_s=30)
        await fleet.destroy(None)


async def test_a_listing_that_names_another_hosts_place_gets_no_certificate_there(cloud, tmp_path):
    """A machine whose listing names the ports of a host fleet already serves on: its port check reaches the
    other host, which answers with its own certificate, so the machine is refused before a pull, and fleet's CA
    signs nothing for that place (the liar's certificate would name it; `certificate.refuse_held` stays behind
    the check); the machine is left for the next offer, and the host that serves there is untouched."""
    settings = settings_for(tmp_path)
    async with fleet_for(settings) as fleet:
        first = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        machine = await first_machine(settings)  # the next machine fleet would rent
        result = await up_under(cloud, fleet, {"lying_ports": {machine: first.instance_id}})
        await assert_next_offer_served(fleet, result, machine, "connect", "answers with another certificate", 60)
        refused = fleet.record.hosts(names=[result.attempts[0].host])[0]
        assert refused.api_url is None and refused.pulled_at is None  # no certificate, no pull
        [smoke] = await fleet.probe(first.name, only=["smoke"])
        assert smoke.passed, smoke.diagnosis
        await fleet.destroy(None)


async def test_a_machine_whose_listed_ports_lead_nowhere_is_refused_before_the_pull(cloud, tmp_path):
    """Direct ports listed and unreachable (SkyPilot meets them): the host's port check, through the listed
    service port, gets no answer, so the machine is blamed before a byte of the weights is paid for."""
    settings = settings_for(tmp_path, timeouts={"port_check": 8})
    async with fleet_for(settings) as fleet:
        machine = await first_machine(settings)
        result = await up_under(cloud, fleet, {"unreachable_ports": [machine]})
        await assert_next_offer_served(fleet, result, machine, "connect", "does not lead to the host within 8s", 120)
        refused = fleet.record.hosts(names=[result.attempts[0].host])[0]
        assert refused.pulled_at is None and not refused.pulled_bytes
        await fleet.destroy(None)
