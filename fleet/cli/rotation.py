"""The commands that keep hosts serving: `health`, `reprice`, `reconcile`, and `daemon`, which runs them
on their schedules."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

import typer

from fleet.app import open_fleet
from fleet.cli import render
from fleet.cli.common import ConfigPath, JsonFlag, fail, load_settings, reporter, run_async
from fleet.control import rotation
from fleet.control import thermal as thermal_checks


def health_cmd(
    thermal: Annotated[
        bool,
        typer.Option("--thermal", help="Re-run the thermal probe instead; replace and blacklist a host that fails it."),
    ] = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Check every READY host (marketplace, /health, a short completion); replace the unhealthy."""
    settings = load_settings(config_path)

    async def go() -> Any:
        async with open_fleet(settings, reporter(json_output)) as fleet:
            return await (thermal_checks.thermal_sweep(fleet) if thermal else rotation.health_sweep(fleet))

    reports = run_async(go)
    if json_output:
        render.print_json(rotation.as_dicts(reports))
    else:
        render.health(reports)
    if any(not r.healthy for r in reports):
        raise typer.Exit(1)


def reprice_cmd(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the moves; touch nothing.")] = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Move hosts to cheaper passing offers where the saving clears the thresholds (make before break)."""
    settings = load_settings(config_path)

    async def go() -> Any:
        async with open_fleet(settings, reporter(json_output)) as fleet:
            return await rotation.reprice(fleet, dry_run)

    moves = run_async(go)
    if json_output:
        render.print_json(rotation.as_dicts(moves))
        return
    render.reprice(moves, dry_run)


def daemon_cmd(
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", help="Prometheus port on 127.0.0.1 (default: rotation.metrics_port; 0: off)."),
    ] = None,
    config_path: ConfigPath = None,
) -> None:
    """Run the health sweep, reconcile and reprice on their schedules until SIGTERM."""
    from fleet.control import daemon  # the scheduler and the metrics server: only this command needs them

    settings = load_settings(config_path)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("apscheduler", "httpx", "asyncssh", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        asyncio.run(daemon.serve(settings, str(settings.source.resolve()), metrics_port))
    except daemon.DaemonRunning as e:
        fail(str(e))
    except OSError as e:
        fail(f"daemon: {e}")


def reconcile_cmd(json_output: JsonFlag = False, config_path: ConfigPath = None) -> None:
    """Look up every recorded host by id, finish interrupted work, destroy strays with our label."""
    settings = load_settings(config_path)

    async def go() -> Any:
        async with open_fleet(settings, reporter(json_output)) as fleet:
            return await fleet.reconcile()

    report = run_async(go)
    if json_output:
        render.print_json(report)
        return
    render.reconciled(report)
