"""The Fleet: offers, plans, `up` (N bring-ups at once, fleet/bringup.py's phases each), destroy, status.

Every call that creates or destroys is recorded as an intent before it is made and as an answer
after, so a process killed at any point leaves a record that `reconcile` (fleet/reconcile.py) can
finish: nothing orphaned, nothing bought twice. A host that fails a phase is destroyed, its machine
blacklisted, and the next offer is tried. A host being worked on is owned by this process (a lease it
renews); other processes' housekeeping leaves it alone. A bill is closed only when the marketplace
confirms the instance gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol, TypeVar

import asyncssh
import httpx

from fleet import chat_template, failpoints, ggufhead
from fleet import offers as offer_rules
from fleet.bill import accrued_usd, stopped_hours
from fleet.bringup import SERVICE_PORT, BringUp
from fleet.capacity import Capacity, capacity, next_level, usd_per_voice_minute
from fleet.config import Profile, Settings
from fleet.db import CapReached, Record
from fleet.errors import FleetError
from fleet.ggufhead import GgufHeader
from fleet.hostops import PhaseFailed
from fleet.machines import MachineRecord, remember
from fleet.market import MarketError, Offer, OfferGone
from fleet.market.vast import VastMarket
from fleet.market.watch import InstanceWatch
from fleet.models import LIVE_STATES, Attempt, BenchRun, Blacklist, Host, HostState, ProbeRun, as_utc, utcnow
from fleet.ownership import process_owner
from fleet.plan import GIB, MIB, CacheSettings, Plan, PlanSettings, cache_settings_from_args, make_plan
from fleet.probes import ProbeResult
from fleet.probes.bench import LevelResult, run_bench
from fleet.probes.call import load_call
from fleet.probes.renderings import Renderings
from fleet.probes.runner import PROBES, run_probes
from fleet.remote import HostKeyMismatch, SshKey, connect
from fleet.report import Session, gather
from fleet.selection import Expectation, expect, rank

LABEL_PREFIX = "fleet:"
T = TypeVar("T")
__all__ = ["LABEL_PREFIX", "SERVICE_PORT", "CapReached", "Fleet", "UpRequest"]


class Reporter(Protocol):
    def info(self, host: str, message: str) -> None: ...

    def progress(self, host: str, what: str, done: int, total: int) -> None: ...


class QuietReporter:
    def info(self, host: str, message: str) -> None:
        pass

    def progress(self, host: str, what: str, done: int, total: int) -> None:
        pass


@dataclass(frozen=True)
class UpRequest:
    model: str
    region: str
    count: int = 1
    max_price: float | None = None
    dry_run: bool = False
    # only offers whose effective $/h (price plus the profile's traffic) stays under this (a reprice's bound)
    max_effective_price: float | None = None
    # rank by effective $/h alone, not by the expected cost of a voice-minute (fleet/selection.py)
    by_price: bool = False
    # for the standby pool: brought up and probed, then stopped (STANDBY), never published
    standby: bool = False


@dataclass
class AttemptReport:
    host: str
    offer_id: int
    machine_id: int
    gpu_name: str
    geolocation: str
    dph_total: float
    inet_usd_per_gb: float
    outcome: str
    phase: str | None = None
    reason: str | None = None
    seconds: float = 0.0
    resumed: bool = False  # a host of the standby pool started again, not a new rent

    @classmethod
    def of(cls, host: Host, resumed: bool = False) -> AttemptReport:
        """A report of a bring-up of `host` (its offer's fields are on it), ready until it fails."""
        inet = max(host.inet_up_usd_per_gb, host.inet_down_usd_per_gb)
        return cls(host.name, host.offer_id, host.machine_id, host.gpu_name, host.geolocation, host.dph_total, inet,
                   outcome="ready", resumed=resumed)  # fmt: skip


@dataclass(frozen=True)
class BenchReport:
    """What `fleet bench` found on a host: every level measured, the capacity at the profile's voice
    target with its evidence, and dollars per concurrent call-minute at that capacity."""

    host: str
    effective_usd_per_hour: float
    levels: list[LevelResult]
    capacity: Capacity
    usd_per_voice_minute: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "effective_usd_per_hour": self.effective_usd_per_hour,
            "levels": [lv.as_dict() for lv in self.levels],
            "capacity": self.capacity.as_dict(),
            "usd_per_voice_minute": self.usd_per_voice_minute,
        }


