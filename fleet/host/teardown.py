"""The end of one host: drained of the calls it serves, failed (why recorded, its machine blacklisted),
destroyed, confirmed gone through the marketplace, and only then its bill closed.

A bring-up that fails is destroyed here whatever it raised; a create whose answer was lost is found by
its label first, so nothing it may have bought is left billing. A cleanup runs to its end even when its
caller is cancelled again meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from datetime import datetime, timedelta
from typing import TypeVar

import httpx

from fleet.context import Context
from fleet.core import failpoints
from fleet.core.models import Blacklist, Host, HostState, as_utc, utcnow
from fleet.economics.bill import accrued_usd
from fleet.engines.metrics import requests_in_flight
from fleet.host.attempts import end_attempt
from fleet.host.endpoints import publish
from fleet.host.instance import inside_read_lag
from fleet.market import MarketError
from fleet.probes.server import ReplyTooLarge, bounded

T = TypeVar("T")
MAX_METRICS = 256 * 1024  # a /metrics answer is a few kB: what a host sends beyond this is not read


async def drain(ctx: Context, host: Host, timeout_s: float | None = None) -> None:
    """Wait until the server has no request in flight (llama-server's /metrics: every host serves it and no
    /slots), or the drain timeout. An answer that does not say (an error status, garbage) says nothing about
    the calls in flight: wait it out. Only a server that no longer accepts connections has nothing to drain."""
    deadline = time.monotonic() + (ctx.settings.rotation.drain_timeout_s if timeout_s is None else timeout_s)
    async with ctx.server(host).client(timeout=5) as client:
        while time.monotonic() < deadline:
            try:
                text = await _metrics(client)
            except httpx.ConnectError:
                return  # nothing listens: nothing to drain
            except (httpx.HTTPError, TimeoutError):
                text = ""
            if requests_in_flight(text) == 0:
                return
            await asyncio.sleep(0.2)


async def requests_now(ctx: Context, host: Host) -> int | None:
    """The requests its server has in flight now, by its /metrics (None when it does not say)."""
    async with ctx.server(host).client(timeout=5) as client:
        try:
            return requests_in_flight(await _metrics(client))
        except (httpx.HTTPError, TimeoutError):
            return None


async def _metrics(client: httpx.AsyncClient) -> str:
    """The host's /metrics, at most MAX_METRICS bytes of it and within 5 s: a host that drips or floods its
    answer is not waited on nor read past that. Empty when it did not answer 200 or answered too much."""
    try:
        reply = await bounded(client, "GET", "/metrics", deadline_s=5, max_bytes=MAX_METRICS)
    except ReplyTooLarge:
        return ""
    return reply.body.decode("utf-8", errors="replace") if reply.status_code == 200 else ""


def blacklist_machine(ctx: Context, host: Host, phase: str, reason: str) -> None:
    ctx.record.add(
        Blacklist(
            provider_url=host.provider_url,
            machine_id=host.machine_id,
            phase=phase,
            reason=reason,
            expires_at=utcnow() + timedelta(hours=ctx.settings.up.blacklist_hours),
        )
    )


async def contained_fail(ctx: Context, host: Host, phase: str, reason: str, blacklist: bool) -> bool:
    """fail, never raising: False when the instance could not be destroyed (the record keeps it open
    for reconcile, an error event says why)."""
    try:
        await fail(ctx, host, phase, reason, blacklist)
    except Exception as e:
        ctx.record.event("error", "destroy", json.dumps({"error": f"{type(e).__name__}: {e}"}), host.id)
        ctx.reporter.info(host.name, f"could not destroy its instance ({e}); `fleet reconcile` will finish it")
        return False
    return True


async def fail(ctx: Context, host: Host, phase: str, reason: str, blacklist: bool) -> None:
    """The bring-up failed: record why, blacklist the machine, destroy what this attempt created. The
    bill closes only once the marketplace confirms the instance gone; until then reconcile sees it. A host
    another process moved on since this one read it (it served, or that process is failing or destroying it)
    is left to that process: nothing is failed, blacklisted or destroyed here."""
    seen = host.state
    if host.destroyed_at is None and not ctx.record.transition(
        host, HostState.FAILED, failed_phase=phase, failure_reason=reason
    ):
        now = ctx.record.hosts(names=[host.name])
        state = HostState(now[0].state).value if now else "gone"
        detail = {"phase": phase, "reason": reason, "seen": HostState(seen).value, "now": state}
        ctx.record.event("info", "fail_refused", json.dumps(detail), host.id)
        return
    ctx.record.event("error", "phase", json.dumps({"phase": phase, "reason": reason}), host.id)
    if blacklist:
        blacklist_machine(ctx, host, phase, reason)
    end_attempt(ctx, host, phase, reason)
    if host.destroyed_at is not None:
        return
    if host.instance_id is None and host.create_sent_at is not None:
        await destroy_strays_of(ctx, host)  # a create whose answer we lost may have bought one
    if host.instance_id is not None:
        await destroy_instance(ctx, host, final_state=HostState.FAILED)
    else:
        ctx.record.close(host, HostState.FAILED, 0.0)


async def destroy_strays_of(ctx: Context, host: Host) -> None:
    """After a create whose answer we did not get: find the instance by our label and adopt it (the caller
    destroys it). vast.ai's reads lag its create, so an empty answer is asked again until
    timeouts.instance_visible has passed since the request left."""
    waited = (utcnow() - as_utc(host.create_sent_at or utcnow())).total_seconds()
    deadline = time.monotonic() + max(ctx.settings.timeouts.instance_visible - waited, 0.0)
    while True:
        async with ctx.waits.on("market"):
            found = [i for i in await ctx.market.list(host.label) if i.label == host.label]
        if found:
            ctx.record.update(host, instance_id=found[0].id)
            for extra in found[1:]:  # never expected: one intent, one create
                ctx.record.event("error", "create", json.dumps({"duplicate_instance": extra.id}), host.id)
                await ctx.market.destroy(extra.id)
            return
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(2.0)


async def destroy_known(ctx: Context, instance_id: int, create_sent_at: datetime | None) -> None:
    """Destroy an instance by id. vast.ai's writes lag a create as its reads do: a "no such instance" inside
    timeouts.instance_visible of the create may be one it does not know yet, so it is asked again until it
    answers that it destroyed it or the window has passed (then "no such" means gone)."""
    while not await ctx.market.destroy(instance_id):
        if not inside_read_lag(ctx, create_sent_at):
            return
        await asyncio.sleep(1.0)


async def destroy_instance(
    ctx: Context, host: Host, final_state: HostState = HostState.DESTROYED, confirm_timeout_s: float = 60.0
) -> None:
    """Destroy the host's instance, confirm through the marketplace that it is gone, then close its bill."""
    assert host.instance_id is not None
    ctx.record.event("intent", "destroy", json.dumps({"instance_id": host.instance_id}), host.id)
    if final_state == HostState.DESTROYED:
        ctx.record.transition(host, HostState.DESTROYING)
    async with ctx.waits.on("market"):
        # an instance the marketplace has listed running is known to its writes: "no such" then means gone (a
        # host destroyed behind fleet's back was asked again for the rest of the window, 40 s in a sweep)
        await destroy_known(ctx, host.instance_id, None if host.running_at else host.create_sent_at)
        failpoints.reach("mid_destroy")
        deadline = time.monotonic() + confirm_timeout_s
        while await ctx.market.get(host.instance_id) is not None:
            if time.monotonic() > deadline:
                raise MarketError(f"instance {host.instance_id} still listed {confirm_timeout_s:g}s after destroy")
            await asyncio.sleep(1.0)
    now = utcnow()
    ctx.record.close(host, final_state, accrued_usd(host, now))
    await publish(ctx)
    ctx.record.event("answer", "destroy", json.dumps({"instance_id": host.instance_id, "gone": True}), host.id)
    ctx.reporter.info(host.name, f"instance {host.instance_id} destroyed; cost ${host.accrued_usd or 0:.4f}")


async def destroy_host(ctx: Context, host: Host) -> bool:
    """Destroy one host whose bill is open (idempotent). False, touching nothing, when another live process
    works on it now (a bring-up, a drain)."""
    if host.destroyed_at is not None:
        return True
    if not ctx.leases.claim(host):
        return False
    if host.instance_id is None and host.create_sent_at is not None:
        await destroy_strays_of(ctx, host)
    if host.instance_id is None:
        ctx.record.close(host, HostState.DESTROYED, 0.0, failure_reason="destroyed before it bought anything")
    else:
        final = HostState.FAILED if host.state == HostState.FAILED else HostState.DESTROYED
        await destroy_instance(ctx, host, final_state=final)
    return True


async def to_the_end(cleanup: Awaitable[T]) -> T:
    """Await a cleanup to its end, even when cancelled again meanwhile (a second Ctrl-C, the caller's own
    cancel): what a bring-up bought is destroyed before its process lets go of the marketplace."""
    task = asyncio.ensure_future(cleanup)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise
