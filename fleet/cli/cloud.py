"""The `fleet` command: a thin skin over the library. Parse, call one function, render.

Exit codes: 0 ok, 1 failed, 2 bad input.
"""

from __future__ import annotations

import asyncio
import csv
import json
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import httpx
import typer
from rich.console import Console
from rich.table import Table

from fleet import config, report, rotation, sizing
from fleet.app import open_fleet
from fleet.bill import bill
from fleet.capacity import judge_level
from fleet.errors import BadInput, FleetError
from fleet.lifecycle import UpRequest
from fleet.localcloud import control
from fleet.models import utcnow
from fleet.offers import effective_price_per_hour
from fleet.plan import GIB
from fleet.probes.runner import PROBES

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Keep rented GPU hosts serving llama-server.")
cloud_app = typer.Typer(no_args_is_help=True, help="The local cloud: a vast.ai-compatible marketplace on this machine.")
app.add_typer(cloud_app, name="cloud")

out = Console(soft_wrap=True)
if not out.is_terminal:
    out = Console(soft_wrap=True, width=160)  # piped or captured: no terminal width to fit
err = Console(stderr=True, soft_wrap=True)

StateDir = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        help="The local cloud's state directory (default: $FLEET_LOCALCLOUD_DIR or ~/.local/state/fleet/localcloud).",
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
ByPrice = Annotated[
    bool, typer.Option("--by-price", help="Rank by effective $/h alone, not by expected $/voice-minute.")
]


def fmt(value: float | None, pattern: str) -> str:
    """A table cell: the value in `pattern`, or '-' when there is none."""
    return "-" if value is None else pattern.format(value)


def one_line(error: FleetError) -> str:
    """A fleet error as the one line a user reads: its area (marketplace, plan, ...) or its kind, then why."""
    if error.prefix:
        return f"{error.prefix}: {error}"
    return str(error) if isinstance(error, BadInput) else f"{type(error).__name__}: {error}"


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


ConfigPath = Annotated[
    Path | None, typer.Option("--config", "-c", help="fleet.toml to use (default: $FLEET_CONFIG or ./fleet.toml).")
]
Model = Annotated[str, typer.Option("--model", "-m", help="Model profile from fleet.toml.")]
Region = Annotated[str, typer.Option("--region", "-r", help="Region from fleet.toml, or a country code.")]
T = TypeVar("T")


def load_settings(path: Path | None) -> config.Settings:
    try:
        return config.load(path)
    except config.ConfigError as e:
        fail(str(e), 2)
        raise  # unreachable


def run_async(make: Callable[[], Awaitable[T]]) -> T:
    """Run one library call; map its errors to one-line messages and exit codes."""
    try:
        return asyncio.run(make())  # type: ignore[arg-type]
    except FleetError as e:
        fail(one_line(e), e.exit_code)
    except (httpx.HTTPError, OSError) as e:
        fail(f"{type(e).__name__}: {e}")
    except KeyboardInterrupt:
        fail("interrupted (what was being created has been destroyed)", 130)
    raise AssertionError("unreachable")


