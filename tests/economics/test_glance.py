"""The fleet at a glance (issue 48, the operator's page): a record of a thousand hosts in two regions, in every
state, some failed at a phase and some failing probes on a few bad machines, read back by `fleet report`. Its
counts by region and state, each serve target's calls and cost and the failing machines equal what the test
counts itself from the rows it wrote; a real headless Chromium renders the page with those tables; nothing
secret is on it."""

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from datetime import timedelta

from fleet.core.models import LIVE_STATES, BenchRun, Host, HostState, ProbeRun, utcnow
from tests.economics.test_report import chromium
from tests.fleetkit import fleet_for, settings_for, write_config

NOW = utcnow()
SINCE_H = 24
SERVE = [
    {"model": "tiny", "region": "eu", "calls": 900, "headroom": 0.1, "standby": 3},
    {"model": "tiny", "region": "na", "calls": 0},
]


def fleet_rows(n: int = 1000) -> tuple[list[Host], list[BenchRun], list[ProbeRun]]:
    """`n` hosts over 300 machines; machines 7 and 8 fail bring-ups at the pull and probes, as bad machines do."""
    pick = random.Random(48)
    states = [*LIVE_STATES, HostState.FAILED, HostState.DESTROYED]
    hosts, benches, probes = [], [], []
    for i in range(1, n + 1):
        state = pick.choice([HostState.READY] * 6 + states)
        machine = 7 if i % 50 == 0 else 8 if i % 77 == 0 else pick.randint(10, 300)
        if machine in (7, 8):
            state = HostState.FAILED
        ended = state in (HostState.FAILED, HostState.DESTROYED)
        # a third of the ended hosts ended before the report's window and are not counted
        destroyed = NOW - timedelta(hours=SINCE_H * 2 if ended and i % 3 == 0 else 1) if ended else None
        hosts.append(
            Host(id=i, name=f"tiny-{'eu' if i % 4 else 'na'}-{i:04d}", run_id="r", model="tiny",
                 region="eu" if i % 4 else "na", state=state, provider_url="local", label=f"fleet:{i}", offer_id=i,
                 machine_id=machine, gpu_name="RTX 3090", num_gpus=1, gpu_ram_mb=24576, geolocation="Sweden, SE",
                 dph_total=0.2 + i % 7 / 100, inet_up_usd_per_gb=0.0, inet_down_usd_per_gb=0.0,
                 effective_usd_per_hour=0.21 + i % 7 / 100, storage_usd_per_hour=0.01, slots=8, api_key_nonce=f"n{i}",
                 created_at=(destroyed or NOW) - timedelta(hours=2), destroyed_at=destroyed,
                 failed_phase="pulling" if state == HostState.FAILED else None,
                 failure_reason=f"pull stalled on machine {machine}" if state == HostState.FAILED else None)
        )  # fmt: skip
        if state == HostState.READY and i % 5:
            benches.append(BenchRun(host_id=i, at=NOW - timedelta(minutes=30), first_content_p95_ms_target=500,
                                    decode_tok_s_target=15, capacity=4, capacity_at_least=False,
                                    usd_per_voice_minute=0.001, calls_capacity=pick.randint(2, 12)))  # fmt: skip
        if machine == 8 or i % 97 == 0:
            probes.append(ProbeRun(host_id=i, at=NOW - timedelta(minutes=20), name="thermal", passed=False,
                                   diagnosis=f"decode share 0.2 on machine {machine}"))  # fmt: skip
    return hosts, benches, probes


