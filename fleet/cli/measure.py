"""The commands that measure hosts and read back what was measured: `probe`, `bench`, `report`,
`machines`."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Annotated, Any

import typer

from fleet.app import open_fleet
from fleet.cli import render, render_bench
from fleet.cli.common import ConfigPath, JsonFlag, fail, load_settings, reporter, run_async
from fleet.core import paths
from fleet.core.errors import BadInput
from fleet.core.models import utcnow
from fleet.economics import report
from fleet.host.measure import LOADS, BenchOptions
from fleet.probes.runner import PROBES


def probe_cmd(
    host: Annotated[str, typer.Argument(help="Host name (see `fleet status`).")],
    only: Annotated[
        list[str] | None,
        typer.Option("--only", help="Run only this probe (repeatable): smoke, cache, keepalive, thermal."),
    ] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="With thermal: draw it into this PNG.")] = None,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Run the probes on a serving host now; every result is recorded. Exit 1 when one fails."""
    settings = load_settings(config_path)
    unknown = sorted(set(only or []) - set(PROBES))
    if unknown:
        fail(f"unknown probe {', '.join(unknown)} (have: {', '.join(PROBES)})", 2)
    if plot is not None and "thermal" not in (only or PROBES):
        fail("--plot draws the thermal probe; add --only thermal", 2)

    async def go() -> Any:
        async with open_fleet(settings, reporter(json_output)) as fleet:
            try:
                return await fleet.probe(host, list(only) if only else None, plot)
            except KeyError as e:
                fail(str(e.args[0]), 2)

    results = run_async(go)
    if json_output:
        render.print_json([r.as_dict() for r in results])
    else:
        render.probe_results(results)
        if plot is not None:
            render.line(f"plot written to {plot}")
    if not all(r.passed for r in results):
        raise typer.Exit(1)


def bench_cmd(
    host: Annotated[str, typer.Argument(help="Host name (see `fleet status`).")],
    callers: Annotated[int | None, typer.Option("--callers", help="Most concurrent callers (default: slots).")] = None,
    waves: Annotated[int, typer.Option("--waves", help="Measured waves per level.")] = 3,
    warmup: Annotated[int, typer.Option("--warmup", help="Warm-up waves after the cold one, discarded.")] = 1,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Reply length per turn.")] = 32,
    load: Annotated[
        str, typer.Option("--load", help="speakers (all at once), calls (in conversation) or both.")
    ] = "both",
    calls: Annotated[int | None, typer.Option("--calls", help="Most calls in conversation (default: slots).")] = None,
    turns: Annotated[int, typer.Option("--turns", help="Measured turns of each call in conversation.")] = 4,
    gap: Annotated[
        float | None, typer.Option("--gap", help="Mean seconds between a reply and the call's next turn.")
    ] = None,
    csv_path: Annotated[Path | None, typer.Option("--csv", help="Also write the table as CSV.")] = None,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Replay a voice call at growing concurrency (1, 2, 4 ... then halving the gap) up to the most callers
    the host holds at its profile's voice target, speaking all at once and in conversation (each call waits
    the profile's voice.turn_gap_s between its turns); report what callers feel, both capacities, the calls
    the speakers predict at the duty measured, and the cost per voice-minute (recorded for `fleet status`)."""
    settings = load_settings(config_path)
    if (callers is not None and callers < 1) or waves < 1 or warmup < 0 or max_tokens < 1:
        fail("--callers, --waves and --max-tokens must be at least 1, --warmup at least 0", 2)
    if load not in LOADS or (calls is not None and calls < 1) or turns < 1 or (gap is not None and not 0 <= gap <= 600):
        fail(f"--load is one of {', '.join(LOADS)}; --calls and --turns at least 1; --gap 0 to 600 seconds", 2)
    options = BenchOptions(callers, waves, warmup, max_tokens, load, calls, turns, gap)

    async def go() -> Any:
        async with open_fleet(settings) as fleet:
            try:
                return await fleet.bench(host, options)
            except (KeyError, ValueError) as e:
                fail(str(e.args[0]), 2)

    result = run_async(go)
    if csv_path is not None:
        levels = [level.as_dict() for level in result.levels]
        with csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(levels[0]))
            writer.writeheader()
            writer.writerows(levels)
    if json_output:
        render.print_json(result.as_dict())
        return
    render_bench.bench(host, waves, result)


def report_cmd(
    since: Annotated[
        str, typer.Option("--since", help="Hosts created since: 30m, 6h, 2d or an ISO date (UTC).")
    ] = "24h",
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Where to write report.html and report.md (default: a new folder in fleet's state dir)."
        ),
    ] = None,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """The report: one self-contained HTML page and a markdown summary. First the whole fleet at a glance (hosts
    by region and state, each serve target's calls and cost, failures by machine), then the session's hosts
    (first content and decode against callers, the thermal series, the cost over time)."""
    settings = load_settings(config_path)
    now = utcnow()
    try:
        start = report.parse_since(since, now)
    except BadInput as e:
        fail(str(e), 2)
    target = out_dir or paths.state_dir() / "reports" / f"fleet-report-{now:%Y%m%dT%H%M%SZ}"
    if target.exists() and not target.is_dir():
        fail(f"--out {target}: exists and is not a folder", 2)

    async def go() -> Any:
        async with open_fleet(settings) as fleet:
            return fleet.session(start)

    session = run_async(go)
    page, summary = report.write(session, target)
    if json_output:
        render.print_json(
            {
                "html": str(page),
                "markdown": str(summary),
                "hosts": report.rows(session),
                "total_usd": session.bill.total_usd,
                "glance": session.glance.as_dict() if session.glance else None,
            }
        )
        return
    render.line(summary.read_text(), newlines=True)
    render.line(f"wrote {page} and {summary}")


def machines_cmd(json_output: JsonFlag = False, config_path: ConfigPath = None) -> None:
    """What fleet remembers of every marketplace machine it rented: pull rate, time to READY, probe
    verdicts, one-caller decode, thermal share, capacity, failures by phase and blacklistings."""
    settings = load_settings(config_path)

    async def go() -> Any:
        async with open_fleet(settings) as fleet:
            return fleet.machines()

    machines = run_async(go)
    if json_output:
        render.print_json([m.as_dict() for m in machines])
        return
    if not machines:
        render.line("no machine rented yet")
        return
    render.machines(machines)
