"""The local cloud with simulated hosts (issue 48): fleet's own `up`, health sweep and `destroy` rent, bring up,
check and end hosts that run no process, through the same REST API, SSH and HTTPS as real ones."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleet.control import rotation
from fleet.control.up import UpRequest
from fleet.localcloud import control, procs
from tests.conftest import CloudHandle, _start, _stop_and_check
from tests.fleetkit import fleet_for, settings_for


@pytest.fixture(scope="module")
def simulated_cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CloudHandle]:
    handle = _start(tmp_path_factory.mktemp("simcloud"), simulated_card="a4b")
    try:
        yield handle
    finally:
        _stop_and_check(handle)


async def test_fleet_up_sweep_and_destroy_run_unchanged_on_simulated_hosts(simulated_cloud, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEET_LOCALCLOUD_DIR", str(simulated_cloud.info.state_dir))
    async with fleet_for(settings_for(tmp_path)) as fleet:
        report = await fleet.up(UpRequest("tiny", "eu", count=2))
        assert len(report.ready) == 2, report.failures
        for host in report.ready:
            token = simulated_cloud.state()["instances"][str(host.instance_id)]["token"]
            assert procs.pids_with_marker(token) == []  # no sshd, no llama-server: the cloud plays them
            async with fleet.server(host).client(timeout=30) as client:
                reply = await client.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
                )
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
        reports = await rotation.health_sweep(fleet)
        assert [r.healthy for r in reports] == [True, True], [r.reason for r in reports]
        for recorded in fleet.record.hosts(names=[h.name for h in report.ready]):
            assert recorded.ram_available_mib and recorded.server_rss_mib, recorded  # the memory read, answered
        ended = await fleet.destroy(None)
        assert len(ended.done) == 2
    state = simulated_cloud.state()
    assert all(i.get("status") != "running" for i in state["instances"].values())
    assert not any((Path(simulated_cloud.info.state_dir) / "hosts").glob("*/root"))


def test_a_card_the_results_never_measured_is_refused_and_no_cloud_runs(tmp_path):
    with pytest.raises(control.CloudControlError, match="exited with status 2"):
        control.start(tmp_path / "cloud", simulated_card="h100-of-my-dreams")
    assert "invalid choice: 'h100-of-my-dreams'" in (tmp_path / "cloud" / "server.log").read_text()
    assert control.find(tmp_path / "cloud") is None


STEPS = [None, "scheduling", "created", "loading", "running"]  # a boot's statuses, in their order


def test_each_answer_finds_the_state_on_disk_as_it_shows_it_and_unasked_changes_follow(tmp_path):
    """issue 48: the cloud writes its state once for the changes of many hosts (at 1,000 hosts, a write for each
    change took most of its CPU), never behind what it has answered: each answer finds state.json saying what it
    shows, and a boot's steps, which no call asked for, reach the file with no call made."""
    handle = _start(tmp_path / "cloud", kind=True, simulated_card="a4b")
    api = httpx.Client(base_url=handle.url, headers=handle.headers, timeout=30)
    try:
        offers = api.post("/api/v0/bundles/", json={"order": [["dph_total", "asc"]]}).json()["offers"]
        created = []
        for offer in offers[:4]:
            new = api.put(f"/api/v0/asks/{offer['id']}/", json={"image": "x", "disk": 20}).json()["new_contract"]
            assert str(new) in handle.state()["instances"]  # on disk when the create's answer came
            created.append(new)
        shown: set[tuple[int, str | None]] = set()
        while len({i for i, status in shown if status == "running"}) < len(created[:2]):
            for instance_id in created[:2]:
                row = api.get(f"/api/v0/instances/{instance_id}/").json()["instances"]
                on_disk = handle.state()["instances"][str(instance_id)]
                # never behind the answer (a boot step written since may put it ahead)
                assert STEPS.index(on_disk["status"]) >= STEPS.index(row["actual_status"]), (on_disk, row)
                shown.add((instance_id, row["actual_status"]))
        assert len(shown) > 2 * 2  # the answers saw the boots' steps, not only their ends
        looks = 0  # the other two are never asked about: the file follows their boots unasked
        while any(handle.state()["instances"][str(i)]["status"] != "running" for i in created[2:]) and looks < 5000:
            time.sleep(0.01)
            looks += 1
        assert all(handle.state()["instances"][str(i)]["status"] == "running" for i in created[2:])
        api.delete(f"/api/v0/instances/{created[0]}/").raise_for_status()
        assert str(created[0]) not in handle.state()["instances"]
    finally:
        api.close()
        _stop_and_check(handle)
