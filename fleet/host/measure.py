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
from fleet.economics.duty import calls_for
from fleet.engines.registry import engine_of
from fleet.host import templates
from fleet.host.endpoints import publish
from fleet.host.ops import HostMemory, read_memory
from fleet.host.phase import PhaseFailed
from fleet.host.remote import HostKeyMismatch, RemoteError, connect
from fleet.host.teardown import blacklist_machine
from fleet.probes import ProbeResult
from fleet.probes.bench import LevelResult, fit_call, run_bench
from fleet.probes.call import Call, load_call
from fleet.probes.conversation import CallsLevel, run_calls
from fleet.probes.runner import PROBES, run_probes

LOADS = ("speakers", "calls", "both")


@dataclass(frozen=True)
class BenchOptions:
    """How `fleet bench` loads a host: the speaker levels (every caller speaking in every wave) and the
    conversation levels (calls with `gap_s` between their turns, `turns` measured each; None: the profile's
    voice.turn_gap_s)."""

    max_callers: int | None = None
    waves: int = 3
    warmup: int = 1
    max_tokens: int = 32
    load: str = "both"  # "speakers", "calls" or "both"
    max_calls: int | None = None
    turns: int = 4
    gap_s: float | None = None


@dataclass(frozen=True)
class CallsReport:
    """The conversation load's levels, the calls the host held at the voice target with the evidence, and the
    calls its speakers predict at the duty measured (fleet/economics/duty.py), both within its slots."""

    levels: list[CallsLevel]
    capacity: Capacity
    turn_gap_s: float
    duty: float | None
    predicted: int | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "levels": [lv.as_dict() for lv in self.levels],
            "capacity": self.capacity.as_dict(),
            "turn_gap_s": self.turn_gap_s,
            "duty": self.duty,
            "predicted": self.predicted,
        }


@dataclass(frozen=True)
class BenchReport:
    """What `fleet bench` found on a host: every level measured, the capacity in speakers and in calls at
    the profile's voice target with their evidence, and dollars per call-minute at the calls it holds (at
    its speakers where no call was measured)."""

    host: str
    effective_usd_per_hour: float
    levels: list[LevelResult]
    capacity: Capacity
    usd_per_voice_minute: float | None
    kept_capacity: int | None = None  # an earlier bench's capacity, more than this one tested: kept
    calls: CallsReport | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "effective_usd_per_hour": self.effective_usd_per_hour,
            "levels": [lv.as_dict() for lv in self.levels],
            "capacity": self.capacity.as_dict(),
            "calls": self.calls.as_dict() if self.calls else None,
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
            # an engine that renders no template for a client has its template rendered here
            renders = engine_of(profile).renders_templates
            template = None if renders else (await templates.template(ctx, profile))[0]
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


async def host_memory(ctx: Context, host: Host, timeout_s: float) -> HostMemory | None:
    """The host's RAM and its server's resident set over its pinned SSH session, within `timeout_s`; None when
    it could not be read (the health check decides about the host). A host presenting an SSH key other than the
    pinned one raises HostKeyMismatch."""
    if not (host.ssh_host and host.ssh_port) or host.model not in ctx.settings.models:
        return None  # (a profile gone from fleet.toml: the server's files are unknown)
    profile = ctx.settings.models[host.model]
    try:
        async with asyncio.timeout(timeout_s):
            ssh, _ = await connect(host.ssh_host, host.ssh_port, ctx.ssh_key, host.host_key, timeout_s)
            try:
                return await read_memory(ssh, profile, timeout_s)
            finally:
                ssh.close()
    except HostKeyMismatch:
        raise
    except (TimeoutError, RemoteError, asyncssh.Error, OSError):
        return None


