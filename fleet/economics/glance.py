"""The fleet at a glance, for an operator of hundreds of hosts: a page of counts, not a row per host.

- Hosts by state and region: every live host, and the hosts that ended (failed, destroyed) within the window.
- Each serve target (fleet.toml's [[serve]]): the calls it is kept for, the calls its READY hosts hold, the hosts
  coming up and in the pool, what its READY hosts cost an hour and per voice-minute at that capacity.
- Failures by machine within the window: bring-ups that failed (by phase) and probes that failed (by name), the
  machines with most first, each with its latest reason.

Pure: `gather` takes the rows and the targets' sizings; `markdown` and `html` render what it made. The report
(economics/report.py) puts it first.
"""

from __future__ import annotations

import html as html_escape
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Protocol

from fleet.core.models import LIVE_STATES, POOL, Host, HostState, ProbeRun, as_utc
from fleet.economics.capacity import usd_per_voice_minute
from fleet.economics.machines import failed_bring_up

MACHINES_SHOWN = 20  # failing machines listed: the rest are counted


class TargetSizing(Protocol):
    """What the glance reads of a target's sizing (control/sizing.py Sizing)."""

    model: str
    region: str
    calls: int
    capacity: int
    in_flight: int
    pool: int
    pool_target: int
    paused_since: str | None


@dataclass
class TargetView:
    model: str
    region: str
    calls_wanted: int  # the target's calls (0: no sizing)
    ready: int  # READY hosts
    calls_held: int  # what they hold at once (measured, else their slots)
    in_flight: int  # hosts coming up
    pool: int
    pool_target: int
    usd_per_hour: float  # the READY hosts' effective rate, traffic included
    usd_per_voice_minute: float | None  # at the calls they hold
    paused: bool


@dataclass
class MachineFailures:
    machine_id: int
    gpu_name: str
    geolocation: str
    bring_up: dict[str, int] = field(default_factory=dict)  # failed bring-ups by phase
    probes: dict[str, int] = field(default_factory=dict)  # failed probe runs by probe
    last_at: datetime | None = None
    last_reason: str = ""

    @property
    def total(self) -> int:
        return sum(self.bring_up.values()) + sum(self.probes.values())


@dataclass
class Glance:
    since: datetime
    until: datetime
    states: list[str]  # the columns of `by_state`, in the path a host takes
    regions: list[str]
    by_state: dict[str, dict[str, int]]  # region -> state -> hosts
    targets: list[TargetView]
    machines: list[MachineFailures]  # the MACHINES_SHOWN with most failures
    machines_failing: int  # all machines with a failure in the window
    live_usd_per_hour: float  # what every live host bills an hour now

    def as_dict(self) -> dict[str, Any]:
        return {
            "since": self.since.isoformat(),
            "until": self.until.isoformat(),
            "hosts_by_region_and_state": self.by_state,
            "targets": [asdict(t) for t in self.targets],
            "machines_failing": self.machines_failing,
            "machines": [
                {**asdict(m), "total": m.total, "last_at": m.last_at.isoformat() if m.last_at else None}
                for m in self.machines
            ],
            "live_usd_per_hour": self.live_usd_per_hour,
        }


def _billing(h: Host) -> float:
    return h.storage_usd_per_hour if h.state in POOL else h.effective_usd_per_hour


def gather(
    hosts: list[Host],
    probe_runs: list[ProbeRun],
    sizings: list[TargetSizing],
    since: datetime,
    now: datetime,
) -> Glance:
    """`sizings`: each serve target's, whose capacity is the calls its READY hosts hold at once (their latest
    bench's, else their slots: economics/capacity.py calls_held)."""
    shown = [h for h in hosts if h.state in LIVE_STATES or (h.destroyed_at and as_utc(h.destroyed_at) >= since)]
    by_state: dict[str, Counter[str]] = {}
    for h in shown:
        by_state.setdefault(h.region, Counter())[h.state] += 1
    states = [s.value for s in HostState if any(s.value in c for c in by_state.values())]
    targets = []
    for sizing in sizings:
        ready = [
            h for h in hosts if h.state == HostState.READY and (h.model, h.region) == (sizing.model, sizing.region)
        ]
        rate = sum(h.effective_usd_per_hour for h in ready)
        targets.append(
            TargetView(sizing.model, sizing.region, sizing.calls, len(ready), sizing.capacity, sizing.in_flight,
                       sizing.pool, sizing.pool_target, rate, usd_per_voice_minute(rate, sizing.capacity),
                       sizing.paused_since is not None)
        )  # fmt: skip
    machines = _failures(hosts, probe_runs, since)
    return Glance(
        since,
        now,
        states,
        sorted(by_state),
        {region: {s: counts[s] for s in states if counts[s]} for region, counts in sorted(by_state.items())},
        targets,
        machines[:MACHINES_SHOWN],
        len(machines),
        sum(_billing(h) for h in hosts if h.state in LIVE_STATES),
    )


