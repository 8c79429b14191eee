"""The report: one self-contained HTML page with the plots people look at rather than read, and a markdown
summary beside it. First the whole fleet at a glance (economics/glance.py: counts that read the same at 8 hosts
or 1,000), then the benchmark session: the hosts created in the window.

Plots (PNG, inlined as data URIs, so the page is one file that opens anywhere): first-content p50/p95
and per-caller decode against concurrent callers, one line per host (each host's latest bench), each named
with its engine, so llama-server and vLLM hosts sit side by side; the
thermal series (decode rate over the probe, each host's latest thermal run); the session's cost over
time. The summary, per host: GPU, machine, region, price, probes, capacity, cost per voice-minute and
what the session cost. Nothing secret goes in: no API key, no endpoint key, only what `fleet status`
shows without `--show-keys`.

`gather` reads the records (I/O); `markdown` and `html` are pure; `plots` draws with matplotlib; `write` puts the
page and the summary in a folder.
"""

from __future__ import annotations

import base64
import html as html_escape
import io
import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from fleet.core.errors import BadInput
from fleet.core.models import BenchRun, Host, ProbeRun, as_utc
from fleet.economics import glance as fleet_glance
from fleet.economics.bill import Bill, bill


@dataclass
class HostReport:
    host: Host
    engine: str = "llama-server"  # what served it (its profile's engine)
    probes: dict[str, bool] = field(default_factory=dict)  # each probe's latest verdict
    bench: BenchRun | None = None
    thermal_rates: list[dict[str, float]] = field(default_factory=list)


@dataclass
class Session:
    since: datetime
    until: datetime
    hosts: list[HostReport]
    bill: Bill
    glance: fleet_glance.Glance | None = None  # the whole fleet's counts, first on the page


def parse_since(text: str, now: datetime) -> datetime:
    """`6h`, `2d`, `30m` before now, or an ISO date or time (UTC when it names no zone)."""
    if m := re.fullmatch(r"(\d+)([mhd])", text.strip()):
        unit = {"m": "minutes", "h": "hours", "d": "days"}[m.group(2)]
        return now - timedelta(**{unit: int(m.group(1))})
    try:
        moment = as_utc(datetime.fromisoformat(text.strip()))
    except ValueError:
        raise BadInput(f"--since {text!r}: give 30m, 6h, 2d or an ISO date like 2026-12-01T09:00") from None
    if moment > now:
        raise BadInput(f"--since {text!r}: that is in the future (now is {now:%Y-%m-%d %H:%M} UTC)")
    return moment


def gather(
    hosts: list[Host],
    probe_runs: list[ProbeRun],
    bench_runs: list[BenchRun],
    since: datetime,
    now: datetime,
    engines: dict[str, str] | None = None,
) -> Session:
    """The hosts created since `since`, with their latest probe verdicts, bench and thermal series.
    `engines`: each profile's engine (a host whose profile is gone from fleet.toml reads llama-server)."""
    chosen = sorted((h for h in hosts if as_utc(h.created_at) >= since), key=lambda h: h.created_at)
    by_id = {h.id: HostReport(h, (engines or {}).get(h.model, "llama-server")) for h in chosen}
    for run in sorted(probe_runs, key=lambda r: r.at):
        if (report := by_id.get(run.host_id)) is None:
            continue
        report.probes[run.name] = run.passed
        if run.name == "thermal":
            series = json.loads(run.metrics or "{}").get("series") or {}
            report.thermal_rates = series.get("rates") or report.thermal_rates
    for bench in sorted(bench_runs, key=lambda b: b.at):
        if (report := by_id.get(bench.host_id)) is not None:
            report.bench = bench
    return Session(since, now, list(by_id.values()), bill(chosen, now))


def _levels(report: HostReport) -> list[dict[str, Any]]:
    return json.loads(report.bench.levels) if report.bench else []


def rows(session: Session) -> list[dict[str, Any]]:
    """One summary row per host (what the markdown table and the HTML table show)."""
    lines = {line.host: line for line in session.bill.lines}
    out = []
    for r in session.hosts:
        h, b = r.host, r.bench
        out.append(
            {
                "host": h.name,
                "engine": r.engine,
                "gpu": f"{h.num_gpus}x {h.gpu_name}",
                "machine": h.machine_id,
                "region": f"{h.region} ({h.geolocation})",
                "usd_per_hour": h.effective_usd_per_hour,
                "state": h.state,
                "probes": ", ".join(f"{n} {'pass' if ok else 'FAIL'}" for n, ok in r.probes.items()) or "-",
                "capacity": _held(b.capacity, b.capacity_at_least) if b is not None else None,
                "calls": None
                if b is None or b.calls_capacity is None
                else f"{'>=' if b.calls_at_least else ''}{b.calls_capacity}",
                "usd_per_voice_minute": None if b is None else b.usd_per_voice_minute,
                "session_usd": lines[h.name].total_usd,
            }
        )
    return out


def _held(count: int | None, at_least: bool | None) -> str | None:
    return None if count is None else f"{'>=' if at_least else ''}{count}"


def _calls(row: dict[str, Any]) -> str:
    """The calls a host held in conversation, its speakers at once beside them: "24 (4)"."""
    if row["capacity"] is None:
        return "-"
    return f"{row['calls'] or '-'} ({row['capacity']})"


