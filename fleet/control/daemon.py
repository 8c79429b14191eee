"""`fleet daemon`: APScheduler runs the health sweep, reconcile and reprice by calling the same
functions as the commands; its job store lives in fleet's database; it serves Prometheus metrics.

On SQLite one daemon per database: a second one finds the lock taken and refuses to start. On
PostgreSQL several may run for availability: each job's tick is claimed by one of them (job_runs),
and a host is acted on only by the process holding its lease (fleet/core/ownership.py), so no two daemons touch
one host at once. SIGTERM
(or SIGINT) lets the job in flight finish and exits cleanly. Every action is one log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from apscheduler.executors.asyncio import AsyncIOExecutor
from apscheduler.jobstores.memory import MemoryJobStore
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from sqlmodel import col, select

from fleet.context import Context, open_context
from fleet.control import gateway, rotation, thermal
from fleet.control import sizing as sizing_mod
from fleet.control.account import check_credit
from fleet.control.reconcile import reconcile
from fleet.core import config, retention
from fleet.core import record as db
from fleet.core.errors import FleetError
from fleet.core.models import LIVE_STATES, Event, HostState, ProbeRun, utcnow
from fleet.economics.bill import accrued_usd
from fleet.engines import registry

log = logging.getLogger("fleet.daemon")


class DaemonRunning(FleetError, RuntimeError):
    """Another daemon holds this database."""


class DaemonLock:
    """An exclusive lock file beside the SQLite database, held for the daemon's life."""

    def __init__(self, database: Path) -> None:
        self.path = database.with_name(database.name + ".daemon.lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DaemonRunning(
                f"another fleet daemon (pid {holder}) is running on {self.path.with_suffix('')}; "
                "on SQLite only one daemon may run per database"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


DAEMON_ID = f"{socket.gethostname()}:{os.getpid()}"


class LogReporter:
    """Each step of a bring-up, replacement or destroy as one line of the daemon's log."""

    def info(self, host: str, message: str) -> None:
        log.info("%s: %s", host, message)

    def progress(self, host: str, what: str, done: int, total: int) -> None:
        if done >= total:
            log.info("%s: pulled %s (%d bytes)", host, what, total)


PRUNE_EVERY_S = 6 * 3600


def _tick(period_s: float) -> int:
    """An interval job's tick: the period it runs in."""
    return int(time.time() // period_s)


def cron_tick(cron: str, now: datetime | None = None) -> int:
    """A cron job's tick: the time (epoch seconds) of its latest firing at or before `now`, so that each firing
    is claimed once whatever the schedule (every 2 minutes, or once a night)."""
    trigger = CronTrigger.from_crontab(cron, timezone="UTC")
    now = now or datetime.now(UTC)
    fire = trigger.get_next_fire_time(None, now - timedelta(days=31))  # every cron fires within a month
    latest = fire
    while fire is not None and fire <= now:
        latest = fire
        fire = trigger.get_next_fire_time(fire, fire + timedelta(seconds=1))
    return int(latest.timestamp()) if latest is not None and latest <= now else 0


async def _run(
    job: str, config_path: str, tick: Callable[[config.Rotation], int], work: Callable[[Context], Awaitable[None]]
) -> None:
    """One job's tick. Several daemons may share a PostgreSQL database: the first to claim the tick
    runs it; the others skip it."""
    settings = registry.load(config_path)
    async with open_context(settings, LogReporter()) as ctx:
        gateway.hang(ctx)
        holder = ctx.record.claim_tick(job, tick(settings.rotation), DAEMON_ID)
        if holder is not None:
            where = "here (a late run of the same tick)" if holder == DAEMON_ID else f"on daemon {holder}"
            log.info("%s: this tick already ran %s; skipped", job, where)
            return
        await work(ctx)


async def _keep_gateway(settings: config.Settings, stop: asyncio.Event) -> None:
    """This machine's gateway, on its own beat (not a claimed tick: every machine keeps its own): started
    again if its HAProxy died, and the record applied (hosts another machine's daemon changed, keys)."""
    async with open_context(settings, LogReporter()) as ctx:
        while not stop.is_set():
            try:
                report = await gateway.keep(ctx)
                if report is not None and report.changed:
                    log.info("gateway: added %s; removed %s", report.added or "none", report.removed or "none")
            except (FleetError, OSError) as e:
                log.warning("gateway: %s", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.gateway.sync_every_s)


def _replaced(report: rotation.HealthReport) -> str:
    return f" -> replaced by {report.replaced_by}" if report.replaced_by else ""


async def run_health(config_path: str) -> None:
    async def work(ctx: Context) -> None:
        reports = await rotation.health_sweep(ctx)
        failing = [r for r in reports if not r.healthy]
        log.info(
            "health: %d READY, %d failing%s",
            len(reports),
            len(failing),
            "".join(f"; {r.name}: {r.reason}{_replaced(r)}" for r in failing),
        )

    await _run("health", config_path, lambda r: _tick(r.health_every_s), work)


async def run_prune(config_path: str) -> None:
    """What housekeeping wrote, past rotation.retention_days, deleted in small batches (fleet/core/retention.py)."""

    async def work(ctx: Context) -> None:
        days = ctx.settings.rotation.retention_days
        if days <= 0:
            return
        pruned = await asyncio.to_thread(retention.prune, ctx.record, utcnow() - timedelta(days=days))
        log.info("prune: %d rows older than %g days (%s)", pruned.total(), days, pruned.rows)

    await _run("prune", config_path, lambda r: _tick(PRUNE_EVERY_S), work)


async def run_reconcile(config_path: str) -> None:
    async def work(ctx: Context) -> None:
        report = await reconcile(ctx)
        log.info(
            "reconcile: checked %d, gone %s, failed %s, strays destroyed %s",
            report["checked"],
            report["gone"],
            report["failed"],
            report["strays_destroyed"],
        )
        for lost in report["lost"]:
            log.error("reconcile: %s %s", lost["host"], lost["why"])
        credit = await check_credit(ctx)  # vast.ai stops every instance at zero: say so ahead of time
        (log.warning if credit.warn else log.info)("%s", credit.line())

    await _run("reconcile", config_path, lambda r: _tick(r.reconcile_every_s), work)


async def run_thermal(config_path: str) -> None:
    async def work(ctx: Context) -> None:
        for r in await thermal.thermal_sweep(ctx):
            log.info("thermal: %s %s%s", r.name, "ok" if r.healthy else f"FAIL: {r.reason}", _replaced(r))

    await _run("thermal", config_path, lambda r: _tick(r.thermal_every_s), work)


async def run_reprice(config_path: str) -> None:
    async def work(ctx: Context) -> None:
        for m in await rotation.reprice(ctx, dry_run=False):
            log.info("reprice: %s %s (%s)", m.name, f"moved to {m.new_host}" if m.new_host else "stays", m.why)

    await _run("reprice", config_path, lambda r: cron_tick(r.reprice_cron), work)  # each firing of its cron once


async def run_serve(config_path: str) -> None:
    async def work(ctx: Context) -> None:
        for target in ctx.settings.serve:
            sizing = await sizing_mod.keep(ctx, target)
            log.info("serve: %s; did %s", sizing.line(), json.dumps(sizing.done) if sizing.done else "nothing")

    await _run("serve", config_path, lambda r: _tick(r.health_every_s), work)


class FleetCollector(Collector):
    """Metrics read from the record at each scrape: hosts by state and model, $/h, cost, probe verdicts,
    replacements and why."""

    def __init__(self, record: db.Record, settings: config.Settings | None = None) -> None:
        self.record = record
        self.settings = settings

    def collect(self) -> Iterator[Any]:
        hosts = self.record.hosts()
        by_state = GaugeMetricFamily("fleet_hosts", "Hosts by state and model", labels=["state", "model"])
        counts: dict[tuple[str, str], int] = {}
        for h in hosts:
            if h.state in LIVE_STATES:
                counts[(h.state, h.model)] = counts.get((h.state, h.model), 0) + 1
        for (state, model), n in sorted(counts.items()):
            by_state.add_metric([state, model], n)
        yield by_state
        live = [h for h in hosts if h.state in LIVE_STATES]
        yield GaugeMetricFamily(
            "fleet_usd_per_hour", "What the live hosts cost per hour", value=sum(h.dph_total for h in live)
        )
        yield GaugeMetricFamily(
            "fleet_accrued_usd",
            "Cost of every host so far",
            value=sum(h.accrued_usd if h.accrued_usd is not None else accrued_usd(h) for h in hosts),
        )
        probes = GaugeMetricFamily(
            "fleet_probe_passed", "Latest verdict of each probe on each READY host", labels=["host", "probe"]
        )
        with db.session(self.record.engine) as s:
            for h in (h for h in hosts if h.state == HostState.READY):
                latest: dict[str, bool] = {}
                for run in s.exec(select(ProbeRun).where(ProbeRun.host_id == h.id).order_by(ProbeRun.id)):
                    latest[run.name] = run.passed
                for name, passed in latest.items():
                    probes.add_metric([h.name, name], 1.0 if passed else 0.0)
            yield probes
            latest = s.exec(select(Event).where(Event.action == "credit").order_by(col(Event.id).desc())).first()
            usd = json.loads(latest.detail).get("usd") if latest is not None else None
            if isinstance(usd, int | float):
                yield GaugeMetricFamily("fleet_credit_usd", "The account's credit at the last reading", value=usd)
            replacements = CounterMetricFamily("fleet_replacements", "Hosts replaced, by why", labels=["reason"])
            reasons: dict[str, int] = {}
            for event in s.exec(select(Event).where(Event.action == "replace", Event.kind == "answer")):
                reason = json.loads(event.detail).get("reason", "").split(":")[0]
                reasons[reason] = reasons.get(reason, 0) + 1
            for reason, n in sorted(reasons.items()):
                replacements.add_metric([reason], n)
            yield replacements
        if self.settings is not None and self.settings.serve:
            yield from gateway_metrics(self.settings)


def gateway_metrics(settings: config.Settings) -> Iterator[Any]:
    """This machine's gateway, per target: requests by what admission made of them (a new call, a turn of a
    call in progress, a new call on a full target; overflowed), and each host's streams now and limit.
    (Scraped in the exporter's thread: its own event loop for the admin socket.)"""
    try:
        targets = asyncio.run(gateway.targets_now(settings))
    except (FleetError, OSError) as e:
        log.warning("gateway metrics: %s", e)
        return
    requests = CounterMetricFamily(
        "fleet_gateway_requests", "Requests through the gateway, by admission", labels=["target", "kind"]
    )
    streams = GaugeMetricFamily("fleet_gateway_streams", "Streams each host carries now", labels=["target", "host"])
    limit = GaugeMetricFamily("fleet_gateway_limit", "Streams each host may carry", labels=["target", "host"])
    first = HistogramMetricFamily(
        "fleet_gateway_first_content_seconds",
        "From a request entering its target's backend to the first content of its answer, per host",
        labels=["target", "host"],
    )
    warm = CounterMetricFamily(
        "fleet_gateway_warm_turns", "Turns of calls in progress answered, and those that hit the host's cache",
        labels=["target", "host", "cache"],
    )  # fmt: skip
    tokens = CounterMetricFamily(
        "fleet_gateway_warm_prompt_tokens", "Warm turns' prompt tokens: taken from the host's cache, or processed",
        labels=["target", "host", "kind"],
    )  # fmt: skip
    for t in targets:
        name = f"{t['model']}.{t['region']}"
        for kind, n in sorted(t["calls"].items()):
            requests.add_metric([name, kind], n)
        for h in t["hosts"]:
            labels = [name, h["host"]]
            streams.add_metric(labels, h["streams"])
            limit.add_metric(labels, h["limit"])
            seen = h.get("first_content")
            if seen:
                cumulative = list(itertools.accumulate(seen["buckets"]))
                buckets = [(f"{b / 1000:g}", n) for b, n in zip(seen["bounds_ms"], cumulative, strict=False)]
                first.add_metric(labels, [*buckets, ("+Inf", cumulative[-1])], sum_value=seen["sum_ms"] / 1000)
            warm.add_metric([*labels, "hit"], h["warm_turns_cached"])
            warm.add_metric([*labels, "miss"], h["warm_turns"] - h["warm_turns_cached"])
            tokens.add_metric([*labels, "cached"], h["cached_tokens"])
            tokens.add_metric([*labels, "processed"], h["processed_tokens"])
    yield from (requests, streams, limit, first, warm, tokens)


def build_scheduler(settings: config.Settings, config_path: str) -> AsyncIOScheduler:
    rot = settings.rotation
    scheduler = AsyncIOScheduler(
        # in memory: jobs are rebuilt at every start and each tick is claimed in job_runs; a job store in the
        # database would unpickle whatever anyone with write access to it put there
        jobstores={"default": MemoryJobStore()},
        executors={"default": AsyncIOExecutor()},
        job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 60},
        timezone="UTC",
    )
    jobs = [
        ("health", "fleet.control.daemon:run_health", IntervalTrigger(seconds=rot.health_every_s)),
        ("reconcile", "fleet.control.daemon:run_reconcile", IntervalTrigger(seconds=rot.reconcile_every_s)),
        ("reprice", "fleet.control.daemon:run_reprice", CronTrigger.from_crontab(rot.reprice_cron, timezone="UTC")),
    ]
    if rot.retention_days:
        jobs.append(("prune", "fleet.control.daemon:run_prune", IntervalTrigger(seconds=PRUNE_EVERY_S)))
    if rot.thermal_every_s:
        jobs.append(("thermal", "fleet.control.daemon:run_thermal", IntervalTrigger(seconds=rot.thermal_every_s)))
    if settings.serve:  # READY capacity sized to calls and the standby pool, on the health sweep's beat
        jobs.append(("serve", "fleet.control.daemon:run_serve", IntervalTrigger(seconds=rot.health_every_s)))
    for job_id, func, trigger in jobs:
        scheduler.add_job(func, trigger, args=[config_path], id=job_id, name=job_id, replace_existing=True)
    return scheduler


async def serve(settings: config.Settings, config_path: str, metrics_port: int | None = None) -> None:
    """Run until SIGTERM or SIGINT."""
    engine = db.open_database(settings.database.target)  # migrated before any job runs
    lock = None if db.is_postgres(engine) else DaemonLock(settings.database.file)
    if lock is not None:
        lock.acquire()
    try:
        port = settings.rotation.metrics_port if metrics_port is None else metrics_port
        if port:
            from prometheus_client import start_http_server

            registry = CollectorRegistry()
            registry.register(FleetCollector(db.Record(engine), settings))
            start_http_server(port, addr="127.0.0.1", registry=registry)
            log.info("metrics on http://127.0.0.1:%d/metrics", port)
        scheduler = build_scheduler(settings, config_path)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        scheduler.start()
        keeper = asyncio.create_task(_keep_gateway(settings, stop), name="gateway") if settings.serve else None
        log.info(
            "daemon started (pid %d): health every %gs, reconcile every %gs, reprice at '%s' UTC",
            os.getpid(),
            settings.rotation.health_every_s,
            settings.rotation.reconcile_every_s,
            settings.rotation.reprice_cron,
        )
        await stop.wait()
        log.info("daemon stopping: letting the job in flight finish")
        scheduler.pause()  # no new run; APScheduler's shutdown would cancel the runs in flight, so wait first
        if keeper is not None:
            await keeper
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if pending:
            await asyncio.wait(pending, timeout=settings.rotation.drain_timeout_s + 60)
        scheduler.shutdown(wait=False)
        log.info("daemon stopped")
    finally:
        if lock is not None:
            lock.release()
        engine.dispose()