async def bench(ctx: Context, name: str, options: BenchOptions) -> BenchReport:
    """Replay the call at growing concurrency, searching for the most speakers and the most calls in
    conversation the host holds at its profile's voice target; record the levels, both capacities and the
    cost per voice-minute."""
    host = serving_host(ctx, name)
    assert host.api_url and host.id is not None
    profile = ctx.settings.profile(host.model)
    target = profile.voice
    if options.load not in LOADS:
        raise ValueError(f"--load {options.load!r}: one of {', '.join(LOADS)}")
    earlier = ctx.record.latest_bench([host.id]).get(host.id)
    if options.load == "calls" and earlier is None:
        raise ValueError(f"{name}: no speaker capacity measured yet: bench its speakers first (--load both)")
    server = ctx.server(host)
    fitted = await fit_call(
        server, load_call(), slots_started=host.slots, engine=engine_of(profile), ctx_per_slot=profile.ctx_per_slot
    )
    kept = None
    if options.load != "calls":
        levels, held, kept = await _speakers(ctx, host, profile, options, fitted, earlier)
    else:  # the calls alone: the speakers' levels and capacity stay the latest bench's
        levels = [LevelResult(**lv) for lv in json.loads(earlier.levels)]
        held = Capacity(earlier.capacity, target, earlier.capacity_at_least, None, None, None)
    calls = await _calls(ctx, host, profile, options, fitted, held) if options.load != "speakers" else None
    cost = usd_per_voice_minute(host.effective_usd_per_hour, calls.capacity.callers if calls else held.callers)
    ctx.record.add(
        BenchRun(
            host_id=host.id,
            first_content_p95_ms_target=target.first_content_p95_ms,
            decode_tok_s_target=target.decode_tok_s,
            capacity=held.callers,
            capacity_at_least=held.exhausted,
            usd_per_voice_minute=cost,
            levels=json.dumps([lv.as_dict() for lv in levels]),
            calls_capacity=calls.capacity.callers if calls else None,
            calls_at_least=calls.capacity.exhausted if calls else None,
            calls_predicted=calls.predicted if calls else None,
            calls_duty=calls.duty if calls else None,
            turn_gap_s=calls.turn_gap_s if calls else None,
            calls_levels=json.dumps([lv.as_dict() for lv in calls.levels] if calls else []),
        )
    )
    await publish(ctx)  # a capacity measured: the gateway's limits for this host follow
    return BenchReport(host.name, host.effective_usd_per_hour, levels, held, cost, kept, calls)


async def _speakers(
    ctx: Context,
    host: Host,
    profile: Profile,
    options: BenchOptions,
    fitted: tuple[Call, int],
    earlier: BenchRun | None,
) -> tuple[list[LevelResult], Capacity, int | None]:
    """The speaker levels: the most callers speaking in every wave at the target (within the host's slots),
    with an earlier bench's capacity kept where this one tried fewer."""
    target = profile.voice
    levels = await run_bench(
        ctx.server(host),
        *fitted,
        max_callers=options.max_callers,
        waves=options.waves,
        warmup=options.warmup,
        max_tokens=options.max_tokens,
        search=lambda most: lambda measured: next_level(measured, target, most),
    )
    held = capacity({lv.callers: lv for lv in levels}, target, options.max_callers or max(lv.callers for lv in levels))
    held = _within_slots(held, host.slots)
    kept = None
    if held.exhausted and earlier is not None and host.slots >= earlier.capacity > held.callers:
        # this bench held at every level it tried, and tried fewer callers than the host was measured to
        # hold: it says nothing against that capacity, which stays
        kept = earlier.capacity
        held = Capacity(earlier.capacity, target, earlier.capacity_at_least, held.held, None, None)
    return levels, held, kept


async def _calls(
    ctx: Context, host: Host, profile: Profile, options: BenchOptions, fitted: tuple[Call, int], speakers: Capacity
) -> CallsReport:
    """The conversation levels: the most calls in conversation at the target, each keeping its cache in a
    slot (so never more than the slots), and the calls the speaker capacity predicts at the duty measured."""
    target = profile.voice
    gap = profile.voice.turn_gap_s if options.gap_s is None else options.gap_s
    call, slots = fitted
    most = min(options.max_calls or slots, host.slots)
    levels = await run_calls(
        ctx.server(host),
        call,
        choose=lambda measured: next_level(measured, target, most),
        turns=options.turns,
        max_tokens=options.max_tokens,
        gap_s=gap,
        slots=slots,
    )
    held = _within_slots(capacity({lv.calls: lv for lv in levels}, target, most), host.slots)
    at = next((lv for lv in reversed(levels) if lv.calls <= max(held.callers, 1) and lv.duty), None)
    duty = at.duty if at else None
    predicted = None if duty is None else min(calls_for(speakers.callers, duty), host.slots)
    return CallsReport(levels, held, gap, duty, predicted)


def _within_slots(held: Capacity, slots: int) -> Capacity:
    """A capacity no larger than the slots the host was started with: a caller beyond them waits for one, so
    what held there is the host's claim (a lying /props, timings), not a capacity."""
    if held.callers <= slots:
        return held
    return Capacity(slots, held.target, False, held.held, None, f"capped at the {slots} slots it was started with")


def serving_host(ctx: Context, name: str) -> Host:
    """The named host, READY or being probed; KeyError (one line) when it is unknown or not serving."""
    hosts = ctx.record.hosts(names=[name])
    if not hosts:
        raise KeyError(f"no such host: {name!r}")
    host = hosts[0]
    if host.state not in (HostState.READY, HostState.PROBING) or not host.api_url:
        raise KeyError(f"host {name!r} is {host.state}, not serving")
    return host
