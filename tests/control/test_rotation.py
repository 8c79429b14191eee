"""Rotation on the local cloud: health sweeps, repricing, make-before-break replacement, the endpoints
file, and a client that follows the endpoints through all of it."""

import asyncio
import json
import sqlite3
import ssl
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from fleet.control import rotation, thermal
from fleet.control.up import UpRequest
from fleet.core.config import Traffic
from fleet.core.models import Host, HostState, utcnow
from fleet.host.ops import parse_memory
from fleet.host.remote import RemoteError
from tests.fleetkit import fleet_for, settings_for
from tests.helpers import kill_llama_server, listed_instances, polite, sag_after_first_reply, sag_was_set


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


def host(**kw) -> Host:
    base = dict(
        name="h",
        run_id="r",
        model="tiny",
        region="eu",
        provider_url="u",
        label="fleet:h",
        offer_id=1,
        machine_id=1,
        gpu_name="RTX 3090",
        num_gpus=1,
        gpu_ram_mb=24576,
        geolocation="SE",
        dph_total=0.30,
        inet_up_usd_per_gb=0.0,
        inet_down_usd_per_gb=0.0,
        effective_usd_per_hour=0.30,
    )
    return Host(**{**base, **kw})


def test_judge_move_nets_the_cost_of_moving():
    worth = rotation.judge_move(host(), 2, 0.20, 10, 10, bring_up_hours=0.25)
    assert worth.move and worth.saving_percent == pytest.approx(33.33, abs=0.01)
    assert worth.saving_usd_per_month == pytest.approx(0.10 * 730 - 0.5 * 0.25, abs=0.01)
    small = rotation.judge_move(host(), 2, 0.29, 10, 10, bring_up_hours=0.25)
    assert not small.move and "under the thresholds" in small.why
    same = rotation.judge_move(host(), 1, 0.30, 10, 10, bring_up_hours=0.25)
    assert not same.move and "already on the cheapest" in same.why
    none = rotation.judge_move(host(), None, None, 10, 10, bring_up_hours=0.25)
    assert not none.move and none.why == "no passing offer"


def settings_fast(tmp_path, **extra):
    return settings_for(
        tmp_path,
        rotation={
            "drain_timeout_s": 5,
            "unhealthy_after_sweeps": 2,
            "reprice_min_percent": 5,
            "reprice_min_usd_per_month": 1,
            **extra,
        },
    )


class RoundRobinClient:
    """A voice agent's view: reads the endpoints file, sends requests round-robin, fails over to the
    next endpoint when one does not answer. Counts requests that failed on every endpoint."""

    def __init__(self, path) -> None:
        self.path = path
        self.sent = self.failed = self.empty_reads = 0
        self.stop = False
        self.seen_urls: set[str] = set()

    async def run(self) -> None:
        turn = 0
        clients: dict[str, httpx.AsyncClient] = {}  # one per CA file, verifying the hosts it signed
        try:
            while not self.stop:
                endpoints = json.loads(self.path.read_text())
                if not endpoints:
                    self.empty_reads += 1
                    await asyncio.sleep(0.05)
                    continue
                self.sent += 1
                for i in range(len(endpoints)):
                    e = endpoints[(turn + i) % len(endpoints)]
                    if e["ca_file"] not in clients:
                        clients[e["ca_file"]] = httpx.AsyncClient(
                            timeout=10, verify=ssl.create_default_context(cafile=e["ca_file"])
                        )
                    client = clients[e["ca_file"]]
                    try:
                        r = await client.post(
                            f"{e['url']}/v1/chat/completions",
                            headers={"Authorization": f"Bearer {e['api_key']}"},
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                        )
                        if r.status_code == 200:
                            self.seen_urls.add(e["url"])
                            break
                    except httpx.HTTPError:
                        continue
                else:
                    self.failed += 1
                turn += 1
                await asyncio.sleep(0.02)
        finally:
            for client in clients.values():
                await client.aclose()


def database_snapshot(path) -> dict[str, list]:
    """Every row of every table, read with plain sqlite3, but the shared budget of marketplace calls (a dry run
    asks the marketplace too, and counts its calls there like any process)."""
    with sqlite3.connect(path) as db:
        tables = [
            r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'") if r[0] != "market_pace"
        ]
        return {t: db.execute(f"SELECT * FROM {t} ORDER BY rowid").fetchall() for t in tables}


async def live_instances(cloud) -> list[dict]:
    async with cloud.client() as api:
        return await listed_instances(api)


