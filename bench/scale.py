#!/usr/bin/env python3
"""fleet's control plane at many hosts (issue 48), on simulated hosts: the local cloud plays every host in its
own process (docs/vast-fidelity.md, "Simulated hosts"), so a host costs a few kilobytes and a socket or four,
and fleet's own code runs unchanged against it.

For each size (hosts brought up to it, each size building on the last): the bring-up's wall time, then a
health sweep (every host's /health, a short completion and its memory read over SSH) and a reconcile (the
marketplace's listing against the record), each its wall time, fleet's CPU (this process) and the local
cloud's CPU (its process, which plays the hosts too), the record's size, and `fleet report`'s page (the fleet
at a glance, the session's hosts and plots) made from the record. The last columns divide by the
hosts: a cost that grows linearly keeps its per-host figure flat down the table; one that grows worse does
not.

The sweep's two parts are then timed apart, side by side: the listing of the READY hosts' instances alone, and
every host's check alone, one after the other as the sweep ran them until issue 48, against the sweep, which
checks each listing page's hosts as that page answers.

Then the marketplace: the calls a sweep and a reconcile made, by endpoint, and what the daemon's beats at the
shipped settings (a sweep a minute, a reconcile every ten) ask of the listing endpoint a minute against what
vast.ai allows it (one call a second). And at the end, `fleet destroy` of every host, against its floor: the
hosts times the destroy endpoint's interval, the least time vast.ai's limits allow.

This first version runs one fleet process on SQLite, against the kind cloud (the cloud's rate limits off; fleet
still paces its own marketplace calls), with no calls in flight and no faults.

At vast.ai's paces a create is 4.6 s, so a thousand hosts take 77 minutes to bring up and as long to destroy: the
bring-ups run at `--bring-up-pace` of vast.ai's paces (a fiftieth by default; the kind cloud refuses no rate), as
does the destroy of the hosts beyond `--destroy-sample`. Those are the bench's setup; every sweep, reconcile and
the sample's destroys are measured at vast.ai's own paces.

Usage: .venv/bin/python bench/scale.py [--hosts 10,30,100] [--bring-up-pace 0.02] [--destroy-sample 100]
       [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import sqlite3
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.control import healthcheck, rotation
from fleet.control.reconcile import reconcile
from fleet.control.up import UpRequest
from fleet.core.config import Rotation
from fleet.core.models import HostState, utcnow
from fleet.economics import report
from fleet.localcloud import control
from fleet.market.pacing import PACES
from tests.fleetkit import fleet_for, settings_for

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "offers" / "synthetic-eu-2026-11.json"
TEMPLATE_ID = 29012592  # an RTX A4000 in Portugal: the offer `fleet offers --model tiny --region eu` ranks first
FIRST_ID = 70_000_000  # the bench's offers' ids and machine ids, apart from the snapshots'
VAST_LIST_INTERVAL_S = 1.0  # vast.ai's threshold for the instance listing (docs/vast-fidelity.md, rate limits)


@dataclass
class Destroyed:
    """The hosts of the largest size ended in two halves, side by side in one run: one `fleet destroy` a host (as
    `fleet destroy` worked through its hosts until issue 48), then the rest in one `fleet destroy`."""

    singly_hosts: int
    singly_s: float
    together_hosts: int
    together_s: float
    calls: dict[str, int]  # the second half's marketplace calls

    @staticmethod
    def floor_s(hosts: int) -> float:
        """The least time vast.ai's limits allow from a quiet start: a destroy call a host, each an interval after
        the last."""
        return max(hosts - 1, 0) * PACES["destroy"].interval_s


@dataclass
class Row:
    hosts: int
    up_s: float  # bringing up the hosts this size adds, at the bring-up's pace
    sweep_s: float
    sweep_fleet_cpu_s: float
    sweep_cloud_cpu_s: float
    reconcile_s: float
    reconcile_fleet_cpu_s: float
    record_bytes: int  # the SQLite file, its write-ahead log written back into it
    sweep_calls: dict[str, int]  # the marketplace calls a sweep made, by endpoint
    reconcile_calls: dict[str, int]
    listing_s: float  # the sweep's two parts apart, each from a quiet start: the READY hosts' listing
    checks_s: float  # and every host's check on that view
    report_s: float = 0.0  # `fleet report`'s page (the fleet at a glance first, plots and all), from the record

    def listing_share(self) -> float:
        """The listing calls a minute the daemon's shipped beats ask, as a share of what vast.ai allows."""
        beats = Rotation()
        a_minute = (self.sweep_calls.get("list", 0) * 60 / beats.health_every_s
                    + self.reconcile_calls.get("list", 0) * 60 / beats.reconcile_every_s)  # fmt: skip
        return a_minute / (60 / VAST_LIST_INTERVAL_S)

    @property
    def per_host(self) -> tuple[float, float, float, float]:
        """The sweep's ms, its CPU ms and reconcile's ms a host, and the record's KiB a host."""
        n = self.hosts
        return (1e3 * self.sweep_s / n, 1e3 * (self.sweep_fleet_cpu_s + self.sweep_cloud_cpu_s) / n,
                1e3 * self.reconcile_s / n, self.record_bytes / n / 1024)  # fmt: skip


