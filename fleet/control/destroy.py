"""`fleet destroy`: the named hosts (or every host whose bill is open) destroyed and confirmed gone, each
bill closed; a host another live process works on is left to it and reported. `--all` also stops this
machine's gateway (nothing is left serving, no port open) unless asked to keep it: then its agents get an
answer they can act on (503, no host, Retry-After) until hosts serve again."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fleet.context import Context
from fleet.control import gateway
from fleet.core.installrecord import pause_serving
from fleet.core.models import Host
from fleet.host.endpoints import publish
from fleet.host.teardown import destroy_host
from fleet.market import MarketError

# hosts destroyed at once: enough to keep the marketplace's destroy endpoint busy while others are confirmed gone
CONCURRENT_DESTROYS = 16


@dataclass
class DestroyReport:
    done: list[Host] = field(default_factory=list)
    busy: list[Host] = field(default_factory=list)  # owned by another live process: left alone
    gateway_stopped: int | None = None  # the PID of the gateway's HAProxy `--all` stopped
    serve_paused: bool = False  # `--all` paused the [[serve]] targets: no daemon rents their hosts again


async def destroy(ctx: Context, names: list[str] | None, keep_gateway: bool = False) -> DestroyReport:
    """Destroy the named hosts (None: every host whose bill is open, and this machine's gateway unless
    `keep_gateway`). Idempotent; confirms each is gone. A host another live process is working on (a bring-up, a
    drain) is left to it and reported. A host the marketplace would not destroy stays open (reconcile finishes it)
    and is raised as a MarketError once every other host had its try."""
    if names is None:
        targets = ctx.record.open_hosts()
    else:
        targets = ctx.record.hosts(names=names)
        unknown = sorted(set(names) - {h.name for h in targets})
        if unknown:
            raise KeyError(f"no such host: {', '.join(map(repr, unknown))}")
    report = DestroyReport()
    if names is None and any(t.calls or t.standby for t in ctx.settings.serve):
        # a daemon would otherwise rent the targets' hosts again at its next beat
        report.serve_paused = pause_serving(ctx.record, True) is not None
    errors = await _destroy_side_by_side(ctx, targets, report)
    await publish(ctx)
    if errors:
        first = errors[0]
        raise MarketError(
            f"{len(errors)} of {len(targets)} host(s) not destroyed, left billing for `fleet reconcile` "
            f"({len(report.done)} destroyed): {first[0].name}: {first[1]}"
        ) from first[1]
    if names is None and not keep_gateway:
        report.gateway_stopped = await gateway.stop(ctx)
    return report


async def _destroy_side_by_side(
    ctx: Context, targets: list[Host], report: DestroyReport
) -> list[tuple[Host, Exception]]:
    """Each host destroyed and confirmed gone, several at once: the marketplace's pacing spaces the calls (a
    destroy every 3 s is vast.ai's limit), and one host's confirmation no longer waits for another's. Every host
    has its try; those that failed come back, in the order given."""
    limit = asyncio.Semaphore(CONCURRENT_DESTROYS)

    async def one(host: Host) -> bool:
        async with limit:
            return await destroy_host(ctx, host)

    outcomes = await asyncio.gather(*(one(host) for host in targets), return_exceptions=True)
    errors: list[tuple[Host, Exception]] = []
    for host, outcome in zip(targets, outcomes, strict=True):
        if isinstance(outcome, Exception):
            errors.append((host, outcome))
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            (report.done if outcome else report.busy).append(host)
    return errors


async def destroy_all_on(ctx: Context, provider_url: str) -> DestroyReport:
    """Every host of this record whose bill is open at that marketplace (`fleet cloud stop`: the local cloud
    is going, and its hosts with it)."""
    names = [h.name for h in ctx.record.open_hosts() if h.provider_url == provider_url]
    return await destroy(ctx, names) if names else DestroyReport()
