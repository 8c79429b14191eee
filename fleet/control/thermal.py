"""The thermal re-probe of READY hosts (`rotation.thermal_every_s`, `fleet health --thermal`), whose load never
runs beside a live call: the probe decodes on every slot for minutes, and live turns' first content rose from
23 ms to 244-398 ms while it ran on a host that carried calls. A host that carries calls is held from new ones
(its gateway door drains, where a target has room without it) until its calls end, then probed, then let go; a
host whose calls do not end within `rotation.drain_timeout_s`, or that the gateway is not the agents' door to
(they reach it directly), or whose target would lack room without it, is left for a later sweep."""

from __future__ import annotations

from datetime import timedelta

from fleet.context import Context
from fleet.control import gateway, sizing
from fleet.control.rotation import HealthReport, replace
from fleet.core.models import Host, HostState, utcnow
from fleet.economics.capacity import calls_held
from fleet.host import measure
from fleet.host.endpoints import publish
from fleet.host.phase import PhaseFailed
from fleet.host.remote import HostKeyMismatch
from fleet.host.teardown import drain, requests_now

LEFT = "carried calls: left for a later sweep"
NOT_PROBED = "not probed"


async def thermal_sweep(ctx: Context) -> list[HealthReport]:
    """Re-run the thermal probe on every READY host that carries no call, or whose calls ended once it was held
    from new ones; replace a host that fails it, blacklisting its machine. A host whose SSH host key changed
    since it was pinned is replaced too (the probe refuses to talk to it)."""
    reports = []
    for host in ctx.record.hosts(states=(HostState.READY,)):
        why = await quiet(ctx, host)
        if why is not None:
            reports.append(HealthReport(host.name, True, why, 0))
            continue
        try:
            [result] = await measure.probe(ctx, host.name, only=["thermal"])
            healthy, reason = result.passed, result.diagnosis
        except HostKeyMismatch as e:
            healthy, reason = False, f"host key changed: {e}"
        except PhaseFailed as e:  # no verdict (the probe could not measure): the health sweep judges the host
            reports.append(HealthReport(host.name, True, f"{NOT_PROBED}: {e.reason}", 0))
            continue
        finally:
            await let_go(ctx, host)
        report = HealthReport(host.name, healthy, reason, 0 if healthy else 1)
        if not healthy:
            new = await replace(ctx, host, f"thermal: {reason}", blacklist=True)
            report.replaced_by = new.name if new else None
        reports.append(report)
    return reports


async def quiet(ctx: Context, host: Host) -> str | None:
    """None once the host carries no call (held from new ones while its calls end, where it can be); else why it
    is left for a later sweep."""
    if not await _busy(ctx, host):
        return None
    if not _room_without(ctx, host):
        return f"{LEFT} (its agents reach it directly, or its target has no room without it)"
    wait_s = ctx.settings.rotation.drain_timeout_s
    ctx.record.update(host, held_until=utcnow() + timedelta(seconds=wait_s + 60))
    await publish(ctx)  # the gateway drains its door: the calls it has go on there, no new call comes
    left = await gateway.wait_calls_end(ctx, host, wait_s)
    if left == 0:
        await drain(ctx, host, timeout_s=wait_s)
    if left or await _busy(ctx, host):
        await let_go(ctx, host)
        return f"{LEFT} (its calls went on past rotation.drain_timeout_s)"
    return None


async def let_go(ctx: Context, host: Host) -> None:
    """The host takes new calls again (a hold that was never set changes nothing)."""
    if host.held_until is not None:
        ctx.record.update(host, held_until=None)
        await publish(ctx)


async def _busy(ctx: Context, host: Host) -> bool:
    return await gateway.calls_on(ctx, host) > 0 or (await requests_now(ctx, host) or 0) > 0


def _room_without(ctx: Context, host: Host) -> bool:
    """Whether the host's [[serve]] target (its gateway) holds its calls without it: another READY host takes new
    ones, and the others' capacity covers what the target sizes for."""
    target = next((t for t in ctx.settings.serve if (t.model, t.region) == (host.model, host.region)), None)
    if target is None:
        return False
    others = [h for h in ctx.record.hosts(states=(HostState.READY,), model=host.model, region=host.region)]
    others = [h for h in others if h.id != host.id and h.held_until is None]
    if not others:
        return False
    needed = sizing.observe(ctx, target).target_callers
    benches = ctx.record.latest_bench([h.id for h in others if h.id is not None])
    held = sum(calls_held(benches.get(h.id) if h.id is not None else None, h.slots) for h in others)
    return held >= needed
