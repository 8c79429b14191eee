"""The account's credit against what the fleet spends: vast.ai stops every instance when the credit
reaches zero ("Whenever your credit balance hits zero or below, your instances will be stopped
automatically, but not destroyed"), so the daemon says ahead of time how long it lasts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from fleet.context import Context
from fleet.core.models import HostState


@dataclass(frozen=True)
class Credit:
    usd: float | None  # None: the marketplace did not say
    burn_usd_per_hour: float  # what the open hosts cost an hour (a standby host: its disk)
    hours_left: float | None  # at that rate; None when nothing burns or the credit is unknown
    warn: bool  # fewer hours left than rotation.credit_warn_hours

    def line(self) -> str:
        if self.usd is None:
            return "credit: the marketplace does not say"
        left = f", about {self.hours_left:.0f} h at ${self.burn_usd_per_hour:.3f}/h" if self.hours_left else ""
        return f"credit: ${self.usd:.2f}{left}" + (" [low]" if self.warn else "")


async def check_credit(ctx: Context) -> Credit:
    """Read the credit, set it against the open hosts' spend, and record the reading (an event)."""
    async with ctx.waits.on("market"):
        usd = await ctx.market.credit()
    hosts = ctx.record.open_hosts()
    burn = sum(h.storage_usd_per_hour if h.state == HostState.STANDBY else h.dph_total for h in hosts)
    hours = usd / burn if usd is not None and burn > 0 else None
    warn = usd is not None and (usd <= 0 or (hours is not None and hours < ctx.settings.rotation.credit_warn_hours))
    credit = Credit(usd, burn, hours, warn)
    ctx.record.event("error" if warn else "info", "credit", json.dumps(asdict(credit)))
    return credit