class ConsoleReporter:
    """Progress for people, on stderr: one line per step, pull progress at most every few seconds."""

    def __init__(self) -> None:
        self._shown: dict[tuple[str, str], float] = {}

    def info(self, host: str, message: str) -> None:
        err.print(f"[bold]{host}[/bold] {message}", highlight=False)

    def progress(self, host: str, what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._shown.get((host, what), 0.0) < 3.0:
            return
        self._shown[(host, what)] = now
        pct = 100.0 * done / total if total else 100.0
        err.print(f"[bold]{host}[/bold] pull {what}: {pct:5.1f}% of {total / 1e6:,.1f} MB", highlight=False)


def offer_row(o: Any, profile: config.Profile) -> dict[str, Any]:
    return {
        "id": o.id,
        "machine_id": o.machine_id,
        "gpu_name": o.gpu_name,
        "num_gpus": o.num_gpus,
        "gpu_ram_gb": round(o.gpu_ram_mb / 1024, 1),
        "geolocation": o.geolocation,
        "reliability": o.reliability,
        "cuda_max_good": o.cuda_max_good,
        "disk_space_gb": o.disk_space_gb,
        "direct_port_count": o.direct_port_count,
        "inet_up_usd_per_gb": o.inet_up_usd_per_gb,
        "inet_down_usd_per_gb": o.inet_down_usd_per_gb,
        "dph_total": o.dph_total,
        "effective_usd_per_hour": effective_price_per_hour(o, profile),
    }


@app.command("offers")
def offers_cmd(
    model: Model,
    region: Region,
    max_price: Annotated[float | None, typer.Option("--max-price", help="Highest $/h to show.")] = None,
    save: Annotated[bool, typer.Option("--save", help="Write the raw answer into offers/ as a snapshot.")] = False,
    by_price: ByPrice = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """What the marketplace offers that fits: every filter re-checked, ranked by the expected cost of a
    voice-minute (what fleet measured on the machine or its GPU model, else the profile's slots; past
    failures and time to READY count against it), or by effective $/h with --by-price."""
    settings = load_settings(config_path)
    try:
        profile = settings.profile(model)
        settings.region(region)
    except config.ConfigError as e:
        fail(str(e), 2)

    async def go() -> Any:
        async with open_fleet(settings) as fleet:
            funnel = await fleet.offers(model, region, max_price)
            return funnel, fleet.rank(profile, funnel.passed, by_price)

    funnel, ranked = run_async(go)
    saved = None
    if save:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        saved = Path("offers") / f"snapshot-{model}-{region}-{stamp}.json"
        saved.parent.mkdir(exist_ok=True)
        saved.write_text(json.dumps([o.raw for o in funnel.offers], indent=1, sort_keys=True) + "\n")
    rows = [{**offer_row(o, profile), "expected": e.as_dict()} for o, e in ranked]
    if json_output:
        print_json(
            {
                "offers": rows,
                "ranked_by": "effective_usd_per_hour" if by_price else "expected_usd_per_voice_minute",
                "funnel": funnel.as_dict(),
                "saved": str(saved) if saved else None,
            }
        )
        return
    order = "effective $/h" if by_price else "expected $/voice-minute"
    table = Table(title=f"{model} in {region}: {len(rows)} of {funnel.seen} offers pass, by {order}")
    for column in ("offer", "machine", "GPU", "country", "reliab.", "$/h", "eff. $/h", "$/GB", "$/voice-min", "why"):
        table.add_column(column, no_wrap=True)
    for r in rows:
        table.add_row(
            str(r["id"]),
            str(r["machine_id"]),
            f"{r['num_gpus']}x {r['gpu_name']}",
            r["geolocation"][-2:],
            f"{r['reliability']:.3f}",
            f"{r['dph_total']:.4f}",
            f"{r['effective_usd_per_hour']:.4f}",
            f"{max(r['inet_up_usd_per_gb'], r['inet_down_usd_per_gb']):.3f}",
            f"{r['expected']['usd_per_voice_minute']:.5f}",
            r["expected"]["why"],
        )
    out.print(table)
    out.print(f"funnel: {funnel.seen} offered", highlight=False)
    for name, count in funnel.removed:
        out.print(f"  - {count:4d} removed by {name}", highlight=False)
    out.print(f"  = {len(rows)} pass", highlight=False)
    if saved:
        out.print(f"saved {len(funnel.offers)} raw offers to {saved}")


@app.command("plan")
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
    """GPU memory a model needs, from its GGUF header read over HTTP ranges (no download)."""
    settings = load_settings(config_path)
    if (ctx is not None and ctx < 1) or (slots is not None and slots < 1) or (gpu_ram is not None and gpu_ram <= 0):
        fail("--ctx, --slots and --gpu-ram must be positive", 2)
    try:
        settings.profile(model)
    except config.ConfigError as e:
        fail(str(e), 2)

    async def go() -> Any:
        async with open_fleet(settings) as fleet:
            return await fleet.plan(model, ctx, slots, swa_full)

    plan = run_async(go)
    data = plan.as_dict()
    if gpu_ram is not None:
        data["max_slots"][f"{gpu_ram:g}"] = plan.max_slots(int(gpu_ram * GIB))
    if json_output:
        print_json(data)
        return

    def gib(n: int) -> str:
        return f"{n / GIB:8.2f} GiB"

    w = plan.weights
    out.print(
        f"[bold]{model}[/bold]: {plan.slots} slots x {plan.cache.ctx_per_slot} tokens, cache "
        f"{plan.cache.type_k}/{plan.cache.type_v}, -ub {plan.cache.ubatch}, swa-full "
        f"{'on' if plan.cache.swa_full else 'off'}",
        highlight=False,
    )
    table = Table(show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    rows = [
        ("weights: experts", w.experts),
        ("weights: attention", w.attention),
        ("weights: embeddings", w.embeddings),
        ("weights: other", w.other),
    ]
    if plan.draft_weights:
        rows.append(("weights: draft model", plan.draft_weights.total))
    layers = plan.per_slot.layers
    rows += [
        (f"per slot: KV of {layers['global']} global layers", plan.per_slot.kv_global),
        (f"per slot: KV of {layers['windowed']} windowed layers", plan.per_slot.kv_windowed),
        (f"per slot: state of {layers['recurrent']} recurrent layers", plan.per_slot.recurrent),
    ]
    if plan.draft_per_slot:
        rows.append(("per slot: draft model cache", plan.draft_per_slot.total))
    elif plan.draft_weights:
        rows.append(("per slot: draft model cache (reads the target's)", 0))
    rows += [
        ("runtime overhead", plan.overhead_bytes),
        ("headroom", plan.headroom_bytes),
        (f"total at {plan.slots} slots", plan.total_bytes()),
    ]
    for label, value in rows:
        table.add_row(label, gib(value))
    if w.host:
        table.add_row("not on the card: input embedding (host memory)", gib(w.host))
    out.print(table)
    fits = ", ".join(f"{gb} GB: {n}" for gb, n in data["max_slots"].items())
    out.print(f"most slots per card: {fits}", highlight=False)
    out.print(
        f"read {plan.bytes_fetched:,} bytes of {plan.file_bytes:,} "
        f"({100 * plan.bytes_fetched / max(plan.file_bytes, 1):.3f}%)",
        highlight=False,
    )


def checked_bring_up(
    settings: config.Settings, model: str, region: str, count: int, max_price: float | None
) -> config.Profile:
    """The profile of an `up` or `standby`, after its arguments: one line and exit 2 for bad input."""
    if count < 1:
        fail("--count must be at least 1", 2)
    if max_price is not None and max_price <= 0:
        fail("--max-price must be positive", 2)
    try:
        profile = settings.profile(model)
        settings.region(region)
    except config.ConfigError as e:
        fail(str(e), 2)
    return profile


@app.command("up")
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
    profile = checked_bring_up(settings, model, region, count, max_price)

    async def go() -> Any:
        async with open_fleet(settings, None if json_output else ConsoleReporter()) as fleet:
            return await fleet.up(UpRequest(model, region, count, max_price, dry_run, by_price=by_price))

    result = run_async(go)
    attempts = [vars(a) for a in result.attempts]
    if dry_run:
        rows = [offer_row(o, profile) for o in result.planned]
        if json_output:
            print_json({"dry_run": True, "offers": rows})
        else:
            out.print(f"would try, in order ({len(rows)} offers):")
            for r in rows:
                out.print(
                    f"  offer {r['id']} machine {r['machine_id']} {r['gpu_name']} {r['geolocation']} "
                    f"${r['effective_usd_per_hour']:.4f}/h",
                    highlight=False,
                )
        if not rows:
            fail("no offer passes the filters (see `fleet offers`)")
        return
    if json_output:
        print_json(
            {
                "run_id": result.run_id,
                "ready": [h.name for h in result.ready],
                "attempts": attempts,
                "failures": result.failures,
            }
        )
    else:
        for a in result.attempts:
            if a.outcome != "ready":
                out.print(
                    f"attempt {a.host}: offer {a.offer_id} (${a.dph_total:.4f}/h, ${a.inet_usd_per_gb:.3f}/GB) "
                    f"failed in {a.phase}: {a.reason}",
                    highlight=False,
                )
        for h in result.ready:
            out.print(
                f"[green]READY[/green] {h.name} {h.api_url} {h.gpu_name} {h.geolocation} ${h.dph_total:.4f}/h",
                highlight=False,
            )
        for f in result.failures:
            err.print(f"[red]not up:[/red] {f}", highlight=False)
    if len(result.ready) < count:
        raise typer.Exit(1)


@app.command("standby")
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
    checked_bring_up(settings, model, region, count, max_price)

    async def go() -> Any:
        async with open_fleet(settings, None if json_output else ConsoleReporter()) as fleet:
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
        print_json({"run_id": result.run_id, "standby": rows, "attempts": attempts, "failures": result.failures})
    else:
        for r in rows:
            out.print(
                f"[cyan]STANDBY[/cyan] {r['host']} {r['gpu_name']} {r['geolocation']}: "
                f"${r['storage_usd_per_hour']:.4f}/h stopped (${r['running_usd_per_hour']:.4f}/h running)",
                highlight=False,
            )
        for f in result.failures:
            err.print(f"[red]not in the pool:[/red] {f}", highlight=False)
    if len(result.ready) < count:
        raise typer.Exit(1)


@app.command("status")
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
            return fleet.status(include_ended=all_hosts), [sizing.observe(fleet, t) for t in settings.serve]

    hosts, targets = run_async(go)
    if json_output:
        print_json(hosts)
        return
    for t in targets:  # what `fleet serve` and the daemon keep ([[serve]] in fleet.toml)
        out.print(t.line(), highlight=False)
    if not hosts:
        out.print("no live hosts" + ("" if all_hosts else " (--all shows ended ones)"))
        return
    table = Table()
    for column in ("name", "state", "instance", "GPU", "where", "$/h", "cost $", "callers", "$/voice-min", "endpoint"):
        table.add_column(column, no_wrap=True)
    for h in hosts:
        table.add_row(
            h["name"],
            h["state"],
            str(h["instance_id"] or "-"),
            h["gpu_name"],
            h["geolocation"][-2:],
            f"{h['dph_total']:.3f}",
            f"{h['accrued_usd']:.4f}",
            "-" if h["capacity"] is None else f"{'>=' if h['capacity_at_least'] else ''}{h['capacity']}",
            "-" if h["usd_per_voice_minute"] is None else f"{h['usd_per_voice_minute']:.5f}",
            h["endpoint"] or "-",
        )
    out.print(table)


@app.command("serve")
def serve_cmd(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be done; do nothing.")] = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Keep each [[serve]] target of fleet.toml once (what `fleet daemon` does on every health sweep): READY
    capacity for its calls with headroom, more hosts taken from the standby pool first, the surplus drained
    and destroyed, the pool refilled."""
    settings = load_settings(config_path)
    if not settings.serve:
        fail(f"{settings.source}: no serve target (`serve` tables: model, region, calls, headroom, standby)", 2)

    async def go() -> Any:
        async with open_fleet(settings, None if json_output else ConsoleReporter()) as fleet:
            if dry_run:
                return [sizing.observe(fleet, t) for t in settings.serve]
            return [await sizing.keep(fleet, t) for t in settings.serve]

    results = run_async(go)
    if json_output:
        print_json([r.as_dict() for r in results])
        return
    for r in results:
        out.print(r.line(), highlight=False)
        if dry_run:
            out.print(f"  would do: up {r.up} (pool first), drain {list(r.drain) or 'none'}, pool +{r.refill}")
        else:
            out.print(f"  did: {json.dumps(r.done) if r.done else 'nothing'}", highlight=False)


@app.command("report")
def report_cmd(
    since: Annotated[
        str, typer.Option("--since", help="Hosts created since: 30m, 6h, 2d or an ISO date (UTC).")
    ] = "24h",
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Where to write report.html and report.md (default: a new folder).")
    ] = None,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """The benchmark session report: one self-contained HTML page (first content and decode against
    callers, the thermal series, the cost over time) and a markdown summary per host."""
    settings = load_settings(config_path)
    now = utcnow()
    try:
        start = report.parse_since(since, now)
    except BadInput as e:
        fail(str(e), 2)
    target = out_dir or Path(f"fleet-report-{now:%Y%m%dT%H%M%SZ}")
    if target.exists() and not target.is_dir():
        fail(f"--out {target}: exists and is not a folder", 2)

    async def go() -> Any:
        async with open_fleet(settings) as fleet:
            return fleet.session(start)

    session = run_async(go)
    target.mkdir(parents=True, exist_ok=True)
    (target / "report.md").write_text(report.markdown(session))
    (target / "report.html").write_text(report.html(session, report.plots(session)))
    if json_output:
        print_json(
            {
                "html": str(target / "report.html"),
                "markdown": str(target / "report.md"),
                "hosts": report.rows(session),
                "total_usd": session.bill.total_usd,
            }
        )
        return
    out.print(report.markdown(session), highlight=False)
    out.print(f"wrote {target / 'report.html'} and {target / 'report.md'}", highlight=False)


@app.command("machines")
def machines_cmd(json_output: JsonFlag = False, config_path: ConfigPath = None) -> None:
    """What fleet remembers of every marketplace machine it rented: pull rate, time to READY, probe
    verdicts, one-caller decode, thermal share, capacity, failures by phase and blacklistings."""
    settings = load_settings(config_path)

    async def go() -> Any:
        async with open_fleet(settings) as fleet:
            return fleet.machines()

    machines = run_async(go)
    if json_output:
        print_json([m.as_dict() for m in machines])
        return
    if not machines:
        out.print("no machine rented yet")
        return
    table = Table()
    for column in (
        "machine",
        "GPU",
        "where",
        "hosts",
        "READY",
        "pull MB/s",
        "to READY s",
        "decode tok/s",
        "thermal",
        "callers",
        "probes failed",
        "failures",
        "blacklisted",
    ):
        table.add_column(column, no_wrap=True)

    for m in machines:
        failed = ", ".join(f"{name} {c['failed']}" for name, c in m.probes.items() if c["failed"]) or "-"
        table.add_row(
            str(m.machine_id),
            m.gpu_name,
            m.geolocation[-2:],
            str(m.hosts),
            str(m.ready),
            fmt(m.pull_mb_s, "{:.1f}"),
            fmt(m.create_to_ready_s, "{:.0f}"),
            fmt(m.one_caller_decode_tok_s, "{:.1f}"),
            fmt(m.thermal_share, "{:.2f}"),
            fmt(m.capacity, "{}"),
            failed,
            ", ".join(f"{phase} {n}" for phase, n in m.failures.items()) or "-",
            f"{m.blacklistings} ({m.last_blacklist_reason})" if m.blacklistings else "-",
        )
    out.print(table)


@app.command("endpoints")
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
        print_json(rows)
        return
    for r in rows:
        out.print(" ".join(f"{k}={v}" for k, v in r.items()), highlight=False)
    if not rows:
        err.print("no READY host")


@app.command("destroy")
def destroy_cmd(
    hosts: Annotated[list[str] | None, typer.Argument(help="Host names (see `fleet status`).")] = None,
    all_hosts: Annotated[bool, typer.Option("--all", help="Every live host.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Destroy hosts: the instance deleted, confirmed gone, the cost closed. Idempotent."""
    settings = load_settings(config_path)
    if bool(hosts) == all_hosts:
        fail("name the hosts to destroy, or pass --all", 2)
    if all_hosts and not yes:
        if not sys.stdin.isatty():
            fail("refusing to destroy every host without --yes", 2)
        typer.confirm("Destroy every live host?", abort=True)

    async def go() -> Any:
        async with open_fleet(settings, None if json_output else ConsoleReporter()) as fleet:
            try:
                return await fleet.destroy(None if all_hosts else list(hosts or []))
            except KeyError as e:
                fail(str(e.args[0]), 2)

    report = run_async(go)
    session = bill(report.done, utcnow())
    rows = [
        {"name": h.name, "instance_id": h.instance_id, "state": h.state, "accrued_usd": h.accrued_usd}
        for h in report.done
    ] + [
        {"name": h.name, "instance_id": h.instance_id, "state": h.state, "left_to": h.owner, "until": h.lease_until}
        for h in report.busy
    ]
    if json_output:
        print_json({"hosts": rows, "bill": session.as_dict()})
    else:
        for h in report.done:
            out.print(
                f"{h.name}: {h.state} (instance {h.instance_id or '-'}, cost ${h.accrued_usd or 0:.4f})",
                highlight=False,
            )
        for h in report.busy:
            out.print(
                f"{h.name}: left alone: {h.state} under another fleet process ({h.owner}) until "
                f"{h.lease_until:%H:%M:%S} UTC; run again once it is done",
                highlight=False,
            )
        if not rows:
            out.print("nothing to destroy")
        if session.lines:
            table = Table(title="the bill")
            for column in ("host", "GPU", "where", "hours", "rent $", "traffic $", "total $"):
                table.add_column(column, no_wrap=True)
            for line in session.lines:
                table.add_row(
                    line.host,
                    line.gpu_name,
                    line.geolocation[-2:],
                    f"{line.hours:.3f}",
                    f"{line.rent_usd:.4f}",
                    f"{line.traffic_usd:.4f}",
                    f"{line.total_usd:.4f}",
                )
            out.print(table)
            out.print(f"total: ${session.total_usd:.4f} (traffic at the profiles' expected rates)", highlight=False)
    if report.busy:
        raise typer.Exit(1)


@app.command("probe")
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
        async with open_fleet(settings, None if json_output else ConsoleReporter()) as fleet:
            try:
                return await fleet.probe(host, list(only) if only else None, plot)
            except KeyError as e:
                fail(str(e.args[0]), 2)

    results = run_async(go)
    if json_output:
        print_json([r.as_dict() for r in results])
    else:
        for r in results:
            mark = "[green]pass[/green]" if r.passed else "[red]FAIL[/red]"
            shown = {k: v for k, v in r.metrics.items() if k != "series"}
            out.print(f"{mark} {r.name}: {r.diagnosis}", highlight=False)
            out.print(f"     {json.dumps(shown, default=str)}", highlight=False)
        if plot is not None:
            out.print(f"plot written to {plot}")
    if not all(r.passed for r in results):
        raise typer.Exit(1)


@app.command("bench")
def bench_cmd(
    host: Annotated[str, typer.Argument(help="Host name (see `fleet status`).")],
    callers: Annotated[int | None, typer.Option("--callers", help="Most concurrent callers (default: slots).")] = None,
    waves: Annotated[int, typer.Option("--waves", help="Measured waves per level.")] = 3,
    warmup: Annotated[int, typer.Option("--warmup", help="Warm-up waves after the cold one, discarded.")] = 1,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Reply length per turn.")] = 32,
    csv_path: Annotated[Path | None, typer.Option("--csv", help="Also write the table as CSV.")] = None,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Replay a voice call at growing concurrency (1, 2, 4 ... then halving the gap) up to the most callers
    the host holds at its profile's voice target; report what callers feel, that capacity and the cost per
    voice-minute (recorded for `fleet status`)."""
    settings = load_settings(config_path)
    if (callers is not None and callers < 1) or waves < 1 or warmup < 0 or max_tokens < 1:
        fail("--callers, --waves and --max-tokens must be at least 1, --warmup at least 0", 2)

    async def go() -> Any:
        async with open_fleet(settings) as fleet:
            try:
                return await fleet.bench(host, callers, waves, warmup, max_tokens)
            except KeyError as e:
                fail(str(e.args[0]), 2)

    report = run_async(go)
    levels = [level.as_dict() for level in report.levels]
    if csv_path is not None:
        with csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(levels[0]))
            writer.writeheader()
            writer.writerows(levels)
    if json_output:
        print_json(report.as_dict())
        return
    target = report.capacity.target
    table = Table(title=f"{host}: a voice call replayed, {waves} measured waves per level")
    for column in (
        "callers",
        "first content p50 ms",
        "p95 ms",
        "decode tok/s",
        "share",
        "throughput tok/s",
        "cache reuse",
        "errors",
        "target",
    ):
        table.add_column(column, no_wrap=True)

    for level, result in zip(levels, report.levels, strict=True):
        why = judge_level(result, target)
        table.add_row(
            str(level["callers"]),
            fmt(level["first_content_p50_ms"], "{:.1f}"),
            fmt(level["first_content_p95_ms"], "{:.1f}"),
            fmt(level["decode_per_caller_tok_s"], "{:.1f}"),
            fmt(level["decode_share"], "{:.2f}"),
            fmt(level["throughput_tok_s"], "{:.1f}"),
            fmt(level["cache_reuse"], "{:.0%}"),
            str(level["errors"]),
            "met" if why is None else f"missed: {why}",
        )
    out.print(table)
    held = report.capacity
    out.print(
        f"capacity: {'at least ' if held.exhausted else ''}{held.callers} concurrent callers at first content "
        f"p95 <= {target.first_content_p95_ms:g} ms and >= {target.decode_tok_s:g} tok/s per caller"
        + (f" ({held.callers + 1} missed: {held.why_missed})" if held.why_missed else "")
    )
    if report.usd_per_voice_minute is not None:
        out.print(
            f"cost: ${report.usd_per_voice_minute:.5f} per voice-minute "
            f"(${report.effective_usd_per_hour:.4f}/h with traffic, over {held.callers} calls)"
        )


@app.command("health")
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
        async with open_fleet(settings, None if json_output else ConsoleReporter()) as fleet:
            return await (rotation.thermal_sweep(fleet) if thermal else rotation.health_sweep(fleet))

    reports = run_async(go)
    if json_output:
        print_json(rotation.as_dicts(reports))
    else:
        for r in reports:
            mark = "[green]ok[/green]" if r.healthy else f"[red]failing ({r.failures})[/red]"
            extra = f"; replaced by {r.replaced_by}" if r.replaced_by else ""
            out.print(f"{r.name}: {mark} {'' if r.healthy else r.reason}{extra}", highlight=False)
        if not reports:
            out.print("no READY host")


@app.command("reprice")
def reprice_cmd(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the moves; touch nothing.")] = False,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Move hosts to cheaper passing offers where the saving clears the thresholds (make before break)."""
    settings = load_settings(config_path)

    async def go() -> Any:
        async with open_fleet(settings, None if json_output else ConsoleReporter()) as fleet:
            return await rotation.reprice(fleet, dry_run)

    moves = run_async(go)
    if json_output:
        print_json(rotation.as_dicts(moves))
        return
    table = Table(title="reprice" + (" (dry run: nothing changed)" if dry_run else ""))
    for column in ("host", "now $/h", "best offer", "best $/h", "saving %", "$/month net", "move", "why"):
        table.add_column(column, no_wrap=column != "why")
    for m in moves:
        moved = ("-" if not m.move else (m.new_host or "failed")) if not dry_run else ("yes" if m.move else "no")
        table.add_row(
            m.name,
            f"{m.current_usd_per_hour:.4f}",
            str(m.best_offer or "-"),
            "-" if m.best_usd_per_hour is None else f"{m.best_usd_per_hour:.4f}",
            f"{m.saving_percent:.1f}",
            f"{m.saving_usd_per_month:.2f}",
            moved,
            m.why,
        )
    out.print(table)


@app.command("daemon")
def daemon_cmd(
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", help="Prometheus port on 127.0.0.1 (default: rotation.metrics_port; 0: off)."),
    ] = None,
    config_path: ConfigPath = None,
) -> None:
    """Run the health sweep, reconcile and reprice on their schedules until SIGTERM."""
    import logging

    from fleet import daemon

    settings = load_settings(config_path)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("apscheduler", "httpx", "asyncssh"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        asyncio.run(daemon.serve(settings, str(settings.source.resolve()), metrics_port))
    except daemon.DaemonRunning as e:
        fail(str(e))
    except OSError as e:
        fail(f"daemon: {e}")


@app.command("reconcile")
def reconcile_cmd(json_output: JsonFlag = False, config_path: ConfigPath = None) -> None:
    """Look up every recorded host by id, finish interrupted work, destroy strays with our label."""
    settings = load_settings(config_path)

    async def go() -> Any:
        async with open_fleet(settings, None if json_output else ConsoleReporter()) as fleet:
            return await fleet.reconcile()

    report = run_async(go)
    if json_output:
        print_json(report)
        return
    out.print(
        f"checked {report['checked']} hosts; gone: {len(report['gone'])}; failed and destroyed: "
        f"{len(report['failed'])}; destroys finished: {len(report['destroyed'])}; adopted: {len(report['adopted'])};"
        f" strays destroyed: {len(report['strays_destroyed'])}; left to their owners: {len(report['busy'])};"
        f" not yet listed: {len(report['waiting'])}",
        highlight=False,
    )


@cloud_app.command("start")
def cloud_start(
    state_dir: StateDir = None,
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1 (0: any free port).")] = 0,
    json_output: JsonFlag = False,
) -> None:
    """Start the local cloud (no-op when it already runs)."""
    directory = state_dir or control.default_state_dir()
    try:
        info = control.start(directory, port=port)
    except control.CloudControlError as e:
        fail(str(e))
    status = control.status(directory)
    if json_output:
        print_json(status)
    else:
        out.print(f"local cloud at {info.url} (pid {info.pid}); API key in {info.api_key_file}")


@cloud_app.command("stop")
def cloud_stop(state_dir: StateDir = None, json_output: JsonFlag = False) -> None:
    """Stop the local cloud: every host's processes end; instances stay recorded."""
    directory = state_dir or control.default_state_dir()
    stopped = control.stop(directory)
    if json_output:
        print_json({"stopped": stopped})
    else:
        out.print("local cloud stopped" if stopped else "local cloud was not running")


@cloud_app.command("status")
def cloud_status(state_dir: StateDir = None, json_output: JsonFlag = False) -> None:
    """Where the local cloud listens, where its API key is, and how many instances it has."""
    status = control.status(state_dir or control.default_state_dir())
    if json_output:
        print_json(status)
        return
    table = Table(show_header=False)
    for key, value in status.items():
        table.add_row(key, str(value))
    out.print(table)


if __name__ == "__main__":
    app()