async def test_reprice_dry_run_changes_nothing_then_moves_make_before_break(cloud, tmp_path):
    settings = settings_fast(tmp_path)
    async with fleet_for(settings) as fleet:
        old = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        endpoints_file = settings.rotation.endpoints_path
        assert [e["name"] for e in json.loads(endpoints_file.read_text())] == [old.name]
        assert oct(endpoints_file.stat().st_mode & 0o777) == "0o600"

        nothing = await rotation.reprice(fleet, dry_run=False)
        assert [m.move for m in nothing] == [False]  # already on the cheapest passing offer

        target = (await fleet.offers("tiny", "eu", exclude_unusable=True)).passed[-1]
        async with cloud.client() as api:
            (await api.put(f"/admin/offers/{target.id}", json={"dph_base": 0.01})).raise_for_status()
        before_db = database_snapshot(settings.database.file)
        before_cloud = await live_instances(cloud)
        planned = await rotation.reprice(fleet, dry_run=True)
        assert [(m.move, m.best_offer) for m in planned] == [(True, target.id)]
        assert database_snapshot(settings.database.file) == before_db
        after_cloud = await live_instances(cloud)
        assert [(i["id"], i["label"], i["actual_status"]) for i in after_cloud] == [
            (i["id"], i["label"], i["actual_status"]) for i in before_cloud
        ]

        client = RoundRobinClient(endpoints_file)
        task = asyncio.create_task(client.run())
        moves = await rotation.reprice(fleet, dry_run=False)
        await asyncio.sleep(0.3)
        client.stop = True
        await task
        assert moves[0].new_host
        new = fleet.record.hosts(names=[moves[0].new_host])[0]
        assert new.offer_id == target.id and new.replaces == old.id and new.state == HostState.READY
        gone = fleet.record.hosts(names=[old.name])[0]
        assert gone.state == HostState.DESTROYED and gone.ready_at < new.ready_at < gone.destroyed_at
        assert [e["name"] for e in json.loads(endpoints_file.read_text())] == [new.name]
        assert client.sent > 0 and client.failed == 0 and client.empty_reads == 0
        assert len(client.seen_urls) == 2  # it was served by both, one after the other
        assert fleet.record.blacklist() == []  # a reprice does not blame the old machine
        await fleet.destroy(None)
    assert await live_instances(cloud) == []


async def test_a_dead_llama_server_is_replaced_within_two_sweeps(cloud, tmp_path):
    settings = settings_fast(tmp_path)
    async with fleet_for(settings) as fleet:
        victim, other = (await fleet.up(UpRequest("tiny", "eu", count=2))).ready
        client = RoundRobinClient(settings.rotation.endpoints_path)
        task = asyncio.create_task(client.run())
        await kill_llama_server(victim.ssh_host, victim.ssh_port, fleet.ssh_key.private)
        first = {r.name: r for r in await rotation.health_sweep(fleet)}
        assert not first[victim.name].healthy and first[victim.name].replaced_by is None
        assert first[other.name].healthy
        second = {r.name: r for r in await rotation.health_sweep(fleet)}
        client.stop = True
        await task
        new_name = second[victim.name].replaced_by
        assert new_name
        assert fleet.record.hosts(names=[victim.name])[0].state == HostState.DESTROYED
        assert [b.machine_id for b in fleet.record.blacklist()] == [victim.machine_id]
        ready = {h.name for h in fleet.record.hosts(states=(HostState.READY,))}
        assert ready == {other.name, new_name}
        assert client.failed == 0 and client.empty_reads == 0
        await fleet.destroy(None)


