"""`fleet offers` and `fleet plan`: what the marketplace offers that fits a profile, and the GPU memory the
profile needs."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from fleet.app import open_fleet
from fleet.cli import render, render_plan
from fleet.cli.common import (
    ByPrice,
    ConfigPath,
    JsonFlag,
    Model,
    Region,
    checked_model_and_region,
    fail,
    load_settings,
    reporter,
    run_async,
)
from fleet.core import config, paths
from fleet.plan.memory import GIB
from fleet.plan.vllm import VllmPlan


def offers_cmd(
    model: Model,
    region: Region,
    max_price: Annotated[float | None, typer.Option("--max-price", help="Highest $/h to show.")] = None,
    save: Annotated[
        bool, typer.Option("--save", help="Write the raw answer as a snapshot (into offers/ in fleet's state dir).")
    ] = False,
    by_price: ByPrice = False,
    explain: Annotated[
        bool,
        typer.Option("--explain", help="Ask for the region and card alone, and count here what each filter removes."),
    ] = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """What the marketplace offers that fits: every filter sent with the search and re-checked here, ranked by
    the expected cost of a voice-minute (what fleet measured on the machine or its GPU model, else the
    profile's slots; past failures, time to READY and the pull's traffic count against it), or by expected
    $/h with --by-price."""
    settings = load_settings(config_path)
    profile, region = checked_model_and_region(settings, model, region, max_price)

    async def go() -> Any:
        async with open_fleet(settings, reporter(json_output)) as fleet:
            funnel = await fleet.offers(model, region, max_price, explain=explain)
            return funnel, fleet.rank(profile, funnel.passed, by_price, funnel.pull_gb)

    funnel, ranked = run_async(go)
    saved = None
    if save:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        # not the repository's offers/: the local cloud loads that, and a snapshot there would shadow its own
        saved = paths.state_dir() / "offers" / f"snapshot-{model}-{region}-{stamp}.json"
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps([o.raw for o in funnel.offers], indent=1, sort_keys=True) + "\n")
    rows = [{**render.offer_row(o, profile), "expected": e.as_dict()} for o, e in ranked]
    if json_output:
        render.print_json(
            {
                "offers": rows,
                "ranked_by": "effective_usd_per_hour" if by_price else "expected_usd_per_voice_minute",
                "funnel": funnel.as_dict(),
                "saved": str(saved) if saved else None,
            }
        )
        return
    order = "effective $/h" if by_price else "expected $/voice-minute"
    render.offers(f"{model} in {region}: {len(rows)} of {funnel.seen} offers pass, by {order}", rows, funnel)
    if saved:
        render.line(f"saved {len(funnel.offers)} raw offers to {saved}")


def plan_cmd(
    model: Model,
    ctx: Annotated[int | None, typer.Option("--ctx", help="Context of one slot (default: the profile's).")] = None,
    slots: Annotated[int | None, typer.Option("--slots", help="Slots (default: the profile's).")] = None,
    gpu_ram: Annotated[
        float | None, typer.Option("--gpu-ram", help="Also say how many slots fit this many GB.")
    ] = None,
    swa_full: Annotated[
        bool | None,
        typer.Option(
            "--swa-full/--no-swa-full", help="Windowed layers keep the whole context (default: the profile's flags)."
        ),
    ] = None,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """GPU memory a model needs, from its GGUF header read over HTTP ranges (no download); for a vLLM profile,
    what its card leaves each sequence, from the safetensors headers and config.json."""
    settings = load_settings(config_path)
    if (ctx is not None and ctx < 1) or (slots is not None and slots < 1) or (gpu_ram is not None and gpu_ram <= 0):
        fail("--ctx, --slots and --gpu-ram must be positive", 2)
    try:
        profile = settings.profile(model)
    except config.ConfigError as e:
        fail(str(e), 2)

    async def go() -> Any:
        async with open_fleet(settings, reporter(json_output)) as fleet:
            return await fleet.card_plan(model, ctx, slots, swa_full)

    plan = run_async(go)
    if isinstance(plan, VllmPlan):  # a repository snapshot's: what one card leaves each sequence
        card = int((gpu_ram or profile.gpu_ram_gb) * GIB)
        if json_output:
            render.print_json(plan.as_dict(card))
        else:
            render_plan.vllm_plan(model, plan, card)
        return
    data = plan.as_dict()
    if gpu_ram is not None:
        data["max_slots"][f"{gpu_ram:g}"] = plan.max_slots(int(gpu_ram * GIB))
    if json_output:
        render.print_json(data)
        return
    render_plan.plan(model, plan, data["max_slots"])