def _money(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"${value:.{digits}f}"


def title(session: Session) -> str:
    return f"fleet report, {session.since:%Y-%m-%d %H:%M} to {session.until:%Y-%m-%d %H:%M} UTC"


def markdown(session: Session) -> str:
    table = [
        "| host | engine | GPU | machine | region | $/h | state | probes | calls (speakers) | $/voice-min | "
        "session cost |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows(session):
        table.append(
            f"| {row['host']} | {row['engine']} | {row['gpu']} | {row['machine']} | {row['region']} | "
            f"{row['usd_per_hour']:.4f} | "
            f"{row['state']} | {row['probes']} | {_calls(row)} | "
            f"{_money(row['usd_per_voice_minute'], 5)} | {_money(row['session_usd'])} |"
        )
    return "\n".join(
        [
            f"# {title(session)}",
            "",
            f"{len(session.hosts)} host(s) created in this window cost {_money(session.bill.total_usd)} "
            "(rent, and traffic at the profiles' expected rates).",
            "",
            *([fleet_glance.markdown(session.glance), "## Hosts of the session", ""] if session.glance else []),
            *table,
            "",
            "Calls (speakers): the most calls in conversation a host held at its profile's voice target, and in "
            "brackets the most callers speaking at once (`fleet bench`); the cost per voice-minute is over the calls.",
            "",
        ]
    )


def _png(fig: Any) -> str:
    """The figure as a PNG data URI; the figure is closed."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


LEGEND_LINES = 16  # past this a legend hides the plot: a fleet of hundreds is read from the glance's tables


def _dress(*axes: Any) -> None:
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.lines and len(ax.lines) <= LEGEND_LINES:
            ax.legend(fontsize=7)


def plots(session: Session) -> dict[str, str]:
    """Each plot's title -> a PNG data URI."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, str] = {}
    fig, (first, decode) = plt.subplots(1, 2, figsize=(11, 4))
    for r in session.hosts:
        levels = _levels(r)
        callers = [lv["callers"] for lv in levels]
        if not callers:
            continue
        name = f"{r.host.name} ({r.engine})"
        (line,) = first.plot(callers, [lv["first_content_p95_ms"] for lv in levels], marker="o", label=f"{name} p95")
        first.plot(
            callers,
            [lv["first_content_p50_ms"] for lv in levels],
            marker=".",
            linestyle="--",
            color=line.get_color(),
            label=f"{name} p50",
        )
        decode.plot(callers, [lv["decode_per_caller_tok_s"] for lv in levels], marker="o", label=name)
    first.set(xlabel="concurrent callers", ylabel="first content (ms)", title="first content")
    decode.set(xlabel="concurrent callers", ylabel="decode per caller (tok/s)", title="decode per caller")
    _dress(first, decode)
    out["What callers feel, by concurrent callers"] = _png(fig)

    fig, ax = plt.subplots(figsize=(11, 3.5))
    for r in session.hosts:
        if r.thermal_rates:
            ax.plot(
                [p["t_s"] for p in r.thermal_rates],
                [p["tokens_per_s"] for p in r.thermal_rates],
                marker=".",
                label=r.host.name,
            )
    ax.set(xlabel="seconds into the thermal probe", ylabel="one-caller decode (tok/s)", title="thermal series")
    _dress(ax)
    out["Thermal series"] = _png(fig)

    fig, ax = plt.subplots(figsize=(11, 3.5))
    events = []  # (time, +rate or -rate) as each host starts and stops billing
    for r in session.hosts:
        line = next(ln for ln in session.bill.lines if ln.host == r.host.name)
        rate = line.total_usd / line.hours if line.hours else 0.0
        events.append((as_utc(r.host.created_at), rate))
        events.append((as_utc(r.host.destroyed_at or session.until), -rate))
    times, costs, total, rate, last = [], [], 0.0, 0.0, None
    for moment, change in sorted(events, key=lambda e: e[0]):
        if last is not None:
            total += rate * (moment - last).total_seconds() / 3600
        times.append(moment)
        costs.append(total)
        rate, last = rate + change, moment
    ax.plot(times, costs, drawstyle="default", marker=".")
    ax.set(xlabel="time (UTC)", ylabel="cost so far ($)", title="the session's cost")
    ax.grid(alpha=0.3)
    fig.autofmt_xdate()
    out["Cost over time"] = _png(fig)
    return out


def html(session: Session, images: dict[str, str]) -> str:
    e = html_escape.escape
    head = ["host", "engine", "GPU", "machine", "region", "$/h", "state", "probes", "calls (speakers)", "$/voice-min"]
    head.append("session cost")
    body = []
    for row in rows(session):
        cells = [
            row["host"],
            row["engine"],
            row["gpu"],
            str(row["machine"]),
            row["region"],
            f"{row['usd_per_hour']:.4f}",
            row["state"],
            row["probes"],
            _calls(row),
            _money(row["usd_per_voice_minute"], 5),
            _money(row["session_usd"]),
        ]
        body.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
    figures = "".join(
        f'<figure><figcaption>{e(title)}</figcaption><img alt="{e(title)}" src="{uri}"></figure>'
        for title, uri in images.items()
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title(session))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }}
th {{ background: #f3f3f3; }}
figure {{ margin: 1.5em 0; }} figcaption {{ font-weight: 600; margin-bottom: 0.4em; }}
img {{ max-width: 100%; }}
</style></head>
<body>
<h1>{e(title(session))}</h1>
<p>{len(session.hosts)} host(s) created in this window cost <strong>{e(_money(session.bill.total_usd))}</strong>
(rent, and traffic at the profiles' expected rates).</p>
{fleet_glance.html(session.glance) + "<h2>Hosts of the session</h2>" if session.glance else ""}
<table id="session-hosts"><thead><tr>{"".join(f"<th>{e(h)}</th>" for h in head)}</tr></thead>
<tbody>{"".join(body)}</tbody></table>
{figures}
</body></html>
"""


def write(session: Session, folder: Path) -> tuple[Path, Path]:
    """The page and the summary written into `folder` (made if missing): their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    page, summary = folder / "report.html", folder / "report.md"
    summary.write_text(markdown(session))
    page.write_text(html(session, plots(session)))
    return page, summary
