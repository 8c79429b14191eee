"""Rotation: health sweeps, nightly repricing, and make-before-break replacement.

A replacement brings the new host up through the whole `fleet up` path (probes included) and
publishes it before the old one leaves the endpoints; the old one then drains (no request in
flight, or the drain timeout) and is destroyed. A replacement that fails leaves the old host as it
was. The daemon's jobs call these same functions.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta

from fleet.context import Context
from fleet.control import gateway, offers
from fleet.control.destroy import destroy
from fleet.control.healthcheck import NOT_THE_MACHINES, checked_as_listed
from fleet.control.up import UpRequest, up
from fleet.core.models import Host, HostState, as_utc, utcnow
from fleet.economics.offers import effective_price_per_hour
from fleet.host.endpoints import publish
from fleet.host.teardown import blacklist_machine, drain
from fleet.market import CreditSpent, Instance, Maintenance

HOURS_PER_MONTH = 730


@dataclass
class HealthReport:
    name: str
    healthy: bool
    reason: str
    failures: int
    replaced_by: str | None = None
    blame: bool = True  # the machine is to blame (blacklisted when replaced); not when vast.ai stopped it


@dataclass
class Move:
    name: str
    model: str
    region: str
    current_offer: int
    current_usd_per_hour: float
    best_offer: int | None
    best_usd_per_hour: float | None
    saving_percent: float
    saving_usd_per_month: float  # net of what the move costs
    move: bool
    why: str
    new_host: str | None = None


def ending_soon(host: Host, by: datetime) -> str | None:
    """Why a healthy host must move before `by`, if it must: vast.ai stops the instance when its contract
    ends and never starts it again; no client of fleet's trusts its certificate after it ends."""
    for what, end in (("contract", host.contract_end_at), ("certificate", host.certificate_until)):
        if end is not None and as_utc(end) <= by:
            return f"its {what} ends at {as_utc(end):%Y-%m-%d %H:%M} UTC"
    return None


def maintenance_soon(host: Host, windows: list[Maintenance], by: datetime) -> str | None:
    """Why a healthy host must move before `by`: its machine's host announced maintenance that starts by then
    (the machine goes down with the host on it)."""
    starts = [w.start for w in windows if w.machine_id == host.machine_id and w.start <= by.timestamp()]
    if not starts:
        return None
    return f"its machine's maintenance starts at {datetime.fromtimestamp(min(starts), UTC):%Y-%m-%d %H:%M} UTC"


def take_extension(ctx: Context, host: Host, instance: Instance | None) -> None:
    """A contract its host extended (vast.ai: the host may move the end date forward, and says so): the host
    serves on until the new end, instead of being replaced before the old one. An end moved sooner is not
    taken (a rental's end is locked when it is rented)."""
    end = instance.contract_end if instance is not None else None
    if end is None or not math.isfinite(end) or host.contract_end_at is None:
        return
    extended = datetime.fromtimestamp(end, UTC)
    if extended > as_utc(host.contract_end_at):
        ctx.record.update(host, contract_end_at=extended)
        ctx.record.event("info", "contract", json.dumps({"extended_to": extended.isoformat()}), host.id)


