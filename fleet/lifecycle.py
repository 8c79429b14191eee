"""The per-host state machine: rent, boot, connect, pull, start, probe; destroy; reconcile.

Every call that creates or destroys is recorded as an intent before it is made and as an answer
after, so a process killed at any point leaves a record that `reconcile` can finish: nothing
orphaned, nothing bought twice. A host that fails a phase is destroyed, its machine blacklisted,
and the next offer is tried.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import asyncssh
import httpx

from fleet import ggufhead, hostops
from fleet import offers as offer_rules
from fleet.config import Profile, Settings
from fleet.db import Record
from fleet.ggufhead import GgufHeader
from fleet.hostops import PhaseFailed
from fleet.market import FAILED, HEARTBEAT_LOST, CreateFailed, Instance, InstanceSpec, MarketError, Offer, OfferGone
from fleet.market.vast import VastMarket
from fleet.market.watch import InstanceWatch
from fleet.models import LIVE_STATES, Attempt, Blacklist, Host, HostState, ProbeRun, utcnow
from fleet.plan import GIB, MIB, CacheSettings, Plan, PlanSettings, cache_settings_from_args, make_plan
from fleet.probes import ProbeResult
from fleet.probes.bench import LevelResult, run_bench
from fleet.probes.call import load_call
from fleet.probes.runner import PROBES, run_probes
from fleet.probes.stream import StreamError
from fleet.remote import RemoteError, SshKey, connect

LABEL_PREFIX = "fleet:"
# llama-server's port inside the host. An ordinary port: vast.ai maps it to a random external port on the
# public IP and lists that in the instance's `ports` (an identity port above 70000 is never listed there).
SERVICE_PORT = 18080


class CapReached(Exception):
    """A cap in fleet.toml forbids another create."""


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


def accrued_usd(host: Host, now: datetime | None = None) -> float:
    end = host.destroyed_at or now or utcnow()
    start = host.created_at
    if start.tzinfo is None:
        start = start.replace(tzinfo=UTC)
    if end.tzinfo is None:
        end = end.replace(tzinfo=UTC)
    return host.dph_total * max((end - start).total_seconds(), 0.0) / 3600.0


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
        self._create_lock = asyncio.Lock()
        self._headers: dict[str, GgufHeader] = {}

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
            PlanSettings(int(p.runtime_overhead_mib * MIB), int(p.headroom_mib * MIB)),
        )

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
        funnel = await self.offers(request.model, request.region, request.max_price, exclude_unusable=True)
        if request.dry_run:
            result.planned = funnel.passed[: max(request.count, 1) * self.settings.up.max_attempts]
            return result
        async with self.waits.on("market"):
            await self.market.ensure_ssh_key(self.ssh_key.public)
        picker = OfferPicker(funnel.passed, set())
        outcomes = await asyncio.gather(
            *(self._bring_up_one(run_id, profile, request, picker, result) for _ in range(request.count))
        )
        for outcome in outcomes:
            if isinstance(outcome, Host):
                result.ready.append(outcome)
            else:
                result.failures.append(outcome)
        return result

    async def _bring_up_one(
        self, run_id: str, profile: Profile, request: UpRequest, picker: OfferPicker, result: UpResult
    ) -> Host | str:
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
            report = AttemptReport(
                host.name,
                offer.id,
                offer.machine_id,
                offer.gpu_name,
                offer.geolocation,
                offer.dph_total,
                max(offer.inet_up_usd_per_gb, offer.inet_down_usd_per_gb),
                outcome="ready",
            )
            result.attempts.append(report)
            try:
                await self._attempt(host, profile, offer)
                report.seconds = time.monotonic() - started
                return host
            except OfferGone as e:
                picker.release(offer)
                report.outcome, report.phase, report.reason = "failed", "create", f"offer gone: {e}"
                self._end_attempt(host, "create", report.reason, state=HostState.DESTROYED)
            except PhaseFailed as e:
                report.outcome, report.phase, report.reason = "failed", e.phase, e.reason
                await self._fail(host, e.phase, e.reason, blacklist=e.blacklist)
            except (MarketError, RemoteError, OSError, asyncssh.Error, httpx.HTTPError) as e:
                report.outcome, report.phase, report.reason = "failed", host.state, f"{type(e).__name__}: {e}"
                await self._fail(host, host.state, report.reason, blacklist=False)
                report.seconds = time.monotonic() - started
                return f"stopped after an unexpected error: {report.reason}"
            except BaseException:
                await asyncio.shield(self._fail(host, host.state, "interrupted", blacklist=False))
                raise
            report.seconds = time.monotonic() - started
            last_reason = report.reason or last_reason
            self.reporter.info(host.name, f"failed in {report.phase}: {report.reason}; trying the next offer")
        return f"gave up after {self.settings.up.max_attempts} attempts (last: {last_reason})"

    async def _intent_to_create(self, run_id: str, profile: Profile, request: UpRequest, offer: Offer) -> Host:
        """Check the caps and write the host row before the create call, under one lock."""
        async with self._create_lock:
            live = self.record.hosts(states=LIVE_STATES)
            caps = self.settings.caps
            same_model = [h for h in live if h.model == profile.name]
            spend = sum(h.dph_total for h in live)
            if len(live) + 1 > caps.max_hosts_total:
                raise CapReached(f"cap reached: {len(live)} live hosts, caps.max_hosts_total = {caps.max_hosts_total}")
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
                slots=profile.slots,
            )
            self.record.add(host)
            self.record.add(
                Attempt(
                    run_id=run_id,
                    host_id=host.id,
                    model=profile.name,
                    offer_id=offer.id,
                    machine_id=offer.machine_id,
                    dph_total=offer.dph_total,
                    inet_usd_per_gb=max(offer.inet_up_usd_per_gb, offer.inet_down_usd_per_gb),
                )
            )
            self.record.event("intent", "create", json.dumps({"offer_id": offer.id, "label": host.label}), host.id)
            return host

    async def _attempt(self, host: Host, profile: Profile, offer: Offer) -> None:
        spec = InstanceSpec(
            image=self.settings.provider.image, disk_gb=profile.disk_gb, label=host.label, env={}, ports=[SERVICE_PORT]
        )
        self.reporter.info(
            host.name, f"renting offer {offer.id} ({offer.gpu_name}, {offer.geolocation}, ${offer.dph_total:.4f}/h)"
        )
        try:
            async with self.waits.on("market"):
                instance_id = await self.market.create(offer.id, spec)
        except OfferGone:
            self.record.event("answer", "create", "offer gone", host.id)
            raise
        except CreateFailed as e:
            # vast.ai may have made the contract despite the error: destroy what it names, or what carries
            # our label once its reads catch up. The machine did nothing wrong: next offer, no blacklist.
            detail = json.dumps({"error": str(e), "new_contract": e.new_contract})
            self.record.event("answer", "create", detail, host.id)
            if e.new_contract is not None:
                self.record.update(host, instance_id=e.new_contract)
                await self._destroy_instance(host, final_state=HostState.FAILED)
            else:
                await self._destroy_strays_of(host)
            raise PhaseFailed("create", str(e), blacklist=False) from None
        except MarketError as e:
            # The create may have been processed: look for our label, so nothing is left billing.
            self.record.event("answer", "create", f"error: {e}", host.id)
            await self._destroy_strays_of(host)
            raise
        self.record.update(host, instance_id=instance_id, state=HostState.BOOTING)
        self.record.event("answer", "create", json.dumps({"instance_id": instance_id}), host.id)
        self.reporter.info(host.name, f"instance {instance_id} created; waiting for it to run")

        timeouts = self.settings.timeouts
        instance = await self._wait_running(host)
        self.record.update(host, running_at=utcnow(), state=HostState.CONNECTING)
        endpoint = instance.ssh_endpoint()
        service = instance.service_endpoint(SERVICE_PORT)
        if endpoint is None or service is None:
            raise PhaseFailed("boot", f"running without an SSH endpoint or a mapping of port {SERVICE_PORT}")
        try:
            async with self.waits.on("ssh"):
                conn, host_key = await connect(endpoint[0], endpoint[1], self.ssh_key, None, timeouts.ssh)
        except RemoteError as e:
            raise PhaseFailed("connect", str(e)) from None
        async with conn:
            self.record.update(
                host,
                ssh_host=endpoint[0],
                ssh_port=endpoint[1],
                host_key=host_key,
                connected_at=utcnow(),
                state=HostState.PULLING,
            )
            self.reporter.info(host.name, f"SSH {endpoint[0]}:{endpoint[1]} (host key pinned); pulling weights")
            async with self.waits.on("pull"):
                files = await hostops.pull_files(
                    conn,
                    profile,
                    self.hub_url,
                    os.environ.get(self.settings.hub.token_env, ""),
                    self.settings.up.pull_connections,
                    timeouts.pull,
                    lambda name, done, total: self.reporter.progress(host.name, name, done, total),
                )
            self.record.update(host, pulled_at=utcnow(), state=HostState.STARTING)
            api_key = secrets.token_urlsafe(32)
            api_url = f"http://{service[0]}:{service[1]}"
            async with self.waits.on("server"):
                await hostops.start_server(conn, profile, SERVICE_PORT, files, api_key, api_url, timeouts.load)
            self.record.update(host, api_url=api_url, api_key=api_key, started_at=utcnow(), state=HostState.PROBING)
            names = list(profile.probes.on_up)
            self.reporter.info(host.name, f"llama-server up at {api_url}; probing: {', '.join(names)}")
            results = await self._probe(host, profile, names, conn, timeouts.probes)
        failed = [r for r in results if not r.passed]
        if failed:
            raise PhaseFailed("probes", "; ".join(f"{r.name}: {r.diagnosis}" for r in failed))
        self.record.update(host, ready_at=utcnow(), state=HostState.READY)
        self._end_attempt(host, None, None, state=HostState.READY)
        self.publish_endpoints()
        self.reporter.info(host.name, f"READY at {api_url} (${host.dph_total:.4f}/h)")

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
        except (TimeoutError, httpx.HTTPError, StreamError, OSError) as e:
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
            ssh, _ = await connect(
                host.ssh_host, host.ssh_port, self.ssh_key, host.host_key, self.settings.timeouts.ssh
            )
        try:
            return await self._probe(host, profile, names, ssh, self.settings.timeouts.probes, plot_path)
        finally:
            if ssh is not None:
                ssh.close()

    async def bench(
        self, name: str, max_callers: int | None, waves: int, warmup: int, max_tokens: int
    ) -> list[LevelResult]:
        host = self._serving_host(name)
        assert host.api_url and host.api_key
        return await run_bench(
            host.api_url,
            host.api_key,
            load_call(),
            max_callers=max_callers,
            waves=waves,
            warmup=warmup,
            max_tokens=max_tokens,
        )

    def _serving_host(self, name: str) -> Host:
        hosts = self.record.hosts(names=[name])
        if not hosts:
            raise KeyError(f"no such host: {name}")
        host = hosts[0]
        if host.state not in (HostState.READY, HostState.PROBING) or not host.api_url:
            raise KeyError(f"host {name} is {host.state}, not serving")
        return host

    async def _wait_running(self, host: Host) -> Instance:
        """Wait, on the shared listing, until the instance runs with its SSH and service ports mapped.

        Tolerated: not listed yet (vast.ai's reads lag create, up to timeouts.instance_visible) and a late
        heartbeat (`offline`/`unknown`, up to timeouts.heartbeat_gap). Fails fast on a container that
        cannot start, on a failed state, and on an instance that was listed and then is not."""
        assert host.instance_id is not None
        timeouts = self.settings.timeouts
        started = time.monotonic()
        deadline = started + timeouts.create_to_running
        seen = False
        lost_since: float | None = None
        generation = 0
        async with self.watch.watching(host.instance_id):
            while True:
                async with self.waits.on("market"):
                    snapshot = await self.watch.next(generation)
                generation = snapshot.generation
                now = time.monotonic()
                instance = snapshot.instances.get(host.instance_id)
                if instance is None:
                    if seen:
                        raise PhaseFailed("boot", "the instance disappeared while booting")
                    if now - started > timeouts.instance_visible:
                        raise PhaseFailed(
                            "boot",
                            f"not listed {timeouts.instance_visible:g}s after create (timeouts.instance_visible)",
                        )
                    continue
                if not seen:
                    seen = True
                    self._take_instance_price(host, instance)
                if instance.status == "running" and instance.ssh_endpoint() and instance.service_endpoint(SERVICE_PORT):
                    return instance
                if error := instance.boot_error():
                    raise PhaseFailed("boot", f"the container cannot start: {error}")
                if instance.status in FAILED:
                    raise PhaseFailed("boot", f"instance is {instance.status}: {instance.status_msg or 'no message'}")
                if instance.status in HEARTBEAT_LOST:
                    lost_since = lost_since or now
                    if now - lost_since > timeouts.heartbeat_gap:
                        raise PhaseFailed(
                            "boot", f"{instance.status} for {timeouts.heartbeat_gap:g}s (timeouts.heartbeat_gap)"
                        )
                else:
                    lost_since = None
                if now >= deadline:
                    raise PhaseFailed(
                        "boot",
                        f"still {instance.status or 'provisioning'} after {timeouts.create_to_running:g}s "
                        "(timeouts.create_to_running)",
                    )

    def _take_instance_price(self, host: Host, instance: Instance) -> None:
        """Record what the instance really costs: vast.ai's price can differ from the offer's searched one."""
        if instance.dph_total <= 0 or abs(instance.dph_total - host.dph_total) < 1e-9:
            return
        self.record.event(
            "info",
            "price",
            json.dumps({"offer_dph_total": host.dph_total, "instance_dph_total": instance.dph_total}),
            host.id,
        )
        self.reporter.info(
            host.name, f"the instance costs ${instance.dph_total:.4f}/h (the offer said ${host.dph_total:.4f}/h)"
        )
        self.record.update(
            host,
            dph_total=instance.dph_total,
            effective_usd_per_hour=host.effective_usd_per_hour - host.dph_total + instance.dph_total,
        )

    def _end_attempt(self, host: Host, phase: str | None, reason: str | None, state: HostState) -> None:
        assert host.id is not None
        self.record.close_attempt(host.id, "ready" if state == HostState.READY else "failed", phase, reason)
        if state != HostState.READY:
            changes: dict[str, Any] = {"state": state, "failed_phase": phase, "failure_reason": reason}
            if state == HostState.DESTROYED:
                changes.update(destroyed_at=utcnow(), accrued_usd=0.0)
            self.record.update(host, **changes)

    async def _fail(self, host: Host, phase: str, reason: str, blacklist: bool) -> None:
        """Destroy what this attempt created, blacklist the machine, record why."""
        self.record.event("error", "phase", json.dumps({"phase": phase, "reason": reason}), host.id)
        self.record.update(host, state=HostState.FAILED, failed_phase=phase, failure_reason=reason)
        if blacklist:
            self.blacklist_machine(host, phase, reason)
        assert host.id is not None
        self.record.close_attempt(host.id, "failed", phase, reason)
        if host.destroyed_at is not None:
            return  # already destroyed (and confirmed gone) on the way here
        if host.instance_id is not None:
            await self._destroy_instance(host, final_state=HostState.FAILED)
        else:
            self.record.update(host, destroyed_at=utcnow(), accrued_usd=0.0)

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
        """After a create whose answer we did not get: find the instance by our label and destroy it. vast.ai's
        reads lag its create, so an empty answer is asked again until timeouts.instance_visible has passed."""
        deadline = time.monotonic() + self.settings.timeouts.instance_visible
        while True:
            async with self.waits.on("market"):
                strays = [i for i in await self.market.list(host.label) if i.label == host.label]
            for instance in strays:
                self.record.update(host, instance_id=instance.id)
                await self._destroy_instance(host, final_state=HostState.FAILED)
            if strays or time.monotonic() >= deadline:
                return
            await asyncio.sleep(2.0)

    # ---- destroy ----------------------------------------------------------------------------
    async def _destroy_instance(
        self, host: Host, final_state: HostState = HostState.DESTROYED, confirm_timeout_s: float = 60.0
    ) -> None:
        assert host.instance_id is not None
        self.record.event("intent", "destroy", json.dumps({"instance_id": host.instance_id}), host.id)
        if final_state == HostState.DESTROYED:
            self.record.update(host, state=HostState.DESTROYING)
        async with self.waits.on("market"):
            await self.market.destroy(host.instance_id)
            deadline = time.monotonic() + confirm_timeout_s
            while await self.market.get(host.instance_id) is not None:
                if time.monotonic() > deadline:
                    raise MarketError(f"instance {host.instance_id} still listed {confirm_timeout_s:g}s after destroy")
                await asyncio.sleep(1.0)
        now = utcnow()
        self.record.update(host, state=final_state, destroyed_at=now, accrued_usd=accrued_usd(host, now))
        self.publish_endpoints()
        self.record.event("answer", "destroy", json.dumps({"instance_id": host.instance_id, "gone": True}), host.id)
        self.reporter.info(host.name, f"instance {host.instance_id} destroyed; cost ${host.accrued_usd:.4f}")

    async def destroy(self, names: list[str] | None) -> list[Host]:
        """Destroy the named hosts (None: every live host). Idempotent; confirms each is gone."""
        if names is None:
            targets = self.record.hosts(states=(*LIVE_STATES, HostState.FAILED))
            targets = [h for h in targets if h.destroyed_at is None]
        else:
            targets = self.record.hosts(names=names)
            unknown = sorted(set(names) - {h.name for h in targets})
            if unknown:
                raise KeyError(f"no such host: {', '.join(unknown)}")
        done = []
        for host in targets:
            if host.destroyed_at is not None or host.instance_id is None:
                if host.destroyed_at is None:
                    self.record.update(host, state=HostState.DESTROYED, destroyed_at=utcnow(), accrued_usd=0.0)
                done.append(host)
                continue
            await self._destroy_instance(host)
            done.append(host)
        self.publish_endpoints()
        return done

    # ---- status and reconcile ----------------------------------------------------------------
    def status(self, include_ended: bool = False) -> list[dict[str, Any]]:
        hosts = self.record.hosts() if include_ended else self.record.hosts(states=LIVE_STATES)
        return [host_summary(h) for h in hosts]

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
        """Look every recorded host up (one listing, then show for those it lacks); finish interrupted work;
        destroy strays with our label."""
        report: dict[str, Any] = {"checked": 0, "gone": [], "failed": [], "strays_destroyed": [], "adopted": []}
        live = self.record.hosts(states=LIVE_STATES)
        async with self.waits.on("market"):
            listing = await self.market.list(LABEL_PREFIX)
        by_id = {i.id: i for i in listing}
        by_label = {i.label: i for i in listing}
        unlisted_but_there = 0
        for host in live:
            report["checked"] += 1
            # vast.ai's reads lag create: an instance never yet seen running may simply not be listed yet.
            young = host.running_at is None and _age_s(host) < self.settings.timeouts.instance_visible
            if host.instance_id is None:
                instance = by_label.get(host.label)
                if instance is None:
                    if young:
                        continue
                    self.record.update(
                        host,
                        state=HostState.DESTROYED,
                        destroyed_at=utcnow(),
                        accrued_usd=0.0,
                        failure_reason="create was interrupted and bought nothing",
                    )
                    report["gone"].append(host.name)
                    continue
                self.record.update(host, instance_id=instance.id)
                report["adopted"].append(host.name)
            assert host.instance_id is not None
            instance = by_id.get(host.instance_id)
            if instance is None:
                if young:
                    continue
                async with self.waits.on("market"):
                    instance = await self.market.get(host.instance_id)
                if instance is not None:
                    unlisted_but_there += 1
            if instance is None:
                now = utcnow()
                self.record.update(
                    host,
                    state=HostState.DESTROYED,
                    destroyed_at=now,
                    accrued_usd=accrued_usd(host, now),
                    failure_reason="instance gone at reconcile",
                )
                self.record.event("info", "reconcile", "instance gone", host.id)
                report["gone"].append(host.name)
                continue
            interrupted = host.state not in (HostState.READY,)
            if instance.status in FAILED or interrupted:
                reason = (
                    f"instance {instance.status}"
                    if instance.status in FAILED
                    else f"bring-up interrupted in {host.state}"
                )
                await self._fail(host, host.state, reason, blacklist=instance.status in FAILED)
                report["failed"].append(host.name)
        if unlisted_but_there:
            raise MarketError(
                f"the instance listing lacks {unlisted_but_there} instance(s) that show finds; not sweeping strays"
            )
        known = {h.instance_id for h in self.record.hosts() if h.instance_id is not None}
        for instance in listing:
            if instance.id not in known:
                async with self.waits.on("market"):
                    await self.market.destroy(instance.id)
                self.record.event(
                    "info", "reconcile", json.dumps({"stray_destroyed": instance.id, "label": instance.label})
                )
                report["strays_destroyed"].append(instance.id)
        self.publish_endpoints()
        return report


def _age_s(host: Host) -> float:
    created = host.created_at if host.created_at.tzinfo else host.created_at.replace(tzinfo=UTC)
    return (utcnow() - created).total_seconds()


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
