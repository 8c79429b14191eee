"""`fleet doctor --live`: fleet's readings of vast.ai checked against the marketplace, with the user's own key
(fleet/control/doctor.py)."""

from __future__ import annotations

import math
from typing import Annotated

import typer

from fleet.app import open_fleet
from fleet.cli import render
from fleet.cli.common import ConfigPath, JsonFlag, fail, load_settings, reporter, run_async
from fleet.control import doctor


def doctor_cmd(
    live: Annotated[
        bool,
        typer.Option("--live", help="Ask the marketplace: rents its cheapest offer for minutes, then destroys it."),
    ] = False,
    budget_usd: Annotated[float, typer.Option("--budget-usd", help="The most the rental may cost, in $.")] = 0.10,
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="The profile whose image is rented (default: the first).")
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Rent without asking.")] = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Check what no source settles about the marketplace (docs/vast-fidelity.md), once, with your key."""
    settings = load_settings(config_path)
    if not live:
        fail("fleet doctor asks the marketplace itself: pass --live (it rents the cheapest offer for minutes, "
             "within --budget-usd, and destroys it)", 2)  # fmt: skip
    if not math.isfinite(budget_usd) or budget_usd <= 0:
        fail("--budget-usd must be a positive number of dollars", 2)
    name = model or next(iter(settings.models))
    if name not in settings.models:
        fail(f"no model {name!r} in {settings.source} (have: {', '.join(sorted(settings.models))})", 2)
    if not yes:
        if json_output:
            fail("--json needs --yes: nothing is rented without a yes", 2)
        typer.confirm(f"Rent the cheapest offer for a few minutes, for at most ${budget_usd:.2f}?", abort=True)

    async def go() -> doctor.DoctorReport:
        async with open_fleet(settings, reporter(json_output)) as fleet:
            return await doctor.live(fleet, budget_usd, name)

    report = run_async(go)
    if json_output:
        render.print_json(report.as_dict())  # the report says `destroyed` and `interrupted` itself
        if not report.destroyed or report.interrupted:
            raise typer.Exit(1 if not report.destroyed else 130)
        return
    for finding in report.findings:
        render.warn(("doctor", "bold"), f" {finding.line()}")
    spent = f"instance {report.instance_id}, held {report.held_s:.0f} s, at most ${report.cost_usd:.4f}"
    render.warn(("doctor", "bold"), f" {spent if report.instance_id else 'nothing rented'}")
    if not report.destroyed:
        fail(f"instance {report.instance_id} was not confirmed destroyed: destroy it (fleet reconcile finds it)")
    if report.interrupted:
        fail("interrupted: the rental was destroyed", 130)