async def test_a_health_sweep_records_each_hosts_memory_and_the_server_runs_with_the_profiles_cache_limit(
    cloud, tmp_path
):
    """issue 38: llama-server's RAM prompt cache grew ~73 MiB an hour per host with --cache-ram unset (8 GiB).
    The server runs with the profile's cache_ram_mib, and each sweep records the host's RAM and the server's
    resident set, read on the host: the same figure /proc gives for that process here."""
    async with fleet_for(settings_fast(tmp_path)) as fleet:
        [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        try:
            host_dir = cloud.info.state_dir / "hosts" / str(host.instance_id)
            pid = int(next(host_dir.rglob("llama-server.pid")).read_text())
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            limit = fleet.settings.profile("tiny").cache_ram_mib
            assert argv[argv.index("--cache-ram") + 1] == str(limit) and argv.count("--cache-ram") == 1
            [report] = await rotation.health_sweep(fleet)
            assert report.healthy, report
            read = fleet.record.host(host.id)
            assert read.ram_total_mib > read.ram_available_mib > 0
            rss_kib = next(
                int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmRSS:")
            )  # fmt: skip
            assert read.server_rss_mib is not None and 0.5 < read.server_rss_mib / (rss_kib / 1024) < 2
            [shown] = [h for h in fleet.status() if h["name"] == host.name]
            assert shown["server_rss_mib"] == read.server_rss_mib and shown["ram_available_mib"] > 0
            # the server gone: its resident set is unknown, the machine's RAM still read
            await kill_llama_server(host.ssh_host, host.ssh_port, fleet.ssh_key.private)
            [report] = await rotation.health_sweep(fleet)
            read = fleet.record.host(host.id)
            assert not report.healthy and read.server_rss_mib is None and read.ram_total_mib > 0
        finally:
            await fleet.destroy(None)


def test_a_hosts_memory_read_is_believed_only_as_proc_writes_it():
    """What a host prints for its memory is a stranger's: a digit Python reads as one but int() refuses, a
    5,000-digit number, more available than the total, an unasked line: each refused as one RemoteError (the
    sweep records the memory as unknown), never an exception that ends the sweep for every host."""
    good = parse_memory("MemTotal:       24576000 kB\nMemAvailable:   12288000 kB\nVmRSS:\t  512000 kB\n")
    assert (good.total_mib, good.available_mib, good.server_rss_mib) == (24000.0, 12000.0, 500.0)
    assert parse_memory("MemTotal: 2048 kB\nMemAvailable: 1024 kB\n").server_rss_mib is None  # no server
    for lie in (
        "MemTotal: \u00b2 kB\nMemAvailable: 1 kB",
        "MemTotal: " + "9" * 5000 + " kB\nMemAvailable: 1 kB",
        "MemTotal: 1024 kB\nMemAvailable: 2048 kB",
        "MemTotal: 1024 kB\nMemAvailable: 512 kB\nVmRSS: 4096 kB",
        "MemTotal: 1024 kB\nMemAvailable: 512 kB\nSwapTotal: 1 kB",
        "MemTotal: 1024 MB\nMemAvailable: 512 kB",
        "MemTotal: 1024 kB\nMemTotal: 1024 kB\nMemAvailable: 512 kB",
        "MemAvailable: 512 kB",
    ):
        with pytest.raises(RemoteError):
            parse_memory(lie)


async def test_a_vanished_host_is_replaced_at_once(cloud, tmp_path):
    async with fleet_for(settings_fast(tmp_path)) as fleet:
        old = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        async with cloud.client() as api:
            await api.delete(f"/api/v0/instances/{old.instance_id}/")
        [report] = await rotation.health_sweep(fleet)
        assert report.reason == "the instance is gone" and report.replaced_by
        assert fleet.record.hosts(names=[old.name])[0].state == HostState.DESTROYED
        assert [h.name for h in fleet.record.hosts(states=(HostState.READY,))] == [report.replaced_by]
        await fleet.destroy(None)


async def test_a_host_whose_server_moved_to_another_port_is_replaced_at_once(cloud, tmp_path):
    """Stopped and started behind fleet's back, an instance comes back on new ports: its old port may be
    another renter's now, so the first sweep that reads the move takes the host out."""
    async with fleet_for(settings_fast(tmp_path)) as fleet:
        old = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        await fleet.market.stop(old.instance_id)
        while not (moved := await fleet.market.get(old.instance_id)) or not moved.stopped:
            await asyncio.sleep(0.5)
        await fleet.market.start(old.instance_id)
        while not (moved := await fleet.market.get(old.instance_id)) or moved.status != "running" or not moved.ports:
            await asyncio.sleep(0.5)
        [report] = await rotation.health_sweep(fleet)
        assert not report.healthy and report.failures == 1 and "now lists its server at" in report.reason
        assert report.replaced_by is not None
        assert fleet.record.hosts(names=[old.name])[0].state == HostState.DESTROYED
        await fleet.destroy(None)


async def test_a_failing_replacement_leaves_the_old_host_serving(cloud, tmp_path):
    settings = settings_fast(tmp_path, unhealthy_after_sweeps=1)
    settings = settings.model_copy(update={"up": settings.up.model_copy(update={"max_attempts": 1})})
    async with fleet_for(settings) as fleet:
        old = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        cloud.set_faults({"corrupt_files": ["tiny-llama-bytes.gguf"]})
        new = await rotation.replace(fleet, old, "test", blacklist=False)
        assert new is None
        assert fleet.record.hosts(names=[old.name])[0].state == HostState.READY
        assert [e["name"] for e in json.loads(settings.rotation.endpoints_path.read_text())] == [old.name]
        async with fleet.server(old).client() as client:
            assert (await client.get("/health")).status_code == 200
        events = [(e.kind, e.action) for e in fleet.record.events(old.id)]
        assert ("error", "replace") in events
        cloud.set_faults({})
        await fleet.destroy(None)


async def test_blacklist_entries_expire(tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        fleet.blacklist_machine(host(id=None), "boot", "test")
        url = "u"
        assert fleet.record.blacklisted_machines(url, utcnow()) == {1}
        assert fleet.record.blacklisted_machines(url, utcnow() + timedelta(hours=100)) == set()


async def test_a_host_failing_its_thermal_reprobe_is_replaced_and_blacklisted(cloud, tmp_path):
    async with fleet_for(settings_fast(tmp_path)) as fleet:
        hot = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        machine = hot.machine_id
        # a busy CI machine once failed the first offer's bring-up, which blacklisted that machine beforehand
        before = [(b.machine_id, b.phase, b.reason) for b in fleet.record.blacklist()]
        sagging = asyncio.create_task(sag_after_first_reply(cloud, fleet, hot))  # once the cold sample is in
        [report] = await thermal.thermal_sweep(fleet)
        sag_was_set(sagging)
        assert not report.healthy and "decode share fell" in report.reason and report.replaced_by
        assert fleet.record.hosts(names=[hot.name])[0].state == HostState.DESTROYED
        blacklisted = [(b.machine_id, b.phase, b.reason) for b in fleet.record.blacklist()]
        assert [b[0] for b in blacklisted[len(before) :]] == [machine] and blacklisted[: len(before)] == before, (
            before,
            blacklisted,
        )
        new = fleet.record.hosts(names=[report.replaced_by])[0]
        assert new.state == HostState.READY and new.machine_id != machine
        await fleet.destroy(None)


async def test_a_host_the_thermal_probe_cannot_measure_ends_no_sweep(cloud, tmp_path):
    """A host whose probe finds no verdict (its server gone: the probe cannot measure) is reported unprobed, not
    replaced by the thermal sweep (the health sweep judges it), and the sweep goes on to probe the next host."""
    async with fleet_for(settings_fast(tmp_path)) as fleet:
        dead, other = (await fleet.up(UpRequest("tiny", "eu", count=2))).ready
        try:
            await kill_llama_server(dead.ssh_host, dead.ssh_port, fleet.ssh_key.private)
            reports = {r.name: r for r in await thermal.thermal_sweep(fleet)}
            assert reports[dead.name].reason.startswith(thermal.NOT_PROBED) and reports[dead.name].replaced_by is None
            # the sweep went on: the other host was probed (its verdict is this busy CPU's, not a card's)
            assert [r.name for r in fleet.record.probe_runs(other.id) if r.name == "thermal"] == ["thermal"]
            assert dead.machine_id not in [b.machine_id for b in fleet.record.blacklist()]
            assert fleet.record.hosts(names=[dead.name])[0].state == HostState.READY  # the health sweep's to judge
        finally:
            await fleet.destroy(None)


async def test_reprice_never_moves_a_host_to_a_dearer_offer(cloud, tmp_path):
    """Reprice used to move a host to an offer cheaper per hour but dearer once its traffic is paid for."""
    settings = settings_for(tmp_path)  # a profile whose traffic costs count: 50 GB/h each way
    heavy = settings.models["tiny"].model_copy(update={"traffic_gb_per_hour": Traffic(up=50, down=50)})
    settings = settings.model_copy(update={"models": {**settings.models, "tiny": heavy}})
    async with fleet_for(settings) as fleet:
        old = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        ranked = (await fleet.offers("tiny", "eu", exclude_unusable=True)).passed
        cheap, dear = ranked[0], ranked[-1]
        async with cloud.client() as api:
            # the best offer is much cheaper; another is cheaper per hour but dearer once traffic is paid
            await polite(api, "PUT", f"/admin/offers/{cheap.id}", json={"dph_base": 0.001})
            await polite(
                api,
                "PUT",
                f"/admin/offers/{dear.id}",
                json={"dph_base": old.dph_total / 2, "inet_up_cost": 0.049, "inet_down_cost": 0.049},
            )
        cloud.set_faults({"vanish_at_create": [cheap.id]})  # rented by someone else at the last moment
        moves = await rotation.reprice(fleet, dry_run=False)
        assert [m.best_offer for m in moves] == [cheap.id]
        new = fleet.record.hosts(names=[moves[0].new_host])[0] if moves[0].new_host else None
        assert new is None or new.effective_usd_per_hour < old.effective_usd_per_hour
        await fleet.destroy(None)
