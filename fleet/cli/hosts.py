"""The commands that bring hosts up and take them down: `up`, `standby`, `serve`, `status`, `endpoints`,
`destroy`."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from fleet.app import open_fleet
from fleet.cli import render
from fleet.cli.common import (
    ByPrice,
    ConfigPath,
    JsonFlag,
    Model,
    Region,
    checked_bring_up,
    fail,
    load_settings,
    reporter,
    run_async,
)
from fleet.control import gateway, sizing
from fleet.control.up import UpRequest
from fleet.core.models import utcnow
from fleet.economics.bill import bill


def up_cmd(
    model: Model,
    region: Region,
    count: Annotated[int, typer.Option("--count", "-n", help="How many hosts to bring up.")] = 1,
    max_price: Annotated[float | None, typer.Option("--max-price", help="Highest $/h for one host.")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show the offers that would be tried; rent nothing.")
    ] = False,
    by_price: ByPrice = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Rent the best passing offers (by expected $/voice-minute, or $/h with --by-price) and leave
    llama-server serving on them, verified."""
    settings = load_settings(config_path)
    profile, region = checked_bring_up(settings, model, region, count, max_price)

    async def go() -> Any:
        async with open_fleet(settings, reporter(json_output)) as fleet:
            return await fleet.up(UpRequest(model, region, count, max_price, dry_run, by_price=by_price))

    result = run_async(go)
    if dry_run:
        rows = [render.offer_row(o, profile) for o in result.planned]
        if json_output:
            render.print_json({"dry_run": True, "offers": rows})
        else:
            render.line(f"would try, in order ({len(rows)} offers):")
            for r in rows:
                render.line(
                    f"  offer {r['id']} machine {r['machine_id']} {r['gpu_name']} {r['geolocation']} "
                    f"${r['effective_usd_per_hour']:.4f}/h"
                )
        if not rows:
            fail("no offer passes the filters (see `fleet offers`)")
        return
    if json_output:
        render.print_json(
            {
                "run_id": result.run_id,
                "ready": [h.name for h in result.ready],
                "attempts": [vars(a) for a in result.attempts],
                "failures": result.failures,
            }
        )
    else:
        render.attempts_and_ready(result)
    if len(result.ready) < count:
        raise typer.Exit(1)


