"""What the record says, for people and scripts: each host's summary with its latest bench, every machine
fleet ever rented, and the hosts of a benchmark session."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fleet.context import Context
from fleet.core.models import LIVE_STATES, POOL, Host, as_utc, utcnow
from fleet.economics import glance
from fleet.economics.bill import accrued_usd
from fleet.economics.glance import TargetSizing
from fleet.economics.machines import MachineRecord, remember
from fleet.economics.report import Session, gather


def status(ctx: Context, include_ended: bool = False) -> list[dict[str, Any]]:
    """Each host's summary, with the capacities (speakers at once, calls in conversation) and cost per
    voice-minute of its latest bench (None when it was never benched, or never for calls)."""
    hosts = ctx.record.hosts() if include_ended else ctx.record.hosts(states=LIVE_STATES)
    benched = ctx.record.latest_bench([h.id for h in hosts if h.id is not None])
    rows = []
    for h in hosts:
        run = benched.get(h.id) if h.id is not None else None
        rows.append(
            {
                **host_summary(h),
                "capacity": run.capacity if run else None,
                "capacity_at_least": run.capacity_at_least if run else None,
                "calls_capacity": run.calls_capacity if run else None,
                "calls_at_least": run.calls_at_least if run else None,
                "usd_per_voice_minute": run.usd_per_voice_minute if run else None,
            }
        )
    return rows


def host_summary(h: Host) -> dict[str, Any]:
    return {
        "id": h.id,
        "name": h.name,
        "state": h.state,
        "model": h.model,
        "region": h.region,
        "instance_id": h.instance_id,
        "machine_id": h.machine_id,
        "offer_id": h.offer_id,
        "gpu_name": h.gpu_name,
        "geolocation": h.geolocation,
        "dph_total": h.dph_total,  # what it costs an hour running
        "usd_per_hour": h.storage_usd_per_hour if h.state in POOL else h.dph_total,  # what it bills an hour now
        "effective_usd_per_hour": h.effective_usd_per_hour,
        "accrued_usd": h.accrued_usd if h.accrued_usd is not None else accrued_usd(h),
        "endpoint": None if h.state in POOL else h.api_url,  # a stopped host answers nothing
        "slots": h.slots,
        "created_at": h.created_at.isoformat(),
        "ready_at": h.ready_at.isoformat() if h.ready_at else None,
        "destroyed_at": h.destroyed_at.isoformat() if h.destroyed_at else None,
        "contract_end_at": as_utc(h.contract_end_at).isoformat() if h.contract_end_at else None,
        "failed_phase": h.failed_phase,
        "failure_reason": h.failure_reason,
        # the last health sweep's read (None: not read): RAM is finite and shared with the pull
        "ram_total_mib": h.ram_total_mib,
        "ram_available_mib": h.ram_available_mib,
        "server_rss_mib": h.server_rss_mib,
    }


def machines(ctx: Context) -> list[MachineRecord]:
    """What fleet measured on each marketplace machine it ever rented (economics/machines.py)."""
    return remember(*ctx.record.machine_rows())


def session(ctx: Context, since: datetime, sizings: list[TargetSizing]) -> Session:
    """What the report shows: the whole fleet at a glance (with each serve target's `sizings`), then the hosts
    created since `since` and what fleet measured on them."""
    hosts, probe_runs, bench_runs, _ = ctx.record.machine_rows()
    engines = {name: profile.engine for name, profile in ctx.settings.models.items()}
    now = utcnow()
    made = gather(hosts, probe_runs, bench_runs, since, now, engines)
    made.glance = glance.gather(hosts, probe_runs, sizings, since, now)
    return made