@dataclass
class UpResult:
    run_id: str
    ready: list[Host] = field(default_factory=list)
    attempts: list[AttemptReport] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # why a requested host did not come up
    planned: list[Offer] = field(default_factory=list)  # --dry-run: the offers that would be tried


@dataclass
class Waits:
    """Seconds spent waiting on the outside world, by kind (for bench/up_overhead.py)."""

    seconds: dict[str, float] = field(default_factory=dict)

    @asynccontextmanager
    async def on(self, kind: str) -> AsyncIterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - started


class OfferPicker:
    """Hands each concurrent bring-up the best offer no sibling holds, never the same machine twice."""

    def __init__(self, ranked: list[Offer], excluded_machines: set[int]) -> None:
        self._ranked = ranked
        self._held: set[int] = set(excluded_machines)
        self._lock = asyncio.Lock()

    async def claim(self, tried: set[int]) -> Offer | None:
        async with self._lock:
            for offer in self._ranked:
                if offer.id not in tried and offer.machine_id not in self._held:
                    self._held.add(offer.machine_id)
                    return offer
            return None

    def release(self, offer: Offer) -> None:
        """The machine may be offered again (the offer vanished; the machine itself did nothing wrong)."""
        self._held.discard(offer.machine_id)


class Fleet:
    """The library behind every command; the CLI, the scheduler and the tests call these methods."""

    def __init__(
        self,
        settings: Settings,
        record: Record,
        market: VastMarket,
        ssh_key: SshKey,
        hub_url: str,
        reporter: Reporter | None = None,
    ) -> None:
        self.settings = settings
        self.record = record
        self.market = market
        self.ssh_key = ssh_key
        self.hub_url = hub_url.rstrip("/")
        self.reporter = reporter or QuietReporter()
        self.waits = Waits()
        self.watch = InstanceWatch(market, settings.provider.poll_max_interval_s)
        self._headers: dict[str, GgufHeader] = {}
        self._templates: dict[str, tuple[str | None, str]] = {}
        self._leases: asyncio.Task | None = None

    # ---- ownership ----------------------------------------------------------------------------
    def claim(self, host: Host) -> bool:
        """Own the host (fleet/ownership.py) and keep its lease renewed while this Fleet runs."""
        if not self.record.claim(host, self.settings.up.lease_s):
            return False
        if self._leases is None or self._leases.done():
            self._leases = asyncio.get_running_loop().create_task(self._renew_leases(), name="leases")
        return True

    async def _renew_leases(self) -> None:
        lease_s = self.settings.up.lease_s
        while True:
            await asyncio.sleep(lease_s / 3)
            self.record.renew(lease_s)

    async def close(self) -> None:
        if self._leases is not None:
            self._leases.cancel()
        await self.watch.close()

    # ---- offers ---------------------------------------------------------------------------
    # ---- plan ---------------------------------------------------------------------------
    def file_url(self, repo: str, revision: str, filename: str) -> str:
        return f"{self.hub_url}/{repo}/resolve/{revision}/{filename}"

    async def _header(self, url: str) -> GgufHeader:
        if url not in self._headers:
            token = os.environ.get(self.settings.hub.token_env, "")
            async with self.waits.on("hub"):
                self._headers[url] = await ggufhead.read_url(
                    url, {"Authorization": f"Bearer {token}"} if token else None
                )
        return self._headers[url]

    async def plan(
        self, model: str, ctx_per_slot: int | None = None, slots: int | None = None, swa_full: bool | None = None
    ) -> Plan:
        """GPU memory for the profile (or the given overrides), from its GGUF headers over HTTP ranges."""
        profile = self.settings.profile(model)
        cache = cache_settings_from_args(profile.args, ctx_per_slot or profile.ctx_per_slot)
        if swa_full is not None:
            cache = CacheSettings(cache.ctx_per_slot, cache.ubatch, swa_full, cache.type_k, cache.type_v)
        files = {f.key: f for f in profile.files}
        main = await self._header(self.file_url(files["main"].repo, files["main"].revision, files["main"].file))
        draft = None
        if "draft" in files:
            d = files["draft"]
            draft = await self._header(self.file_url(d.repo, d.revision, d.file))
        p = self.settings.plan
        return make_plan(
            model,
            slots or profile.slots,
            cache,
            main,
            draft,
            PlanSettings(int(p.runtime_mib_for(profile) * MIB), int(p.headroom_mib * MIB)),
        )

    # ---- chat template ----------------------------------------------------------------------
    async def _template(self, profile: Profile) -> tuple[str | None, str]:
        """(text, source) of the template llama-server will use: the profile's file, else the model
        file's own (None when it carries none: llama-server falls back to its default)."""
        if profile.name not in self._templates:
            embedded = None
            if profile.chat_template is None:
                main = next(f for f in profile.files if f.key == "main")
                header = await self._header(self.file_url(main.repo, main.revision, main.file))
                embedded = header.metadata.get("tokenizer.chat_template")
            self._templates[profile.name] = chat_template.template_text(profile, self.settings.source.parent, embedded)
        return self._templates[profile.name]

    async def chat_template(self, profile: Profile) -> str | None:
        """The text of the template fleet puts on the host (the profile's file), or None."""
        return (await self._template(profile))[0] if profile.chat_template else None

    async def check_template(self, profile: Profile) -> Renderings | None:
        """The renderings check on the profile's template, here, before anything is rented; raises
        TemplateError (nothing created) when a shape the profile does not accept breaks the prefix."""
        text, source = await self._template(profile)
        if text is None:
            return None
        result = await chat_template.check_text(text, chat_template.template_kwargs(profile))
        reason = chat_template.refusal(profile, source, result)
        if reason is not None:
            raise chat_template.TemplateError(reason)
        return result

    # ---- offers ---------------------------------------------------------------------------
    def criteria(
        self,
        profile: Profile,
        region: str,
        max_price: float | None,
        excluded: set[int] | None = None,
        planned_gb: float = 0.0,
    ) -> offer_rules.Criteria:
        return offer_rules.Criteria(
            countries=frozenset(self.settings.region(region)),
            filters=self.settings.filters,
            min_gpu_ram_gb=max(profile.gpu_ram_gb * 0.97, planned_gb),  # a "24 GB" card reports 23.99 GiB
            max_usd_per_hour=max_price,
            excluded_machines=frozenset(excluded or ()),
        )

    async def offers(
        self,
        model: str,
        region: str,
        max_price: float | None = None,
        exclude_unusable: bool = False,
        record_seen: bool = True,
    ) -> offer_rules.Funnel:
        """Search, re-check every filter locally, rank by effective $/h; record what was seen (unless a
        dry run asks to write nothing)."""
        profile = self.settings.profile(model)
        excluded = self._unusable_machines() if exclude_unusable else set()
        needed = (await self.plan(model)).total_bytes() / GIB
        criteria = self.criteria(profile, region, max_price, excluded, planned_gb=needed)
        async with self.waits.on("market"):
            found = await self.market.search(offer_rules.query_for(criteria, profile))
        if record_seen:
            for o in found:
                self.record.add_offer_seen(self.market.url, o)
        return offer_rules.funnel(found, criteria, profile)

    def _unusable_machines(self) -> set[int]:
        live = {h.machine_id for h in self.record.hosts(states=LIVE_STATES)}
        return live | self.record.blacklisted_machines(self.market.url, utcnow())

    # ---- up ---------------------------------------------------------------------------
    async def up(self, request: UpRequest) -> UpResult:
        profile = self.settings.profile(request.model)
        self.settings.region(request.region)
        run_id = secrets.token_hex(4)
        result = UpResult(run_id=run_id)
        await self.check_template(profile)
        funnel = await self.offers(request.model, request.region, request.max_price, exclude_unusable=True)
        ranked = [offer for offer, _ in self.rank(profile, funnel.passed, request.by_price)]
        if request.dry_run:
            result.planned = ranked[: max(request.count, 1) * self.settings.up.max_attempts]
            return result
        async with self.waits.on("market"):
            await self.market.ensure_ssh_key(self.ssh_key.public)
        if request.max_effective_price is not None:
            cap = request.max_effective_price
            ranked = [o for o in ranked if offer_rules.effective_price_per_hour(o, profile) <= cap]
        picker = OfferPicker(ranked, set())
        tasks = [
            asyncio.get_running_loop().create_task(self._bring_up_one(run_id, profile, request, picker, result))
            for _ in range(request.count)
        ]
        try:
            outcomes = await asyncio.gather(*tasks)
        except BaseException:
            # Interrupted: every sibling destroys what it created before this returns (and the market closes).
            for task in tasks:
                task.cancel()
            await _to_the_end(asyncio.gather(*tasks, return_exceptions=True))
            raise
        for outcome in outcomes:
            if isinstance(outcome, Host):
                result.ready.append(outcome)
            else:
                result.failures.append(outcome)
        return result

    async def _bring_up_one(
        self, run_id: str, profile: Profile, request: UpRequest, picker: OfferPicker, result: UpResult
    ) -> Host | str:
        if not request.standby:
            resumed = await self._resume_one(run_id, profile, request, result)
            if resumed is not None:
                return resumed
        tried: set[int] = set()
        last_reason = "no offer passed the filters"
        for _ in range(self.settings.up.max_attempts):
            offer = await picker.claim(tried)
            if offer is None:
                return f"no offer left to try ({last_reason})"
            tried.add(offer.id)
            started = time.monotonic()
            try:
                host = await self._intent_to_create(run_id, profile, request, offer)
            except CapReached as e:
                picker.release(offer)
                return str(e)
            report = AttemptReport.of(host)
            result.attempts.append(report)
            try:
                await BringUp(self, host, profile, offer, standby=request.standby).run()
                self._end_attempt(host, None, None)
                self.publish_endpoints()
                if request.standby:
                    disk = f"${host.storage_usd_per_hour:.4f}/h for its disk"
                    self.reporter.info(host.name, f"STANDBY: stopped with its weights ({disk})")
                else:
                    self.reporter.info(host.name, f"READY at {host.api_url} (${host.dph_total:.4f}/h)")
                report.seconds = time.monotonic() - started
                return host
            except OfferGone as e:
                picker.release(offer)
                report.outcome, report.phase, report.reason = "failed", "create", f"offer gone: {e}"
                self._end_attempt(host, "create", report.reason)
                self.record.close(host, HostState.DESTROYED, 0.0, failed_phase="create", failure_reason=report.reason)
            except PhaseFailed as e:
                report.outcome, report.phase, report.reason = "failed", e.phase, e.reason
                if not await self._contained_fail(host, e.phase, e.reason, e.blacklist):
                    report.seconds = time.monotonic() - started
                    return f"stopped: the instance of {host.name} could not be destroyed; `fleet reconcile` will"
                if not e.retry:
                    report.seconds = time.monotonic() - started
                    return f"stopped: {e.phase}: {e.reason}"
            except Exception as e:  # anything else: this host's instance goes, its siblings carry on
                report.outcome, report.phase, report.reason = "failed", host.state, f"{type(e).__name__}: {e}"
                await self._contained_fail(host, host.state, report.reason, False)
                report.seconds = time.monotonic() - started
                return f"stopped after an unexpected error: {report.reason}"
            except BaseException:
                await _to_the_end(self._contained_fail(host, host.state, "interrupted", False))
                raise
            report.seconds = time.monotonic() - started
            last_reason = report.reason or last_reason
            self.reporter.info(host.name, f"failed in {report.phase}: {report.reason}; trying the next offer")
        return f"gave up after {self.settings.up.max_attempts} attempts (last: {last_reason})"

    async def _resume_one(self, run_id: str, profile: Profile, request: UpRequest, result: UpResult) -> Host | None:
        """A host of the standby pool for this profile and region, started, its files verified, probed and
        READY; None when the pool has none free, or when the one taken did not come back in time (it is
        destroyed, and a cold bring-up follows). Taking one is a compare-and-set STANDBY -> BOOTING: two
        bring-ups, here or in another process, never take the same host."""
        blacklisted = self.record.blacklisted_machines(self.market.url, utcnow())
        for host in self.record.hosts(states=(HostState.STANDBY,), model=profile.name, region=request.region):
            if host.machine_id in blacklisted:
                continue  # blacklisted since it was parked
            if request.max_price is not None and host.dph_total > request.max_price:
                continue
            if request.max_effective_price is not None and host.effective_usd_per_hour > request.max_effective_price:
                continue  # a reprice moves to cheaper hosts only
            if not self.claim(host):
                continue
            stopped = stopped_hours(host)
            if not self.record.transition(host, HostState.BOOTING, stopped_hours=stopped, stopped_at=None):
                self.record.release(host)
                continue
            assert host.instance_id is not None
            self.record.add(_attempt(run_id, host))
            report = AttemptReport.of(host, resumed=True)
            result.attempts.append(report)
            started = time.monotonic()
            self.reporter.info(host.name, "taken from the standby pool: starting its instance")
            try:
                async with self.waits.on("market"):
                    await self.market.start(host.instance_id)
                await BringUp(self, host, profile, None, resume=True).run()
            except (PhaseFailed, MarketError) as e:
                phase, reason = (e.phase, e.reason) if isinstance(e, PhaseFailed) else ("boot", str(e))
                report.outcome, report.phase, report.reason = "failed", phase, reason
                report.seconds = time.monotonic() - started
                self.reporter.info(host.name, f"did not come back from standby ({phase}: {reason}); a cold bring-up")
                await self._contained_fail(host, phase, reason, blacklist=False)
                return None
            except BaseException:
                await _to_the_end(self._contained_fail(host, host.state, "interrupted", False))
                raise
            self._end_attempt(host, None, None)
            self.publish_endpoints()
            report.seconds = time.monotonic() - started
            self.reporter.info(host.name, f"READY from standby at {host.api_url} in {report.seconds:.1f}s")
            return host
        return None

    async def _intent_to_create(self, run_id: str, profile: Profile, request: UpRequest, offer: Offer) -> Host:
        """Check the caps and write the host row (owned by this process) before the create call, in one
        transaction no other process can interleave (Record.reserve)."""
        caps = self.settings.caps

        def check(open_hosts: list[Host]) -> None:
            same_model = [h for h in open_hosts if h.model == profile.name]
            spend = sum(h.storage_usd_per_hour if h.state == HostState.STANDBY else h.dph_total for h in open_hosts)
            if len(open_hosts) + 1 > caps.max_hosts_total:
                raise CapReached(
                    f"cap reached: {len(open_hosts)} live hosts, caps.max_hosts_total = {caps.max_hosts_total}"
                )
            if len(same_model) + 1 > caps.max_hosts_per_model:
                raise CapReached(
                    f"cap reached: {len(same_model)} live {profile.name} hosts, "
                    f"caps.max_hosts_per_model = {caps.max_hosts_per_model}"
                )
            if spend + offer.dph_total > caps.max_usd_per_hour:
                raise CapReached(
                    f"cap reached: ${spend:.3f}/h live + ${offer.dph_total:.3f}/h would exceed "
                    f"caps.max_usd_per_hour = {caps.max_usd_per_hour}"
                )

        name = f"{profile.name}-{request.region}-{secrets.token_hex(3)}"
        host = Host(
            name=name,
            run_id=run_id,
            model=profile.name,
            region=request.region,
            state=HostState.CREATING,
            provider_url=self.market.url,
            label=f"{LABEL_PREFIX}{name}",
            offer_id=offer.id,
            machine_id=offer.machine_id,
            gpu_name=offer.gpu_name,
            num_gpus=offer.num_gpus,
            gpu_ram_mb=offer.gpu_ram_mb,
            geolocation=offer.geolocation,
            dph_total=offer.dph_total,
            inet_up_usd_per_gb=offer.inet_up_usd_per_gb,
            inet_down_usd_per_gb=offer.inet_down_usd_per_gb,
            effective_usd_per_hour=offer_rules.effective_price_per_hour(offer, profile),
            storage_usd_per_hour=offer_rules.storage_price_per_hour(offer),
            slots=profile.slots,
            owner=process_owner(),
            lease_until=utcnow() + timedelta(seconds=self.settings.up.lease_s),
        )
        self.record.reserve(host, _attempt(run_id, host), check)
        self.claim(host)  # starts the lease renewal
        failpoints.reach("after_intent")
        return host

    async def _probe(
        self,
        host: Host,
        profile: Profile,
        names: list[str],
        ssh: asyncssh.SSHClientConnection | None,
        timeout_s: float,
        plot_path: Path | None = None,
    ) -> list[ProbeResult]:
        assert host.api_url and host.api_key
        try:
            async with asyncio.timeout(timeout_s), self.waits.on("server"):
                results = await run_probes(names, host.api_url, host.api_key, profile, self.settings, ssh, plot_path)
        except (TimeoutError, httpx.HTTPError, FleetError, OSError) as e:
            raise PhaseFailed("probes", f"probing failed: {type(e).__name__}: {e}") from None
        for result in results:
            self.record.add(
                ProbeRun(
                    host_id=host.id,
                    name=result.name,
                    passed=result.passed,
                    diagnosis=result.diagnosis,
                    metrics=json.dumps(result.metrics),
                )
            )
            self.reporter.info(
                host.name, f"probe {result.name}: {'pass' if result.passed else 'FAIL'}: {result.diagnosis}"
            )
        return results

    async def probe(self, name: str, only: list[str] | None = None, plot_path: Path | None = None) -> list[ProbeResult]:
        """Run probes on a serving host now (all of them unless `only`); every result is recorded."""
        host = self._serving_host(name)
        profile = self.settings.profile(host.model)
        names = only or list(PROBES)
        ssh = None
        if "thermal" in names and host.ssh_host and host.ssh_port:
            try:
                ssh, _ = await connect(
                    host.ssh_host, host.ssh_port, self.ssh_key, host.host_key, self.settings.timeouts.ssh
                )
            except HostKeyMismatch as e:
                # Not the machine we pinned at first contact: someone in the middle, or a machine re-imaged
                # under us. Refused, recorded, and the machine is not rented again.
                self.record.event("error", "host_key", json.dumps({"error": str(e)}), host.id)
                self.blacklist_machine(host, "host_key", str(e))
                raise
        try:
            return await self._probe(host, profile, names, ssh, self.settings.timeouts.probes, plot_path)
        finally:
            if ssh is not None:
                ssh.close()

    async def bench(self, name: str, max_callers: int | None, waves: int, warmup: int, max_tokens: int) -> BenchReport:
        """Replay the call at growing concurrency, searching for the most callers the host holds at its
        profile's voice target; record the levels, the capacity and the cost per voice-minute."""
        host = self._serving_host(name)
        assert host.api_url and host.api_key and host.id is not None
        target = self.settings.profile(host.model).voice
        levels = await run_bench(
            host.api_url,
            host.api_key,
            load_call(),
            max_callers=max_callers,
            waves=waves,
            warmup=warmup,
            max_tokens=max_tokens,
            search=lambda most: lambda measured: next_level(measured, target, most),
        )
        held = capacity({lv.callers: lv for lv in levels}, target, max_callers or max(lv.callers for lv in levels))
        cost = usd_per_voice_minute(host.effective_usd_per_hour, held.callers)
        self.record.add(
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
        return BenchReport(host.name, host.effective_usd_per_hour, levels, held, cost)

    def _serving_host(self, name: str) -> Host:
        hosts = self.record.hosts(names=[name])
        if not hosts:
            raise KeyError(f"no such host: {name!r}")
        host = hosts[0]
        if host.state not in (HostState.READY, HostState.PROBING) or not host.api_url:
            raise KeyError(f"host {name!r} is {host.state}, not serving")
        return host

    def _end_attempt(self, host: Host, phase: str | None, reason: str | None) -> None:
        assert host.id is not None
        self.record.close_attempt(host.id, "failed" if phase else "ready", phase, reason)

    async def _contained_fail(self, host: Host, phase: str, reason: str, blacklist: bool) -> bool:
        """_fail, never raising: False when the instance could not be destroyed (the record keeps it open
        for reconcile, an error event says why)."""
        try:
            await self._fail(host, phase, reason, blacklist)
        except Exception as e:
            self.record.event("error", "destroy", json.dumps({"error": f"{type(e).__name__}: {e}"}), host.id)
            self.reporter.info(host.name, f"could not destroy its instance ({e}); `fleet reconcile` will finish it")
            return False
        return True

    async def _fail(self, host: Host, phase: str, reason: str, blacklist: bool) -> None:
        """The bring-up failed: record why, blacklist the machine, destroy what this attempt created. The
        bill closes only once the marketplace confirms the instance gone; until then reconcile sees it."""
        self.record.event("error", "phase", json.dumps({"phase": phase, "reason": reason}), host.id)
        self.record.transition(host, HostState.FAILED, failed_phase=phase, failure_reason=reason)
        if blacklist:
            self.blacklist_machine(host, phase, reason)
        self._end_attempt(host, phase, reason)
        if host.destroyed_at is not None:
            return
        if host.instance_id is None and host.create_sent_at is not None:
            await self._destroy_strays_of(host)  # a create whose answer we lost may have bought one
        if host.instance_id is not None:
            await self._destroy_instance(host, final_state=HostState.FAILED)
        else:
            self.record.close(host, HostState.FAILED, 0.0)

    def blacklist_machine(self, host: Host, phase: str, reason: str) -> None:
        self.record.add(
            Blacklist(
                provider_url=host.provider_url,
                machine_id=host.machine_id,
                phase=phase,
                reason=reason,
                expires_at=utcnow() + timedelta(hours=self.settings.up.blacklist_hours),
            )
        )

    def publish_endpoints(self) -> None:
        """Write the READY set to rotation.endpoints_file (atomically, private), when it changed."""
        path = self.settings.rotation.endpoints_path
        text = json.dumps(self.endpoints(), indent=1, sort_keys=True) + "\n"
        if path.exists() and path.read_text() == text:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    async def _destroy_strays_of(self, host: Host) -> None:
        """After a create whose answer we did not get: find the instance by our label and adopt it (the caller
        destroys it). vast.ai's reads lag its create, so an empty answer is asked again until
        timeouts.instance_visible has passed since the request left."""
        waited = (utcnow() - as_utc(host.create_sent_at or utcnow())).total_seconds()
        deadline = time.monotonic() + max(self.settings.timeouts.instance_visible - waited, 0.0)
        while True:
            async with self.waits.on("market"):
                found = [i for i in await self.market.list(host.label) if i.label == host.label]
            if found:
                self.record.update(host, instance_id=found[0].id)
                for extra in found[1:]:  # never expected: one intent, one create
                    self.record.event("error", "create", json.dumps({"duplicate_instance": extra.id}), host.id)
                    await self.market.destroy(extra.id)
                return
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(2.0)

    # ---- destroy ----------------------------------------------------------------------------
    async def _destroy_instance(
        self, host: Host, final_state: HostState = HostState.DESTROYED, confirm_timeout_s: float = 60.0
    ) -> None:
        """Destroy the host's instance, confirm through the marketplace that it is gone, then close its bill."""
        assert host.instance_id is not None
        self.record.event("intent", "destroy", json.dumps({"instance_id": host.instance_id}), host.id)
        if final_state == HostState.DESTROYED:
            self.record.transition(host, HostState.DESTROYING)
        async with self.waits.on("market"):
            await self.market.destroy(host.instance_id)
            failpoints.reach("mid_destroy")
            deadline = time.monotonic() + confirm_timeout_s
            while await self.market.get(host.instance_id) is not None:
                if time.monotonic() > deadline:
                    raise MarketError(f"instance {host.instance_id} still listed {confirm_timeout_s:g}s after destroy")
                await asyncio.sleep(1.0)
        now = utcnow()
        self.record.close(host, final_state, accrued_usd(host, now))
        self.publish_endpoints()
        self.record.event("answer", "destroy", json.dumps({"instance_id": host.instance_id, "gone": True}), host.id)
        self.reporter.info(host.name, f"instance {host.instance_id} destroyed; cost ${host.accrued_usd or 0:.4f}")

    async def destroy(self, names: list[str] | None) -> DestroyReport:
        """Destroy the named hosts (None: every host whose bill is open). Idempotent; confirms each is gone.
        A host another live process is working on (a bring-up, a drain) is left to it and reported."""
        if names is None:
            targets = self.record.open_hosts()
        else:
            targets = self.record.hosts(names=names)
            unknown = sorted(set(names) - {h.name for h in targets})
            if unknown:
                raise KeyError(f"no such host: {', '.join(map(repr, unknown))}")
        report = DestroyReport()
        for host in targets:
            if host.destroyed_at is not None:
                report.done.append(host)
                continue
            if not self.claim(host):
                report.busy.append(host)
                continue
            if host.instance_id is None and host.create_sent_at is not None:
                await self._destroy_strays_of(host)
            if host.instance_id is None:
                self.record.close(host, HostState.DESTROYED, 0.0, failure_reason="destroyed before it bought anything")
            else:
                final = HostState.FAILED if host.state == HostState.FAILED else HostState.DESTROYED
                await self._destroy_instance(host, final_state=final)
            report.done.append(host)
        self.publish_endpoints()
        return report

    # ---- status and reconcile ----------------------------------------------------------------
    def status(self, include_ended: bool = False) -> list[dict[str, Any]]:
        """Each host's summary, with the capacity and cost per voice-minute of its latest bench (None when
        it was never benched)."""
        hosts = self.record.hosts() if include_ended else self.record.hosts(states=LIVE_STATES)
        benched = self.record.latest_bench([h.id for h in hosts if h.id is not None])
        rows = []
        for h in hosts:
            run = benched.get(h.id) if h.id is not None else None
            rows.append(
                {
                    **host_summary(h),
                    "capacity": run.capacity if run else None,
                    "capacity_at_least": run.capacity_at_least if run else None,
                    "usd_per_voice_minute": run.usd_per_voice_minute if run else None,
                }
            )
        return rows

    def rank(self, profile: Profile, offers: list[Offer], by_price: bool = False) -> list[tuple[Offer, Expectation]]:
        """The offers with what fleet expects of each (fleet/selection.py), best expected $/voice-minute
        first; `by_price` keeps the effective $/h order."""
        seen = {(m.provider_url, m.machine_id): m for m in self.machines()}
        if by_price:
            return [(o, expect(o, profile, seen, self.market.url)) for o in offers]
        return rank(offers, profile, seen, self.market.url)

    def session(self, since: datetime) -> Session:
        """What the report shows: the hosts created since `since` and what fleet measured on them."""
        hosts, probe_runs, bench_runs, _ = self.record.machine_rows()
        return gather(hosts, probe_runs, bench_runs, since, utcnow())

    def machines(self) -> list[MachineRecord]:
        """What fleet measured on each marketplace machine it ever rented (fleet/machines.py)."""
        return remember(*self.record.machine_rows())

    def endpoints(self) -> list[dict[str, Any]]:
        return [
            {
                "name": h.name,
                "url": h.api_url,
                "model": h.model,
                "slots": h.slots,
                "region": h.region,
                "api_key": h.api_key,
            }
            for h in self.record.hosts(states=(HostState.READY,))
        ]

    async def reconcile(self) -> dict[str, Any]:
        """Settle every host whose bill is open and destroy strays (fleet/reconcile.py)."""
        from fleet.reconcile import reconcile

        return await reconcile(self)


async def _to_the_end(cleanup: Awaitable[T]) -> T:
    """Await a cleanup to its end, even when cancelled again meanwhile (a second Ctrl-C, the caller's own
    cancel): what a bring-up bought is destroyed before its process lets go of the marketplace."""
    task = asyncio.ensure_future(cleanup)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise


@dataclass
class DestroyReport:
    done: list[Host] = field(default_factory=list)
    busy: list[Host] = field(default_factory=list)  # owned by another live process: left alone


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
        "dph_total": h.dph_total,
        "effective_usd_per_hour": h.effective_usd_per_hour,
        "accrued_usd": h.accrued_usd if h.accrued_usd is not None else accrued_usd(h),
        "endpoint": h.api_url,
        "slots": h.slots,
        "created_at": h.created_at.isoformat(),
        "ready_at": h.ready_at.isoformat() if h.ready_at else None,
        "destroyed_at": h.destroyed_at.isoformat() if h.destroyed_at else None,
        "failed_phase": h.failed_phase,
        "failure_reason": h.failure_reason,
    }


def _attempt(run_id: str, host: Host) -> Attempt:
    """The attempts row of one bring-up of `host` (a new rent, or a start from the standby pool); its host_id
    is set by Record.reserve for a host not yet written."""
    return Attempt(
        run_id=run_id,
        host_id=host.id,
        model=host.model,
        offer_id=host.offer_id,
        machine_id=host.machine_id,
        dph_total=host.dph_total,
        inet_usd_per_gb=max(host.inet_up_usd_per_gb, host.inet_down_usd_per_gb),
    )