def standby_cmd(
    model: Model,
    region: Region,
    count: Annotated[int, typer.Option("--count", "-n", help="How many hosts to put in the pool.")] = 1,
    max_price: Annotated[float | None, typer.Option("--max-price", help="Highest $/h for one host.")] = None,
    by_price: ByPrice = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Fill the standby pool: bring hosts up exactly as `fleet up` does (weights pulled and verified, probes
    passed), then stop them. A stopped host keeps its disk and bills only for it; it is never published."""
    settings = load_settings(config_path)
    _, region = checked_bring_up(settings, model, region, count, max_price)

    async def go() -> Any:
        async with open_fleet(settings, reporter(json_output)) as fleet:
            return await fleet.up(UpRequest(model, region, count, max_price, by_price=by_price, standby=True))

    result = run_async(go)
    rows = [
        {
            "host": h.name,
            "gpu_name": h.gpu_name,
            "geolocation": h.geolocation,
            "storage_usd_per_hour": h.storage_usd_per_hour,
            "running_usd_per_hour": h.dph_total,
        }
        for h in result.ready
    ]
    if json_output:
        attempts = [vars(a) for a in result.attempts]
        render.print_json({"run_id": result.run_id, "standby": rows, "attempts": attempts, "failures": result.failures})
    else:
        render.standby(rows, result.failures)
    if len(result.ready) < count:
        raise typer.Exit(1)


def status_cmd(
    all_hosts: Annotated[bool, typer.Option("--all", help="Include destroyed and failed hosts.")] = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """The hosts fleet knows, with state, price, cost so far, and (once `fleet bench` ran) the callers each
    holds at its profile's voice target and the cost per voice-minute."""
    settings = load_settings(config_path)

    async def go() -> Any:
        async with open_fleet(settings) as fleet:
            hosts = fleet.status(include_ended=all_hosts)
            front = gateway.line(await gateway.status(fleet)) if settings.serve and not json_output else None
            return hosts, [sizing.observe(fleet, t) for t in settings.serve], front

    hosts, targets, front = run_async(go)
    if json_output:
        render.print_json(hosts)
        return
    for t in targets:  # what `fleet serve` and the daemon keep ([[serve]] in fleet.toml)
        render.line(t.line())
    if front:
        render.line(front)
    if not hosts:
        render.line("no live hosts" + ("" if all_hosts else " (--all shows ended ones)"))
        return
    render.status(hosts)


def serve_cmd(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be done; do nothing.")] = False,
    pause: Annotated[bool, typer.Option("--pause", help="Pause every target: no daemon rents for them.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Keep the targets again.")] = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Keep each [[serve]] target of fleet.toml once (what `fleet daemon` does on every health sweep): READY
    capacity for its calls with headroom, more hosts taken from the standby pool first, the surplus drained
    and destroyed, the pool refilled. --pause stops that everywhere (`fleet destroy --all` pauses too) until
    --resume."""
    settings = load_settings(config_path)
    if not settings.serve:
        fail(f"{settings.source}: no serve target (`serve` tables: model, region, calls, headroom, standby)", 2)
    if pause + resume + dry_run > 1:
        fail("--pause, --resume and --dry-run: one at a time", 2)
    if pause or resume:

        async def switch() -> Any:
            async with open_fleet(settings, reporter(json_output)) as fleet:
                return fleet.pause_serving(pause)

        since = run_async(switch)
        if json_output:
            render.print_json({"paused_since": since.isoformat() if since else None})
        else:
            render.line(f"serve targets paused since {since:%Y-%m-%d %H:%M:%S} UTC" if since else "serve targets kept")
        return

    async def go() -> Any:
        async with open_fleet(settings, reporter(json_output)) as fleet:
            if dry_run:
                return [sizing.observe(fleet, t) for t in settings.serve]
            return [await sizing.keep(fleet, t) for t in settings.serve]

    results = run_async(go)
    if json_output:
        render.print_json([r.as_dict() for r in results])
        return
    for r in results:
        render.line(r.line())
        if dry_run:
            render.line(f"  would do: up {r.up} (pool first), drain {list(r.drain) or 'none'}, pool +{r.refill}")
        else:
            render.line(f"  did: {json.dumps(r.done) if r.done else 'nothing'}")


def endpoints_cmd(
    show_keys: Annotated[bool, typer.Option("--show-keys", help="Include each host's API key.")] = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """What a voice agent needs: the URL, model and slots of every READY host."""
    settings = load_settings(config_path)

    async def go() -> Any:
        async with open_fleet(settings) as fleet:
            return fleet.endpoints()

    endpoints = run_async(go)
    rows = [{k: v for k, v in e.items() if show_keys or k != "api_key"} for e in endpoints]
    if json_output:
        render.print_json(rows)
        return
    for r in rows:
        render.line(" ".join(f"{k}={v}" for k, v in r.items()))
    if not rows:
        render.warn("no READY host")


def destroy_cmd(
    hosts: Annotated[list[str] | None, typer.Argument(help="Host names (see `fleet status`).")] = None,
    all_hosts: Annotated[bool, typer.Option("--all", help="Every live host.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
    keep_gateway: Annotated[
        bool, typer.Option("--keep-gateway", help="With --all: leave the gateway answering 503 (no host) to agents.")
    ] = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Destroy hosts: the instance deleted, confirmed gone, the cost closed. Idempotent. --all also stops this
    machine's gateway (its agents' connections are refused) unless --keep-gateway."""
    settings = load_settings(config_path)
    if bool(hosts) == all_hosts:
        fail("name the hosts to destroy, or pass --all", 2)
    if keep_gateway and not all_hosts:
        fail("--keep-gateway goes with --all (naming hosts never stops the gateway)", 2)
    if all_hosts and not yes:
        if not sys.stdin.isatty():
            fail("refusing to destroy every host without --yes", 2)
        typer.confirm("Destroy every live host?", abort=True, err=True)  # stdout stays the answer's

    async def go() -> Any:
        async with open_fleet(settings, reporter(json_output)) as fleet:
            try:
                return await fleet.destroy(None if all_hosts else list(hosts or []), keep_gateway)
            except KeyError as e:
                fail(str(e.args[0]), 2)

    report = run_async(go)
    session = bill(report.done, utcnow())
    if json_output:
        rows = [
            {"name": h.name, "instance_id": h.instance_id, "state": h.state, "accrued_usd": h.accrued_usd}
            for h in report.done
        ] + [
            {"name": h.name, "instance_id": h.instance_id, "state": h.state, "left_to": h.owner, "until": h.lease_until}
            for h in report.busy
        ]
        render.print_json(
            {
                "hosts": rows,
                "bill": session.as_dict(),
                "gateway_stopped": report.gateway_stopped,
                "serve_paused": report.serve_paused,
            }
        )
    else:
        render.destroyed(report, session)
    if report.busy:
        raise typer.Exit(1)