async def test_the_glance_counts_a_thousand_hosts_and_ranks_the_failing_machines(tmp_path):
    settings = settings_for(tmp_path)
    hosts, benches, probes = fleet_rows()
    async with fleet_for(settings) as fleet:
        fleet.record.add_all([h.model_copy() for h in hosts])
        fleet.record.add_all([*benches, *probes])
        keys = [fleet.api_key(h) for h in hosts[:50]]
        assert all(keys)

    env = {**os.environ, "FLEET_CONFIG": str(write_config(tmp_path, serve=SERVE))}
    out = tmp_path / "report"
    made = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "report", "--since", f"{SINCE_H}h", "--out", str(out), "--json"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    glance = json.loads(made.stdout)["glance"]

    since = NOW - timedelta(hours=SINCE_H)
    shown = [h for h in hosts if h.state in LIVE_STATES or (h.destroyed_at and h.destroyed_at >= since)]
    expected = Counter((h.region, str(h.state)) for h in shown)
    found = {
        (region, state): n for region, row in glance["hosts_by_region_and_state"].items() for state, n in row.items()
    }
    assert found == dict(expected) and sum(found.values()) == len(shown) < len(hosts)

    # each target: READY hosts, the calls they hold (a bench's calls within the slots, else the slots), the cost
    held = {b.host_id: min(b.calls_capacity, 8) for b in benches}
    eu, na = glance["targets"]
    for view, region in ((eu, "eu"), (na, "na")):
        ready = [h for h in hosts if h.state == HostState.READY and h.region == region]
        calls = sum(held.get(h.id, 8) for h in ready)
        rate = sum(h.effective_usd_per_hour for h in ready)
        assert (view["ready"], view["calls_held"]) == (len(ready), calls) and calls > 0
        assert abs(view["usd_per_hour"] - rate) < 1e-9
        assert abs(view["usd_per_voice_minute"] - rate / calls / 60) < 1e-12
    assert (eu["calls_wanted"], eu["pool_target"], na["calls_wanted"]) == (900, 3, 0)
    assert eu["pool"] == sum(
        1 for h in hosts if h.region == "eu" and h.state in (HostState.STOPPING, HostState.STANDBY)
    )

    # failures since the window opened, by machine: the two bad machines first, in order of their failures
    failures: Counter[int] = Counter()
    for h in hosts:
        if h.state == HostState.FAILED and h.destroyed_at >= since:
            failures[h.machine_id] += 1
    for p in probes:
        failures[hosts[p.host_id - 1].machine_id] += 1
    ranked = sorted(failures.items(), key=lambda kv: -kv[1])
    assert glance["machines_failing"] == len(failures) > 20 and len(glance["machines"]) == 20
    assert [(m["machine_id"], m["total"]) for m in glance["machines"][:2]] == ranked[:2]
    assert {ranked[0][0], ranked[1][0]} == {7, 8}
    bad = next(m for m in glance["machines"] if m["machine_id"] == 8)
    assert bad["probes"] == {"thermal": failures[8] - bad["bring_up"]["pulling"]}
    assert all(a["total"] >= b["total"] for a, b in zip(glance["machines"], glance["machines"][1:], strict=False))

    page, summary = (out / "report.html").read_text(), (out / "report.md").read_text()
    assert not any(key in text for key in keys for text in (page, summary, made.stdout))
    [total_line] = [line for line in summary.splitlines() if line.startswith("| all |")]
    assert total_line.rstrip(" |").rsplit("| ", 1)[-1] == str(len(shown))

    dom = chromium("--dump-dom", (out / "report.html").as_uri())
    assert dom.returncode == 0, dom.stderr[-500:]
    table = re.search(r'<table id="hosts-by-state">(.*?)</table>', dom.stdout, re.S)
    assert table, "the page has no hosts-by-state table"
    last = re.findall(r"<tr>(.*?)</tr>", table[1], re.S)[-1]
    assert re.findall(r"<td>([^<]*)</td>", last)[-1] == str(len(shown))
    machines = re.search(r'<table id="failing-machines">(.*?)</table>', dom.stdout, re.S)
    first = re.findall(r"<td>([^<]*)</td>", re.findall(r"<tbody><tr>(.*?)</tr>", machines[1], re.S)[0])
    assert (int(first[0]), int(first[3])) == ranked[0]
