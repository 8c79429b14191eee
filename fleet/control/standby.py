"""The standby pool, as `fleet up` draws on it: a pool host of the profile and region, taken with a
compare-and-set STANDBY -> BOOTING (two bring-ups, here or in another process, never take the same host)
and resumed (fleet/host/resume.py). Filling the pool is `fleet up` with `standby`: brought up, probed and
stopped (fleet/host/bringup.py)."""

from __future__ import annotations

from datetime import timedelta

from fleet.context import Context
from fleet.core.config import Profile
from fleet.core.models import Host, HostState, as_utc, utcnow
from fleet.economics.bill import stopped_hours
from fleet.host.attempts import AttemptReport, attempt_row
from fleet.host.resume import resume


async def from_pool(
    ctx: Context,
    run_id: str,
    profile: Profile,
    region: str,
    max_price: float | None,
    max_effective_price: float | None,
    attempts: list[AttemptReport],
) -> Host | None:
    """A host of the standby pool for this profile and region, started, its files verified, probed and
    READY; None when the pool has none free, or when the one taken did not come back in time (it is
    destroyed, and a cold bring-up follows)."""
    blacklisted = ctx.record.blacklisted_machines(ctx.market.url, utcnow())
    # a pool host must still have what a new rental must (vast.ai never starts one whose contract ended, and one
    # about to end would be replaced at once): reconcile destroys those that ended
    serves_until = utcnow() + timedelta(hours=ctx.settings.filters.min_contract_hours)
    for host in ctx.record.hosts(states=(HostState.STANDBY,), model=profile.name, region=region):
        if host.machine_id in blacklisted:
            continue  # blacklisted since it was parked
        if host.contract_end_at is not None and as_utc(host.contract_end_at) < serves_until:
            continue
        if max_price is not None and host.dph_total > max_price:
            continue
        if max_effective_price is not None and host.effective_usd_per_hour > max_effective_price:
            continue  # a reprice moves to cheaper hosts only
        if not ctx.leases.claim(host):
            continue
        stopped = stopped_hours(host)
        if not ctx.record.transition(host, HostState.BOOTING, stopped_hours=stopped, stopped_at=None):
            ctx.leases.release(host)
            continue
        ctx.record.add(attempt_row(run_id, host))
        report = AttemptReport.of(host, resumed=True)
        attempts.append(report)
        return host if await resume(ctx, host, profile, report) else None
    return None