async def health_sweep(ctx: Context) -> list[HealthReport]:
    """Check every READY host; replace those that failed K sweeps in a row or whose instance is gone."""
    hosts = ctx.record.hosts(states=(HostState.READY,))
    view, checks = await checked_as_listed(ctx, hosts)
    reports, doomed = [], []
    ending = utcnow() + timedelta(hours=ctx.settings.rotation.contract_margin_hours)
    # windows unknown (the marketplace would not say): the sweep goes on without them, never aborted
    windows = (await ctx.market.maintenances(sorted({h.machine_id for h in hosts})) if hosts else []) or []
    for host, ((healthy, gone, reason), memory) in zip(hosts, checks, strict=True):
        take_extension(ctx, host, view.get(host.instance_id or -1))
        failures = 0 if healthy else host.health_failures + 1
        ctx.record.update(
            host,
            health_failures=failures,
            last_health_at=utcnow(),
            ram_total_mib=memory.total_mib if memory else None,
            ram_available_mib=memory.available_mib if memory else None,
            server_rss_mib=memory.server_rss_mib if memory else None,
        )
        if not healthy:
            ctx.record.event("error", "health", json.dumps({"reason": reason, "failures": failures}), host.id)
        report = HealthReport(host.name, healthy, reason, failures, blame=not reason.startswith(NOT_THE_MACHINES))
        reports.append(report)
        if gone or failures >= ctx.settings.rotation.unhealthy_after_sweeps:
            doomed.append((host, report))
        elif ends := ending_soon(host, ending) or maintenance_soon(host, windows, ending):
            report.reason, report.blame = ends, False
            doomed.append((host, report))
    limit = asyncio.Semaphore(ctx.settings.rotation.max_concurrent_replacements)

    async def replace_one(host: Host, report: HealthReport) -> None:
        async with limit:
            why = report.reason if report.healthy else f"unhealthy: {report.reason}"
            # a dead host leaves the endpoints even when no replacement can be made (a cap, no offer)
            new = await replace(ctx, host, why, blacklist=report.blame, retire_anyway=not report.healthy)
            report.replaced_by = new.name if new else None

    await asyncio.gather(*(replace_one(h, r) for h, r in doomed))
    return reports


async def replace(
    ctx: Context,
    old: Host,
    reason: str,
    *,
    blacklist: bool,
    max_effective_price: float | None = None,
    retire_anyway: bool = False,
) -> Host | None:
    """Make before break: the new host READY and published first; then the old one drains and goes.
    Returns None, touching nothing, when another process works on the old host or it left READY. When no
    replacement comes up, the old host stays, unless `retire_anyway` (it is dead: it serves no one)."""
    current = ctx.record.host(old.id) if old.id is not None else None
    if current is None or current.state != HostState.READY or not ctx.leases.claim(current):
        ctx.reporter.info(old.name, "another process works on this host, or it left READY; skipped")
        return None
    try:
        new = await _replace(ctx, current, reason, blacklist=blacklist, max_effective_price=max_effective_price)
        if new is None and retire_anyway and current.state == HostState.READY:
            ctx.reporter.info(old.name, "no replacement came up; retired all the same: a dead host serves no one")
            await retire(ctx, current, reason, blacklist=blacklist)
        return new
    finally:
        if current.destroyed_at is None:
            ctx.leases.release(current)


async def _replace(
    ctx: Context, old: Host, reason: str, *, blacklist: bool, max_effective_price: float | None
) -> Host | None:
    ctx.record.event("intent", "replace", json.dumps({"reason": reason}), old.id)
    ctx.reporter.info(old.name, f"replacing ({reason})")
    try:
        result = await up(ctx, UpRequest(old.model, old.region, 1, max_effective_price=max_effective_price))
    except CreditSpent as e:
        ctx.record.event("error", "replace", json.dumps({"reason": reason, "failed": str(e)}), old.id)
        ctx.reporter.info(old.name, f"no replacement: {e}")
        return None
    if not result.ready:
        why = "; ".join(result.failures) or "no host came up"
        ctx.record.event("error", "replace", json.dumps({"reason": reason, "failed": why}), old.id)
        ctx.reporter.info(old.name, f"replacement failed, keeping this host: {why}")
        return None
    new = result.ready[0]
    ctx.record.update(new, replaces=old.id)
    await retire(ctx, old, reason, blacklist=blacklist)
    ctx.record.event("answer", "replace", json.dumps({"reason": reason, "new_host": new.name}), old.id)
    return new


