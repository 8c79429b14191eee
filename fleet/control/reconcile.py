"""Reconcile: make the record and the marketplace agree, without touching what another process works on.

Every host whose bill is open is looked at (one listing, then show for those it lacks), but only once this
process owns it: a host another live process is bringing up, draining or destroying keeps its owner until
that owner's lease runs out or the owner is seen dead. What is found:
- gone at the marketplace: its bill closes (the cost up to now);
- a bring-up whose owner died, a failed host whose destroy never confirmed, a drain or destroy cut short:
  its instance is destroyed and the bill closed;
- READY with a failed instance (exited, stopped): failed, blacklisted, destroyed;
- STANDBY with a stopped instance: left alone (the standby pool: still ours, still billed for its disk);
  a stop cut short after the marketplace stopped it: STANDBY;
- a create cut short before its answer: the instance is found by the host's label (an instance is known by
  its label before its id), or, once vast.ai's read lag has passed, the create bought nothing.
Then the strays: instances that carry this install's label prefix (fleet:<install id>:, so that two
installs on one account never take each other's) and belong to no open host (a label no host row
has, or the label of a host whose bill is closed) are destroyed. An empty or malformed listing while
recorded instances exist is an error, never "no instances".
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from fleet.context import Context
from fleet.core.models import LABEL_PREFIX, Host, HostState, as_utc, host_age_s, utcnow
from fleet.economics.bill import LOST_FROM_POOL, accrued_usd
from fleet.host.endpoints import publish
from fleet.host.teardown import destroy_instance, fail
from fleet.market import Instance, MarketError


async def reconcile(ctx: Context) -> dict[str, Any]:
    report: dict[str, Any] = {
        "checked": 0,
        "gone": [],
        "lost": [],
        "failed": [],
        "destroyed": [],
        "strays_destroyed": [],
        "adopted": [],
        "busy": [],
        "waiting": [],
    }
    listed_at = utcnow()
    async with ctx.waits.on("market"):
        listing = await ctx.market.list(LABEL_PREFIX)  # every install's: a host may predate its install id
    by_id = {i.id: i for i in listing}
    by_label = {i.label: i for i in listing}
    unlisted_but_there = 0
    for host in ctx.record.open_hosts():
        report["checked"] += 1
        if not ctx.leases.claim(host):
            report["busy"].append(host.name)
            continue
        if host.destroyed_at is not None:  # closed since the record was read (the claim read it again)
            ctx.leases.release(host)
            continue
        try:
            unlisted_but_there += await _settle(ctx, host, by_id, by_label, report)
        finally:
            if host.destroyed_at is None:
                ctx.leases.release(host)
    if unlisted_but_there:
        raise MarketError(
            f"the instance listing lacks {unlisted_but_there} instance(s) that show finds; not sweeping strays"
        )
    await _sweep_strays(ctx, listing, listed_at, report)
    await publish(ctx)
    return report


async def _settle(
    ctx: Context, host: Host, by_id: dict[int, Instance], by_label: dict[str | None, Instance], report: dict[str, Any]
) -> int:
    """Bring one open host (owned by us now) to where the marketplace says it is. Returns 1 when show found
    an instance the listing lacked."""
    # vast.ai's reads lag create: an instance never yet seen running may simply not be listed yet.
    young = host.running_at is None and host_age_s(host) < ctx.settings.timeouts.instance_visible
    if host.instance_id is None:
        found = by_label.get(host.label)
        if found is None:
            if young and host.create_sent_at is not None:  # the request left: it may yet be listed
                report["waiting"].append(host.name)
                return 0
            ctx.record.close(
                host, HostState.DESTROYED, 0.0, failure_reason="the create was cut short and bought nothing"
            )
            report["gone"].append(host.name)
            return 0
        ctx.record.update(host, instance_id=found.id)
        ctx.record.event("info", "reconcile", json.dumps({"adopted": found.id}), host.id)
        report["adopted"].append(host.name)
    assert host.instance_id is not None
    instance = by_id.get(host.instance_id)
    shown = 0
    if instance is None:
        if young:
            report["waiting"].append(host.name)
            return 0
        async with ctx.waits.on("market"):
            instance = await ctx.market.get(host.instance_id)
        shown = int(instance is not None)
    if instance is None:
        final = HostState.FAILED if host.state == HostState.FAILED else HostState.DESTROYED
        if host.state == HostState.STANDBY:
            why = await _lost_from_pool(ctx, host)
            ctx.record.close(host, final, accrued_usd(host, utcnow()), failure_reason=why)
            ctx.record.event("error", "reconcile", json.dumps({"lost": why}), host.id)
            report["lost"].append({"host": host.name, "why": why})
            return shown
        ctx.record.close(host, final, accrued_usd(host, utcnow()), failure_reason="instance gone at reconcile")
        ctx.record.event("info", "reconcile", "instance gone", host.id)
        report["gone"].append(host.name)
        return shown
    if host.state in (HostState.FAILED, HostState.DRAINING, HostState.DESTROYING):
        # its destroy never confirmed, or the process draining or destroying it died: finish the job
        final = HostState.FAILED if host.state == HostState.FAILED else HostState.DESTROYED
        await destroy_instance(ctx, host, final_state=final)
        report["destroyed"].append(host.name)
    elif host.state == HostState.READY:
        if instance.down:
            # stopped as intended by vast.ai itself (spent credit, an ended contract): no machine to blame
            why = f"vast.ai stopped it: {instance.status_msg or 'no message'}" if instance.stopped else None
            await fail(ctx, host, "reconcile", why or f"instance {instance.status}", blacklist=why is None)
            report["failed"].append(host.name)
    elif host.state == HostState.STANDBY:
        # stopped on purpose (vast.ai reads it exited, stopped intended), weights on its disk: ours and
        # billed, never a failure for being stopped
        if instance.down and not instance.stopped:
            await fail(ctx, host, "reconcile", f"standby instance {instance.status}", blacklist=True)
            report["failed"].append(host.name)
        elif host.contract_end_at is not None and as_utc(host.contract_end_at) <= utcnow():
            # vast.ai never starts an expired instance again; it would only go on paying for its disk
            await fail(ctx, host, "reconcile", "its contract ended: it cannot start again", blacklist=False)
            report["failed"].append(host.name)
    elif host.state == HostState.STOPPING and instance.stopped:
        # the process stopping it died after the marketplace did its part: finish the move to the pool
        ctx.record.transition(host, HostState.STANDBY, stopped_at=utcnow())
        ctx.record.event("info", "reconcile", "stop finished: standby", host.id)
    else:
        await fail(ctx, host, host.state, f"bring-up interrupted in {host.state}", blacklist=False)
        report["failed"].append(host.name)
    return shown


async def _lost_from_pool(ctx: Context, host: Host) -> str:
    """Why a stopped host of the pool is gone, in a line: vast.ai deleted it, its disk with its files, and the
    pool's $/h paid to keep them bought nothing. A spent credit is the likely cause (vast.ai deletes the
    instances of an account with no card once its balance stays below zero), said when the account shows it."""
    lost = f"{LOST_FROM_POOL}: vast.ai deleted the stopped instance, its disk and the {host.model} files on it"
    async with ctx.waits.on("market"):
        usd = await ctx.market.credit()
    if usd is not None and usd <= 0:
        return f"{lost} (the account's credit is ${usd:.2f}: vast.ai deletes what an account without a card keeps)"
    return lost


async def _sweep_strays(ctx: Context, listing: list[Instance], listed_at: datetime, report: dict[str, Any]) -> None:
    hosts = ctx.record.hosts()
    open_ids = {h.instance_id for h in hosts if h.destroyed_at is None and h.instance_id is not None}
    open_labels = {h.label for h in hosts if h.destroyed_at is None}
    closed = [h for h in hosts if h.destroyed_at is not None and h.instance_id is not None]
    closed_ids = {h.instance_id for h in closed}
    # a bill closes on the marketplace's word that the instance is gone: one closed since the listing was read
    # (by this reconcile, or a destroy beside it) is a row the listing still had, never a stray
    gone_since = {h.instance_id for h in closed if as_utc(h.destroyed_at) >= listed_at}
    for instance in listing:
        if not (instance.label or "").startswith(ctx.label_prefix):
            continue  # another install's on a shared account (a laptop, a test run): never ours to destroy
        if instance.id in open_ids or instance.label in open_labels or instance.id in gone_since:
            continue  # an open host's instance (its owner may not have recorded the id yet)
        async with ctx.waits.on("market"):
            await ctx.market.destroy(instance.id)
        kind = "error" if instance.id in closed_ids else "info"  # a closed bill with a live instance: a bug
        ctx.record.event(kind, "reconcile", json.dumps({"stray_destroyed": instance.id, "label": instance.label}))
        report["strays_destroyed"].append(instance.id)
