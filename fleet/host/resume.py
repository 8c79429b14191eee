"""One host of the standby pool back to READY: its instance started, waited for (its machine's GPU may
have been rented meanwhile: timeouts.standby_start bounds it), reconnected on its new ports, its kept files
checked, started and probed again. A host that does not come back is destroyed; the caller brings up a
cold one instead."""

from __future__ import annotations

import time

from fleet.context import Context
from fleet.core.config import Profile
from fleet.core.models import Host
from fleet.host import profile as profiles
from fleet.host.attempts import AttemptReport, end_attempt
from fleet.host.bringup import BringUp
from fleet.host.endpoints import publish
from fleet.host.phase import PhaseFailed
from fleet.host.teardown import contained_fail, to_the_end
from fleet.market import MarketError


async def resume(ctx: Context, host: Host, profile: Profile, report: AttemptReport) -> bool:
    """Resume `host` (owned by this process, already moved STANDBY -> BOOTING). True once READY; False when it
    did not come back (it is destroyed, and `report` says where it failed)."""
    assert host.instance_id is not None
    started = time.monotonic()
    ctx.reporter.info(host.name, "taken from the standby pool: starting its instance")
    try:
        async with ctx.waits.on("market"):
            await ctx.market.start(host.instance_id)
        await BringUp(ctx, host, profiles.sized(profile, host.slots), None, resume=True).run()  # its own slots
    except (PhaseFailed, MarketError) as e:
        phase, reason = (e.phase, e.reason) if isinstance(e, PhaseFailed) else ("boot", str(e))
        report.outcome, report.phase, report.reason = "failed", phase, reason
        report.seconds = time.monotonic() - started
        ctx.reporter.info(host.name, f"did not come back from standby ({phase}: {reason}); a cold bring-up")
        await contained_fail(ctx, host, phase, reason, blacklist=False)
        return False
    except BaseException:
        await to_the_end(contained_fail(ctx, host, host.state, "interrupted", False))
        raise
    end_attempt(ctx, host, None, None)
    await publish(ctx)
    report.seconds = time.monotonic() - started
    ctx.reporter.info(host.name, f"READY from standby at {host.api_url} in {report.seconds:.1f}s")
    return True