def _failures(hosts: list[Host], probe_runs: list[ProbeRun], since: datetime) -> list[MachineFailures]:
    by_id = {h.id: h for h in hosts if h.id is not None}
    found: dict[int, MachineFailures] = {}

    def machine(h: Host) -> MachineFailures:
        return found.setdefault(h.machine_id, MachineFailures(h.machine_id, h.gpu_name, h.geolocation))

    def latest(m: MachineFailures, at: datetime, reason: str) -> None:
        if m.last_at is None or at >= m.last_at:
            m.last_at, m.last_reason = at, reason

    for h in hosts:
        ended = as_utc(h.destroyed_at or h.created_at)
        if (phase := failed_bring_up(h)) is not None and ended >= since:
            m = machine(h)
            m.bring_up[phase] = m.bring_up.get(phase, 0) + 1
            latest(m, ended, f"{phase}: {h.failure_reason or 'no reason recorded'}")
    for run in probe_runs:
        if run.passed or as_utc(run.at) < since or (h := by_id.get(run.host_id)) is None:
            continue
        m = machine(h)
        m.probes[run.name] = m.probes.get(run.name, 0) + 1
        latest(m, as_utc(run.at), f"{run.name}: {run.diagnosis}")
    return sorted(found.values(), key=lambda m: (-m.total, -(m.last_at or since).timestamp(), m.machine_id))


def _money(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"${value:,.{digits}f}"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def _target_cells(t: TargetView) -> list[str]:
    name = f"{t.model} in {t.region}" + (" (paused)" if t.paused else "")
    wanted = f"{t.calls_wanted}" if t.calls_wanted else "no target"
    counts = [str(t.ready), str(t.calls_held), str(t.in_flight), f"{t.pool}/{t.pool_target}"]
    return [name, wanted, *counts, _money(t.usd_per_hour), _money(t.usd_per_voice_minute, 5)]


TARGET_HEAD = ["target", "calls wanted", "READY hosts", "calls held", "coming up", "pool", "$/h", "$/voice-min"]
MACHINE_HEAD = ["machine", "GPU", "where", "failures", "bring-ups failed", "probes failed", "latest"]


def _machine_cells(m: MachineFailures) -> list[str]:
    when = f"{m.last_at:%m-%d %H:%M} " if m.last_at else ""
    reason = m.last_reason if len(m.last_reason) <= 120 else m.last_reason[:117] + "..."
    return [str(m.machine_id), m.gpu_name, m.geolocation, str(m.total), _counts(m.bring_up), _counts(m.probes),
            when + reason]  # fmt: skip


def _state_table(g: Glance) -> tuple[list[str], list[list[str]]]:
    head = ["region", *g.states, "all"]
    body = []
    for region in g.regions:
        counts = g.by_state[region]
        body.append([region, *(str(counts.get(s, 0)) for s in g.states), str(sum(counts.values()))])
    totals = [sum(g.by_state[r].get(s, 0) for r in g.regions) for s in g.states]
    body.append(["all", *map(str, totals), str(sum(totals))])
    return head, body


def _md_table(head: list[str], body: list[list[str]]) -> list[str]:
    cell = lambda c: c.replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in body]


def markdown(g: Glance) -> str:
    head, body = _state_table(g)
    lines = [
        "## The fleet at a glance",
        "",
        f"Live hosts bill {_money(g.live_usd_per_hour)} an hour now. Hosts by region and state (live, and those "
        f"that ended since {g.since:%Y-%m-%d %H:%M} UTC):",
        "",
        *_md_table(head, body),
        "",
    ]
    if g.targets:
        lines += ["Serve targets:", "", *_md_table(TARGET_HEAD, [_target_cells(t) for t in g.targets]), ""]
    if g.machines:
        more = g.machines_failing - len(g.machines)
        lines += [f"Machines with failures since {g.since:%Y-%m-%d %H:%M} UTC, most first"
                  + (f" ({more} more not shown)" if more else "") + ":", "",
                  *_md_table(MACHINE_HEAD, [_machine_cells(m) for m in g.machines]), ""]  # fmt: skip
    else:
        lines += [f"No machine failed a bring-up or a probe since {g.since:%Y-%m-%d %H:%M} UTC.", ""]
    return "\n".join(lines)


def _html_table(table_id: str, head: list[str], body: list[list[str]]) -> str:
    e = html_escape.escape
    rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in body)
    return (
        f'<table id="{table_id}"><thead><tr>{"".join(f"<th>{e(h)}</th>" for h in head)}</tr></thead>'
        f"<tbody>{rows}</tbody></table>"
    )


def html(g: Glance) -> str:
    """The glance as a section of the report's page (its tables carry ids a reader or a test can find)."""
    e = html_escape.escape
    head, body = _state_table(g)
    since = f"{g.since:%Y-%m-%d %H:%M} UTC"
    parts = [
        '<section id="glance"><h2>The fleet at a glance</h2>',
        f"<p>Live hosts bill <strong>{e(_money(g.live_usd_per_hour))}</strong> an hour now. Hosts by region and "
        f"state (live, and those that ended since {e(since)}):</p>",
        _html_table("hosts-by-state", head, body),
    ]
    if g.targets:
        parts += ["<p>Serve targets:</p>", _html_table("targets", TARGET_HEAD, [_target_cells(t) for t in g.targets])]
    if g.machines:
        more = g.machines_failing - len(g.machines)
        parts += [
            f"<p>Machines with failures since {e(since)}, most first{f' ({more} more not shown)' if more else ''}:</p>",
            _html_table("failing-machines", MACHINE_HEAD, [_machine_cells(m) for m in g.machines]),
        ]
    else:
        parts.append(f"<p>No machine failed a bring-up or a probe since {e(since)}.</p>")
    return "".join(parts) + "</section>"
