"""Measuring one serving host: its probes (each result recorded) and `fleet bench`'s search for the most
concurrent callers it holds at its profile's voice target (the levels, the capacity and the cost per
voice-minute recorded)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh
import httpx

from fleet.context import Context
from fleet.core.config import Profile
from fleet.core.errors import FleetError
from fleet.core.models import BenchRun, Host, HostState, ProbeRun
from fleet.economics.capacity import Capacity, capacity, next_level, usd_per_voice_minute
from fleet.host import profile as profiles
from fleet.host.endpoints import publish
from fleet.host.phase import PhaseFailed
from fleet.host.remote import HostKeyMismatch, connect
from fleet.host.teardown import blacklist_machine
from fleet.probes import ProbeResult
from fleet.probes.bench import LevelResult, run_bench
from fleet.probes.call import load_call
from fleet.probes.runner import PROBES, run_probes


@dataclass(frozen=True)
class BenchReport:
    """What `fleet bench` found on a host: every level measured, the capacity at the profile's voice
    target with its evidence, and dollars per concurrent call-minute at that capacity."""

    host: str
    effective_usd_per_hour: float
    levels: list[LevelResult]
    capacity: Capacity
    usd_per_voice_minute: float | None
    kept_capacity: int | None = None  # an earlier bench's capacity, more than this one tested: kept

    def as_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "effective_usd_per_hour": self.effective_usd_per_hour,
            "levels": [lv.as_dict() for lv in self.levels],
            "capacity": self.capacity.as_dict(),
            "usd_per_voice_minute": self.usd_per_voice_minute,
            "kept_capacity": self.kept_capacity,
        }


async def probe_host(
    ctx: Context,
    host: Host,
    profile: Profile,
    names: list[str],
    ssh: asyncssh.SSHClientConnection | None,
    timeout_s: float,
    plot_path: Path | None = None,
) -> list[ProbeResult]:
    """Run the named probes on the host and record each result; PhaseFailed("probes") when probing itself
    failed (no verdict)."""
    assert host.api_url
    try:
        async with asyncio.timeout(timeout_s), ctx.waits.on("server"):
            template = (await profiles.template(ctx, profile))[0] if profile.engine == "vllm" else None
            results = await run_probes(names, ctx.server(host), profile, ctx.settings, ssh, plot_path, template)
    except (TimeoutError, httpx.HTTPError, FleetError, OSError) as e:
        raise PhaseFailed("probes", f"probing failed: {type(e).__name__}: {e}") from None
    for result in results:
        ctx.record.add(
            ProbeRun(
                host_id=host.id,
                name=result.name,
                passed=result.passed,
                diagnosis=result.diagnosis,
                metrics=json.dumps(result.metrics),
            )
        )
        ctx.reporter.info(host.name, f"probe {result.name}: {'pass' if result.passed else 'FAIL'}: {result.diagnosis}")
    return results


async def probe(
    ctx: Context, name: str, only: list[str] | None = None, plot_path: Path | None = None
) -> list[ProbeResult]:
    """Run probes on a serving host now (all of them unless `only`); every result is recorded."""
    host = serving_host(ctx, name)
    profile = ctx.settings.profile(host.model)
    names = only or list(PROBES)
    ssh = None
    if "thermal" in names and host.ssh_host and host.ssh_port:
        try:
            ssh, _ = await connect(host.ssh_host, host.ssh_port, ctx.ssh_key, host.host_key, ctx.settings.timeouts.ssh)
        except HostKeyMismatch as e:
            # Not the machine we pinned at first contact: someone in the middle, or a machine re-imaged
            # under us. Refused, recorded, and the machine is not rented again.
            ctx.record.event("error", "host_key", json.dumps({"error": str(e)}), host.id)
            blacklist_machine(ctx, host, "host_key", str(e))
            raise
    try:
        return await probe_host(ctx, host, profile, names, ssh, ctx.settings.timeouts.probes, plot_path)
    finally:
        if ssh is not None:
            ssh.close()


async def bench(
    ctx: Context, name: str, max_callers: int | None, waves: int, warmup: int, max_tokens: int
) -> BenchReport:
    """Replay the call at growing concurrency, searching for the most callers the host holds at its
    profile's voice target; record the levels, the capacity and the cost per voice-minute."""
    host = serving_host(ctx, name)
    assert host.api_url and host.id is not None
    profile = ctx.settings.profile(host.model)
    target = profile.voice
    levels = await run_bench(
        ctx.server(host),
        load_call(),
        max_callers=max_callers,
        waves=waves,
        warmup=warmup,
        max_tokens=max_tokens,
        search=lambda most: lambda measured: next_level(measured, target, most),
        slots_started=host.slots,
        engine=profile.engine,
        ctx_per_slot=profile.ctx_per_slot,
    )
    held = capacity({lv.callers: lv for lv in levels}, target, max_callers or max(lv.callers for lv in levels))
    if held.callers > host.slots:
        # a caller beyond the slots fleet started the server with waits for one: what held there is the
        # host's claim (a lying /props, timings), not a capacity
        held = Capacity(
            host.slots, target, False, held.held, None, f"capped at the {host.slots} slots it was started with"
        )
    earlier = ctx.record.latest_bench([host.id]).get(host.id)
    kept = None
    if held.exhausted and earlier is not None and host.slots >= earlier.capacity > held.callers:
        # this bench held at every level it tried, and tried fewer callers than the host was measured to
        # hold: it says nothing against that capacity, which stays
        kept = earlier.capacity
        held = Capacity(earlier.capacity, target, earlier.capacity_at_least, held.held, None, None)
    cost = usd_per_voice_minute(host.effective_usd_per_hour, held.callers)
    ctx.record.add(
        BenchRun(
            host_id=host.id,
            first_content_p95_ms_target=target.first_content_p95_ms,
            decode_tok_s_target=target.decode_tok_s,
            capacity=held.callers,
            capacity_at_least=held.exhausted,
            usd_per_voice_minute=cost,
            levels=json.dumps([lv.as_dict() for lv in levels]),
        )
    )
    await publish(ctx)  # a capacity measured: the gateway's limit for this host follows
    return BenchReport(host.name, host.effective_usd_per_hour, levels, held, cost, kept)


def serving_host(ctx: Context, name: str) -> Host:
    """The named host, READY or being probed; KeyError (one line) when it is unknown or not serving."""
    hosts = ctx.record.hosts(names=[name])
    if not hosts:
        raise KeyError(f"no such host: {name!r}")
    host = hosts[0]
    if host.state not in (HostState.READY, HostState.PROBING) or not host.api_url:
        raise KeyError(f"host {name!r} is {host.state}, not serving")
    return host