def offers(count: int) -> list[dict]:
    """`count` European machines like the snapshot's best for tiny, each its own machine at a slightly
    different price."""
    template = next(o for o in json.loads(TEMPLATE.read_text()) if o["id"] == TEMPLATE_ID)
    rows = []
    for i in range(count):
        row = copy.deepcopy(template)
        n = FIRST_ID + i
        price = round(template["dph_base"] * (1 + i / (10 * count)), 6)
        row.update(id=n, ask_contract_id=n, machine_id=n, host_id=n, dph_base=price, rented=False, rentable=True)
        rows.append(row)
    return rows


def record_bytes(path: Path) -> int:
    """The record's size once its write-ahead log is written back (the log grows and is not truncated on its
    own: its size says what was written lately, not what is kept)."""
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path.stat().st_size


def cpu_s(pid: int) -> float:
    """A process's user and system CPU seconds so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    sizes: list[int], tmp: Path, bring_up_pace: float, destroy_sample: int
) -> tuple[list[Row], Destroyed]:
    (tmp / "offers").mkdir()
    (tmp / "offers" / "bench.json").write_text(json.dumps(offers(max(sizes))))
    os.environ["FLEET_LOCALCLOUD_DIR"] = str(tmp / "cloud")
    info = control.start(tmp / "cloud", offers_dir=tmp / "offers", kind=True, simulated_card="a4b", timeout_s=60)
    rows: list[Row] = []
    try:
        most = max(sizes)
        caps = {"max_hosts_total": most, "max_hosts_per_model": most, "max_usd_per_hour": most * 1.0}
        async with fleet_for(settings_for(tmp, caps=caps)) as fleet:
            for size in sizes:
                began = time.monotonic()
                have = len(fleet.record.open_hosts())
                if size > have:
                    with fleet.market.pacer.scaled(bring_up_pace):  # the bench's setup, not what it measures
                        report = await fleet.up(UpRequest("tiny", "eu", count=size - have))
                    if len(fleet.record.open_hosts()) < size:
                        raise SystemExit(f"scale: {size - have} hosts asked, {report.failures[:3]}")
                up_s = time.monotonic() - began
                await asyncio.sleep(PACES["list"].interval_s)  # the sweep's listing starts quiet, as its parts do
                sweep = await timed(rotation.health_sweep(fleet), info.pid, fleet)
                unhealthy = [r.reason for r in sweep.result if not r.healthy]
                if unhealthy:
                    raise SystemExit(f"scale: {len(unhealthy)} of {size} hosts unhealthy: {unhealthy[:3]}")
                settled = await timed(reconcile(fleet), info.pid, fleet)
                stored = record_bytes(Path(fleet.settings.database.path))
                listing_s, checks_s = await sweep_apart(fleet)
                rows.append(Row(size, up_s, sweep.wall_s, sweep.fleet_cpu_s, sweep.cloud_cpu_s, settled.wall_s,
                                settled.fleet_cpu_s, stored, sweep.calls, settled.calls, listing_s,
                                checks_s, report_page(fleet, tmp)))  # fmt: skip
                print(f"  {size} hosts: up {up_s:.1f} s, sweep {sweep.wall_s:.2f} s, reconcile {settled.wall_s:.2f} s",
                      file=sys.stderr)  # fmt: skip
            names = [h.name for h in fleet.record.open_hosts()]
            if len(names) > destroy_sample:  # beyond the sample, the hosts go at the bring-up's pace, unmeasured
                with fleet.market.pacer.scaled(bring_up_pace):
                    await fleet.destroy(names[destroy_sample:])
                names = names[:destroy_sample]
            singly = names[: len(names) // 2]
            await asyncio.sleep(PACES["destroy"].interval_s)  # each half starts with the destroy endpoint quiet
            began = time.monotonic()
            for name in singly:
                await fleet.destroy([name])
            singly_s = time.monotonic() - began
            await asyncio.sleep(PACES["destroy"].interval_s)
            ended = await timed(fleet.destroy(None), info.pid, fleet)
            destroyed = Destroyed(len(singly), singly_s, len(names) - len(singly), ended.wall_s, ended.calls)
            print(f"  destroyed {len(singly)} hosts one at a time in {singly_s:.1f} s, {destroyed.together_hosts} "
                  f"together in {ended.wall_s:.1f} s", file=sys.stderr)  # fmt: skip
    finally:
        control.stop(tmp / "cloud")
    return rows, destroyed


@dataclass
class Timed:
    result: object
    wall_s: float
    fleet_cpu_s: float
    cloud_cpu_s: float
    calls: dict[str, int]  # the marketplace calls it made, by endpoint


async def timed(work, cloud_pid: int, fleet) -> Timed:
    counted = fleet.market.pacer.counters.calls
    wall, mine, cloud, before = time.monotonic(), time.process_time(), cpu_s(cloud_pid), dict(counted)
    result = await work
    calls = {k: n - before.get(k, 0) for k, n in counted.items() if n > before.get(k, 0)}
    return Timed(result, time.monotonic() - wall, time.process_time() - mine, cpu_s(cloud_pid) - cloud, calls)


async def sweep_apart(fleet) -> tuple[float, float]:
    """The sweep's listing alone, then every host's check on the view it gave, one after the other (as the sweep
    ran them until issue 48 item 3); each after a listing interval, so that the pacing starts quiet."""
    hosts = fleet.record.hosts(states=(HostState.READY,))
    await asyncio.sleep(PACES["list"].interval_s)
    began = time.monotonic()
    view = await fleet.market.instances([h.instance_id for h in hosts])
    listing_s = time.monotonic() - began
    began = time.monotonic()
    await asyncio.gather(*(healthcheck.checked(fleet, h, view.get(h.instance_id)) for h in hosts))
    checks_s = time.monotonic() - began
    await asyncio.sleep(PACES["list"].interval_s)
    return listing_s, checks_s


def report_page(fleet, tmp: Path) -> float:
    """The seconds `fleet report` takes from the record to its page and summary written (the CLI's own steps)."""
    began = time.monotonic()
    report.write(fleet.session(utcnow() - timedelta(hours=24)), tmp / "report")
    return time.monotonic() - began


def calls_line(calls: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(calls.items())) or "none"


def table(rows: list[Row], destroyed: Destroyed) -> str:
    lines = ["| hosts | up s (bring-up pace) | sweep s | sweep CPU s (fleet + cloud) | reconcile s | record KiB "
             "| report s | sweep ms a host | sweep CPU ms a host | reconcile ms a host | record KiB a host |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        sweep_ms, cpu_ms, reconcile_ms, kib = r.per_host
        lines.append(f"| {r.hosts} | {r.up_s:.1f} | {r.sweep_s:.2f} | {r.sweep_fleet_cpu_s:.2f} + "
                     f"{r.sweep_cloud_cpu_s:.2f} | {r.reconcile_s:.2f} | {r.record_bytes / 1024:.0f} "
                     f"| {r.report_s:.2f} | {sweep_ms:.1f} | {cpu_ms:.1f} | {reconcile_ms:.2f} "
                     f"| {kib:.1f} |")  # fmt: skip
    first, last = rows[0], rows[-1]
    if last.hosts > first.hosts:
        growth = last.hosts / first.hosts
        cpu = (last.sweep_fleet_cpu_s + last.sweep_cloud_cpu_s) / max(
            1e-9, first.sweep_fleet_cpu_s + first.sweep_cloud_cpu_s
        )
        lines += ["", f"From {first.hosts} to {last.hosts} hosts ({growth:.0f}x): the sweep's wall time "
                  f"{last.sweep_s / first.sweep_s:.1f}x, its CPU {cpu:.1f}x, "
                  f"reconcile {last.reconcile_s / first.reconcile_s:.1f}x."]  # fmt: skip
    lines += ["", "| hosts | a sweep's marketplace calls | a reconcile's | listing calls a minute at the shipped "
              "beats, of vast.ai's 60 |", "|---:|---|---|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r.hosts} | {calls_line(r.sweep_calls)} | {calls_line(r.reconcile_calls)} "
                     f"| {100 * r.listing_share():.0f}% |")  # fmt: skip
    lines += ["", "| hosts | the listing alone s | the checks alone s | one after the other s | the sweep s (each "
              "page's hosts checked as it answers) | one after the other / the sweep |",
              "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        apart = r.listing_s + r.checks_s
        lines.append(f"| {r.hosts} | {r.listing_s:.2f} | {r.checks_s:.2f} | {apart:.2f} | {r.sweep_s:.2f} "
                     f"| {apart / max(r.sweep_s, 1e-9):.2f}x |")  # fmt: skip
    d = destroyed
    singly, together = (
        d.singly_s / max(d.floor_s(d.singly_hosts), 1e-9),
        d.together_s / max(d.floor_s(d.together_hosts), 1e-9),
    )
    interval = PACES["destroy"].interval_s
    lines += ["", f"Destroy, side by side, each half from a quiet destroy endpoint: {d.singly_hosts} hosts one at a "
              f"time {d.singly_s:.1f} s, {singly:.2f}x the floor at vast.ai's limits ({interval:g} s between "
              f"destroys); {d.together_hosts} in one `fleet destroy` {d.together_s:.1f} s ({calls_line(d.calls)}), "
              f"{together:.2f}x the floor."]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="10,30,100")
    parser.add_argument("--bring-up-pace", type=float, default=0.02,
                        help="the bring-ups' marketplace paces as a share of vast.ai's (1: vast.ai's own)")  # fmt: skip
    parser.add_argument("--destroy-sample", type=int, default=100, help="the hosts destroyed at vast.ai's paces")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        sizes = sorted(int(n) for n in args.hosts.split(","))
    except ValueError:
        parser.error(f"--hosts: comma-separated counts, not {args.hosts!r}")
    if not sizes or sizes[0] < 1:
        parser.error("--hosts: counts of at least 1")
    if not 0 < args.bring_up_pace <= 1:
        parser.error(f"--bring-up-pace: a share in (0, 1], not {args.bring_up_pace}")
    if args.destroy_sample < 2:
        parser.error("--destroy-sample: at least 2 hosts (half destroyed one at a time, half together)")
    with tempfile.TemporaryDirectory() as tmp:
        rows, destroyed = asyncio.run(measure(sizes, Path(tmp), args.bring_up_pace, args.destroy_sample))
    if args.json:
        args.json.write_text(json.dumps({"sizes": [asdict(r) for r in rows], "destroy": asdict(destroyed)}, indent=1))
    print(table(rows, destroyed))


if __name__ == "__main__":
    main()