async def retire(ctx: Context, host: Host, reason: str, *, blacklist: bool) -> None:
    """Take the host out of the endpoints, let it finish what it serves, destroy it. The caller owns it (or
    it is taken here); a host another process works on is left alone."""
    if not ctx.leases.claim(host):
        ctx.reporter.info(host.name, "another process works on this host; not retired")
        return
    if not ctx.record.transition(host, HostState.DRAINING):
        ctx.reporter.info(host.name, f"it is {host.state} now, not READY; not retired")
        return
    await publish(ctx)  # the gateway: no new call for it; its own calls go on
    started = time.monotonic()
    left = await gateway.wait_calls_end(ctx, host, ctx.settings.rotation.drain_timeout_s)
    if left:
        ctx.reporter.info(host.name, f"{left} call(s) still talking at the drain timeout: they move to other hosts")
    await drain(ctx, host, ctx.settings.rotation.drain_timeout_s - (time.monotonic() - started))
    if blacklist:
        blacklist_machine(ctx, host, "rotation", reason)
    await destroy(ctx, [host.name])


def judge_move(
    host: Host,
    best_offer_id: int | None,
    best_usd_per_hour: float | None,
    min_percent: float,
    min_usd_per_month: float,
    bring_up_hours: float,
) -> Move:
    """Is moving to the best offer worth it? Pure: the saving net of the move's cost (both hosts
    billed while the new one comes up)."""
    current = host.effective_usd_per_hour
    if best_offer_id is None or best_usd_per_hour is None:
        return Move(
            host.name, host.model, host.region, host.offer_id, current, None, None, 0.0, 0.0, False, "no passing offer"
        )
    saving = current - best_usd_per_hour
    percent = 100 * saving / current if current else 0.0
    move_cost = (current + best_usd_per_hour) * bring_up_hours
    monthly = saving * HOURS_PER_MONTH - move_cost
    move = best_offer_id != host.offer_id and percent > min_percent and monthly > min_usd_per_month
    if move:
        why = f"{percent:.0f}% cheaper, ${monthly:.2f}/month net"
    elif saving <= 0:
        why = "already on the cheapest passing offer"
    else:
        why = (
            f"saves {percent:.1f}% and ${monthly:.2f}/month net: under the thresholds "
            f"({min_percent:g}%, ${min_usd_per_month:g}/month)"
        )
    return Move(
        host.name,
        host.model,
        host.region,
        host.offer_id,
        current,
        best_offer_id,
        best_usd_per_hour,
        round(percent, 2),
        round(monthly, 2),
        move,
        why,
    )


async def reprice(ctx: Context, dry_run: bool) -> list[Move]:
    """Find, for every READY host, the cheapest passing offer; move the host where it is worth it."""
    rot = ctx.settings.rotation
    moves = []
    for host in ctx.record.hosts(states=(HostState.READY,)):
        profile = ctx.settings.profile(host.model)
        funnel = await offers.search(ctx, host.model, host.region, exclude_unusable=True, record_seen=not dry_run)
        best = funnel.passed[0] if funnel.passed else None
        bring_up_hours = (
            (host.ready_at - host.created_at).total_seconds() / 3600 if host.ready_at and host.created_at else 0.25
        )
        moves.append(
            judge_move(
                host,
                best.id if best else None,
                effective_price_per_hour(best, profile) if best else None,
                rot.reprice_min_percent,
                rot.reprice_min_usd_per_month,
                bring_up_hours,
            )
        )
    if dry_run:
        return moves
    limit = asyncio.Semaphore(rot.max_concurrent_replacements)

    async def go(move: Move) -> None:
        async with limit:
            host = ctx.record.hosts(names=[move.name])[0]
            # The move was judged on the best offer's effective price: the new host may cost no more than that,
            # whichever offer it lands on (the best one may be gone by now).
            new = await replace(
                ctx, host, f"reprice: {move.why}", blacklist=False, max_effective_price=move.best_usd_per_hour
            )
            move.new_host = new.name if new else None

    await asyncio.gather(*(go(m) for m in moves if m.move))
    return moves


def as_dicts(items: list[HealthReport] | list[Move]) -> list[dict[str, object]]:
    return [asdict(i) for i in items]
