"""Sized to calls: READY capacity kept at a profile's target in a region, and the standby pool kept full.

`decide` is pure, over what the record holds: the calls each READY host holds (its latest `fleet bench`
capacity in calls, in conversation at the voice target; else its speakers; else its slots:
economics/capacity.py calls_held), the hosts coming up, the pool. `keep` acts on it: more hosts with
`fleet up` (which takes pool hosts before it rents), the surplus retired make-before-break's way (drained,
then destroyed), the pool refilled with `fleet up --standby`. A target of 0 calls sizes nothing: hosts a
person brought up are never drained for want of a target.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fleet.context import Context
from fleet.control import rotation
from fleet.control.up import UpRequest, up
from fleet.core.config import Serve
from fleet.core.installrecord import serve_paused
from fleet.core.models import COMING_UP, POOL, Host, HostState
from fleet.economics.capacity import calls_held


@dataclass(frozen=True)
class Sizing:
    model: str
    region: str
    calls: int
    target_callers: int  # calls x (1 + headroom), rounded up; 0: no sizing
    capacity: int  # callers the READY hosts hold
    in_flight: int  # hosts coming up
    pool: int  # hosts in the standby pool
    pool_target: int
    per_host: int  # callers a new host is expected to hold
    up: int  # hosts to bring up now (pool hosts first)
    drain: tuple[str, ...]  # READY hosts to retire now: the dearest per caller first
    refill: int  # hosts to add to the pool
    done: dict[str, Any] = field(default_factory=dict)  # what `keep` did
    paused_since: str | None = None  # the targets are paused (`fleet serve --resume` keeps them again)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "drain": list(self.drain)}

    def line(self) -> str:
        target = (
            f"target {self.target_callers} callers ({self.calls} calls + headroom)" if self.calls else "no call target"
        )
        paused = f" (PAUSED since {self.paused_since[:19]}: `fleet serve --resume`)" if self.paused_since else ""
        return (
            f"{self.model} in {self.region}: {target}, READY capacity {self.capacity}, in flight {self.in_flight}, "
            f"standby pool {self.pool}/{self.pool_target}{paused}"
        )


def decide(target: Serve, ready: list[tuple[Host, int]], in_flight: int, pool: int, slots: int) -> Sizing:
    """What to do now for `target`, given the READY hosts with the callers each holds, the number coming up
    and in the pool, and the profile's slots (a new host's callers until a host is measured)."""
    measured = [callers for _, callers in ready]
    per_host = max(int(statistics.median(measured)) if measured else slots, 1)
    need = math.ceil(target.calls * (1 + target.headroom)) if target.calls else 0
    capacity = sum(measured)
    up, drain = 0, []
    if target.calls:
        coming = in_flight * per_host
        if capacity + coming < need:
            up = math.ceil((need - capacity - coming) / per_host)
        elif in_flight == 0:  # scale down only once nothing is coming up
            left = capacity
            dearest = sorted(ready, key=lambda hc: hc[0].effective_usd_per_hour / max(hc[1], 1), reverse=True)
            for host, callers in dearest:
                if left - callers >= need:
                    drain.append(host.name)
                    left -= callers
    refill = max(target.standby - (pool - min(up, pool)), 0)
    return Sizing(
        target.model,
        target.region,
        target.calls,
        need,
        capacity,
        in_flight,
        pool,
        target.standby,
        per_host,
        up,
        tuple(drain),
        refill,
    )


def observe(ctx: Context, target: Serve) -> Sizing:
    """`decide` over the record as it is now (nothing done)."""
    hosts = ctx.record.hosts(model=target.model, region=target.region)
    ready = [h for h in hosts if h.state == HostState.READY]
    benches = ctx.record.latest_bench([h.id for h in ready if h.id is not None])
    callers = [(h, calls_held(benches.get(h.id) if h.id is not None else None, h.slots)) for h in ready]
    in_flight = sum(1 for h in hosts if h.state in COMING_UP)
    pool = sum(1 for h in hosts if h.state in POOL)
    sizing = decide(target, callers, in_flight, pool, ctx.settings.profile(target.model).slots)
    paused = serve_paused(ctx.record)
    return replace(sizing, paused_since=paused.isoformat()) if paused is not None else sizing


async def keep(ctx: Context, target: Serve) -> Sizing:
    """Act on `observe`: bring up (pool first), retire the surplus, refill the pool; nothing while the targets
    are paused (`fleet destroy --all`, `fleet serve --pause`)."""
    sizing = observe(ctx, target)
    if sizing.paused_since is not None:
        return replace(sizing, done={"paused_since": sizing.paused_since})
    done: dict[str, Any] = {}
    if sizing.up:
        result = await up(ctx, UpRequest(target.model, target.region, count=sizing.up))
        done["up"] = [h.name for h in result.ready]
        done["up_from_pool"] = [a.host for a in result.attempts if a.resumed and a.outcome == "ready"]
        done["up_failures"] = result.failures
    for name in sizing.drain:
        [host] = ctx.record.hosts(names=[name])
        await rotation.retire(ctx, host, "sized to calls: surplus capacity", blacklist=False)
        done.setdefault("drained", []).append(name)
    refill = max(target.standby - observe(ctx, target).pool, 0)  # what up took from the pool counts
    if refill:
        result = await up(ctx, UpRequest(target.model, target.region, count=refill, standby=True))
        done["pooled"] = [h.name for h in result.ready]
        done["pool_failures"] = result.failures
    return Sizing(**{**asdict(sizing), "drain": sizing.drain, "done": done})
