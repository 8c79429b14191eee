"""Machines remembered: a machine's record is made from the hosts fleet rented there, their probe and
bench runs and the blacklist; on the local cloud, a machine that failed and one that served are told
apart by what fleet measured on them, through the library and `fleet machines --json`."""

import json
import os
import subprocess
import sys
from datetime import timedelta

from fleet.control.up import UpRequest
from fleet.core.models import BenchRun, Blacklist, Host, HostState, ProbeRun, utcnow
from fleet.economics.machines import remember
from tests.fleetkit import fleet_for, ranked_offers, settings_for, write_config

T0 = utcnow()


def host(id_: int, machine: int, **kw) -> Host:
    base = dict(
        id=id_,
        name=f"h{id_}",
        run_id="r",
        model="tiny",
        region="eu",
        provider_url="local",
        label=f"fleet:h{id_}",
        offer_id=id_,
        machine_id=machine,
        gpu_name="RTX 3090",
        num_gpus=1,
        gpu_ram_mb=24576,
        geolocation="Sweden, SE",
        dph_total=0.2,
        inet_up_usd_per_gb=0.0,
        inet_down_usd_per_gb=0.0,
        effective_usd_per_hour=0.2,
        created_at=T0 + timedelta(minutes=id_),
    )
    return Host(**{**base, **kw})


def test_a_machines_record_is_made_from_its_hosts_runs_and_blacklistings():
    good = host(
        1,
        7,
        state=HostState.DESTROYED,
        connected_at=T0 + timedelta(seconds=60),
        pulled_at=T0 + timedelta(seconds=160),
        pulled_bytes=1_000_000_000,
        ready_at=T0 + timedelta(seconds=200),
    )
    again = host(
        2,
        7,
        state=HostState.READY,
        connected_at=T0 + timedelta(minutes=2, seconds=30),
        pulled_at=T0 + timedelta(minutes=2, seconds=80),
        pulled_bytes=1_000_000_000,
        ready_at=T0 + timedelta(minutes=2, seconds=100),
    )
    bad = host(3, 9, state=HostState.FAILED, failed_phase="pull", failure_reason="sha256 mismatch")
    probes = [
        ProbeRun(host_id=1, name="smoke", passed=True, diagnosis="ok"),
        ProbeRun(host_id=2, name="thermal", passed=False, diagnosis="hot", metrics='{"decode_share": 0.45}'),
    ]
    levels = json.dumps([{"callers": 1, "decode_per_caller_tok_s": 180.0}, {"callers": 2}])
    benches = [
        BenchRun(
            host_id=2,
            first_content_p95_ms_target=500,
            decode_tok_s_target=15,
            capacity=3,
            capacity_at_least=False,
            usd_per_voice_minute=0.001,
            levels=levels,
        )
    ]
    blacklist = [Blacklist(provider_url="local", machine_id=9, phase="pull", reason="sha256", expires_at=T0)]
    seven, nine = sorted(remember([good, again, bad], probes, benches, blacklist), key=lambda m: m.machine_id)
    assert (seven.hosts, seven.ready, seven.failures, seven.blacklistings) == (2, 2, {}, 0)
    assert seven.pull_mb_s == 15.0  # 1 GB in 100 s and in 50 s: the median of 10 and 20 MB/s
    assert seven.create_to_ready_s == 120.0  # 140 s and 100 s from create
    assert seven.probes == {"smoke": {"passed": 1, "failed": 0}, "thermal": {"passed": 0, "failed": 1}}
    assert (seven.thermal_share, seven.capacity, seven.one_caller_decode_tok_s) == (0.45, 3, 180.0)
    assert (nine.hosts, nine.ready, nine.failures) == (1, 0, {"pull": 1})
    assert (nine.blacklistings, nine.last_blacklist_reason) == (1, "pull: sha256")
    assert nine.pull_mb_s is None and nine.create_to_ready_s is None


async def test_fleet_remembers_the_machine_that_failed_and_the_one_that_served(cloud, local_cloud_env, tmp_path):
    stuck = (await ranked_offers(settings_for(tmp_path)))[0]
    cloud.set_faults({"stuck_loading": [stuck.machine_id]})
    # fleet is told the image is empty: no pull allowance beyond create_to_running (the cloud pulls in seconds)
    settings = settings_for(tmp_path, timeouts={"create_to_running": 15.0}, provider={"image_gb": 0.0})
    async with fleet_for(settings) as fleet:
        served = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        try:
            await fleet.bench(served.name, max_callers=1, waves=1, warmup=0, max_tokens=16)
            machines = {m.machine_id: m for m in fleet.machines()}
        finally:
            await fleet.destroy(None)
    bad, good = machines[stuck.machine_id], machines[served.machine_id]
    assert (bad.hosts, bad.ready, bad.failures, bad.blacklistings) == (1, 0, {"boot": 1}, 1)
    assert bad.last_blacklist_reason.startswith("boot: ")
    assert (good.hosts, good.ready, good.failures, good.blacklistings) == (1, 1, {}, 0)
    assert good.pull_mb_s > 0 and good.create_to_ready_s > 0
    assert good.probes["smoke"] == {"passed": 1, "failed": 0}
    assert good.capacity == 1 and good.one_caller_decode_tok_s > 0
    cli = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "machines", "--json"],
        env={**os.environ, "FLEET_CONFIG": str(write_config(tmp_path))},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    listed = {m["machine_id"]: m for m in json.loads(cli.stdout)}
    assert listed[served.machine_id]["capacity"] == 1 and listed[stuck.machine_id]["failures"] == {"boot": 1}
