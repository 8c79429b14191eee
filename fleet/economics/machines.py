"""Machines remembered: what fleet measured on each marketplace machine, across every host it rented
there and every run, read from the records it already keeps (hosts, probe runs, bench runs, the
blacklist). Nothing here is stored twice: a machine's record is a view, made anew from the rows.

Pure: `remember` takes the rows and returns one MachineRecord per (marketplace, machine).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from fleet.core.models import BenchRun, Blacklist, Host, HostState, ProbeRun


@dataclass
class MachineRecord:
    provider_url: str
    machine_id: int
    gpu_name: str
    geolocation: str
    hosts: int = 0  # rented there, ever
    ready: int = 0  # of which reached READY
    failures: dict[str, int] = field(default_factory=dict)  # bring-up failures by phase
    blacklistings: int = 0
    last_blacklist_reason: str | None = None
    pull_mb_s: float | None = None  # median over its pulls
    create_to_ready_s: float | None = None  # median over its READY hosts
    probes: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> {"passed": n, "failed": n}
    one_caller_decode_tok_s: float | None = None  # the latest bench's one-caller rate
    thermal_share: float | None = None  # the latest thermal probe's decode share
    capacity: int | None = None  # the latest bench's calls in conversation at the voice target (else speakers)
    last_seen: datetime | None = None

    def as_dict(self) -> dict[str, Any]:
        row = asdict(self)
        row["last_seen"] = self.last_seen.isoformat() if self.last_seen else None
        return row


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return (end - start).total_seconds() if start and end and end > start else None


def failed_bring_up(h: Host) -> str | None:
    """The phase at which the host's bring-up failed ("unknown" where none was recorded); None if it did not."""
    if h.state == HostState.FAILED or (h.failed_phase and h.ready_at is None):
        return h.failed_phase or "unknown"
    return None


def remember(
    hosts: list[Host], probe_runs: list[ProbeRun], bench_runs: list[BenchRun], blacklist: list[Blacklist]
) -> list[MachineRecord]:
    """One record per machine fleet rented, most recently seen first."""
    records: dict[tuple[str, int], MachineRecord] = {}
    machine_of: dict[int, tuple[str, int]] = {}
    pulls: dict[tuple[str, int], list[float]] = {}
    boots: dict[tuple[str, int], list[float]] = {}
    for h in sorted(hosts, key=lambda h: h.created_at):
        key = (h.provider_url, h.machine_id)
        record = records.setdefault(key, MachineRecord(h.provider_url, h.machine_id, h.gpu_name, h.geolocation))
        if h.id is not None:
            machine_of[h.id] = key
        record.hosts += 1
        record.last_seen = h.created_at
        if h.ready_at is not None:
            record.ready += 1
            if (boot := _seconds(h.created_at, h.ready_at)) is not None:
                boots.setdefault(key, []).append(boot)
        if (phase := failed_bring_up(h)) is not None:
            record.failures[phase] = record.failures.get(phase, 0) + 1
        pulled = _seconds(h.connected_at, h.pulled_at)
        if h.pulled_bytes and pulled:
            pulls.setdefault(key, []).append(h.pulled_bytes / pulled / 1e6)
    for key, rates in pulls.items():
        records[key].pull_mb_s = statistics.median(rates)
    for key, seconds in boots.items():
        records[key].create_to_ready_s = statistics.median(seconds)
    for run in sorted(probe_runs, key=lambda r: r.at):
        if (key := machine_of.get(run.host_id)) is None:
            continue
        counts = records[key].probes.setdefault(run.name, {"passed": 0, "failed": 0})
        counts["passed" if run.passed else "failed"] += 1
        if run.name == "thermal":
            share = json.loads(run.metrics or "{}").get("decode_share")
            records[key].thermal_share = share if share is not None else records[key].thermal_share
    for bench in sorted(bench_runs, key=lambda b: b.at):
        if (key := machine_of.get(bench.host_id)) is None:
            continue
        records[key].capacity = bench.calls_capacity if bench.calls_capacity is not None else bench.capacity
        levels = json.loads(bench.levels or "[]")
        one = next((lv for lv in levels if lv.get("callers") == 1), None)
        if one and one.get("decode_per_caller_tok_s"):
            records[key].one_caller_decode_tok_s = one["decode_per_caller_tok_s"]
    listed = Counter((b.provider_url, b.machine_id) for b in blacklist)
    for b in sorted(blacklist, key=lambda b: b.created_at):
        if (key := (b.provider_url, b.machine_id)) in records:
            records[key].blacklistings = listed[key]
            records[key].last_blacklist_reason = f"{b.phase}: {b.reason}"
    return sorted(records.values(), key=lambda r: r.last_seen or datetime.min, reverse=True)
