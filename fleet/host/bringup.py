"""One host's bring-up as a table of phases: create, boot, connect, pull, start, probes.

Each phase names the state the host is in while it runs and the fleet.toml timeout that bounds it; the
runner moves the host into that state (compare-and-set: if another process moved it, this one stops),
runs the phase under its timeout and records a failure with the phase's name. The host is owned by this
process throughout (its lease renewed by the Fleet), so housekeeping elsewhere leaves it alone.

What a phase cannot do becomes PhaseFailed; what fails after the instance exists is destroyed by the
caller (Fleet._fail), whatever the exception.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import asyncssh
import httpx

from fleet import failpoints, hostops
from fleet.config import Profile, Timeouts
from fleet.hostops import PhaseFailed
from fleet.market import FAILED, HEARTBEAT_LOST, CreateFailed, Instance, InstanceSpec, MarketError, Offer, OfferGone
from fleet.models import Host, HostState, utcnow
from fleet.plan import card_problem
from fleet.probes import ProbeResult
from fleet.probes.thermal import sample_card
from fleet.remote import RemoteError, connect

if TYPE_CHECKING:
    from fleet.lifecycle import Fleet

# llama-server's port inside the host. An ordinary port: vast.ai maps it to a random external port on the
# public IP and lists that in the instance's `ports` (an identity port above 70000 is never listed there).
SERVICE_PORT = 18080
GRACE_S = 5.0  # a phase's own deadline fires first with its own words; this one is the backstop


class Preempted(PhaseFailed):
    """Another process moved the host out of the state this bring-up expected: it stops touching it."""

    def __init__(self, phase: str, state: str) -> None:
        super().__init__(phase, f"the host left {state} under another process; this bring-up stops", blacklist=False)


@dataclass(frozen=True)
class Phase:
    name: str  # recorded as the failed phase
    state: HostState  # the host's state while the phase runs
    timeout: str | None  # the key in [timeouts] that bounds it (None: create bounds itself)
    run: Callable[[BringUp], Awaitable[None]]


@dataclass
class BringUp:
    fleet: Fleet
    host: Host
    profile: Profile
    offer: Offer | None  # None when resuming a standby host: there is nothing to rent
    instance: Instance | None = None
    conn: asyncssh.SSHClientConnection | None = None
    files: dict[str, str] = field(default_factory=dict)
    results: list[ProbeResult] = field(default_factory=list)
    standby: bool = False  # for the standby pool: stopped once probed, STANDBY instead of READY
    resume: bool = False  # a standby host started again: no create, no download (the pull verifies), then READY

    async def run(self) -> None:
        """Every phase in order, then READY (or, for the standby pool, stopped and STANDBY). Raises PhaseFailed
        (or anything else) with the host as it was."""
        timeouts = self.fleet.settings.timeouts
        try:
            for phase in PHASES:
                if self.resume and phase.name == "create":
                    continue
                if self.host.state != phase.state and not self.fleet.record.transition(self.host, phase.state):
                    raise Preempted(phase.name, self.host.state)
                timeout = "standby_start" if self.resume and phase.name == "boot" else phase.timeout
                limit = getattr(timeouts, timeout) if timeout else None
                try:
                    async with asyncio.timeout(limit + GRACE_S if limit else None):
                        await phase.run(self)
                except TimeoutError:
                    raise PhaseFailed(phase.name, f"not done after {limit:g}s (timeouts.{timeout})") from None
                except (asyncssh.Error, OSError, httpx.HTTPError, RemoteError) as e:
                    # the host went away under us (connection lost, reset, refused): this machine failed here
                    raise PhaseFailed(phase.name, f"{type(e).__name__}: {e}") from None
                failpoints.reach(f"after_{phase.name}")
        finally:
            if self.conn is not None:
                self.conn.close()
        if self.standby:
            await self.stop()
            return
        if not self.fleet.record.transition(
            self.host, HostState.READY, ready_at=utcnow(), owner=None, lease_until=None
        ):
            raise Preempted("probes", self.host.state)

    async def stop(self) -> None:
        """The probed host is stopped for the standby pool: its GPU goes back, its disk and the verified
        weights on it stay (billed at the disk's price). STANDBY once the marketplace reads it `stopped`."""
        assert self.host.instance_id is not None
        if not self.fleet.record.transition(self.host, HostState.STOPPING):
            raise Preempted("stop", self.host.state)
        limit = self.fleet.settings.timeouts.stop
        try:
            async with asyncio.timeout(limit):
                async with self.fleet.waits.on("market"):
                    await self.fleet.market.stop(self.host.instance_id)
                failpoints.reach("mid_stop")
                await wait_stopped(self.fleet, self.host)
        except TimeoutError:
            raise PhaseFailed("stop", f"not stopped after {limit:g}s (timeouts.stop)") from None
        except MarketError as e:
            raise PhaseFailed("stop", str(e)) from None
        if not self.fleet.record.transition(
            self.host, HostState.STANDBY, stopped_at=utcnow(), owner=None, lease_until=None
        ):
            raise Preempted("stop", self.host.state)

    # ---- the phases ------------------------------------------------------------------------------
    async def create(self) -> None:
        fleet, host, offer = self.fleet, self.host, self.offer
        assert offer is not None
        spec = InstanceSpec(
            image=fleet.settings.provider.image,
            disk_gb=self.profile.disk_gb,
            label=host.label,
            env={},
            ports=[SERVICE_PORT],
        )
        fleet.reporter.info(
            host.name, f"renting offer {offer.id} ({offer.gpu_name}, {offer.geolocation}, ${offer.dph_total:.4f}/h)"
        )

        def sent() -> None:
            fleet.record.update(host, create_sent_at=utcnow())
            failpoints.reach("create_sent")

        try:
            async with fleet.waits.on("market"):
                instance_id = await fleet.market.create(offer.id, spec, on_sent=sent)
        except OfferGone:
            fleet.record.event("answer", "create", "offer gone", host.id)
            raise
        except CreateFailed as e:
            # vast.ai may have made the contract despite the error: destroy what it names, or what carries
            # our label once its reads catch up. The machine did nothing wrong: next offer, no blacklist.
            fleet.record.event(
                "answer", "create", json.dumps({"error": str(e), "new_contract": e.new_contract}), host.id
            )
            if e.new_contract is not None:
                fleet.record.update(host, instance_id=e.new_contract)
            raise PhaseFailed("create", str(e), blacklist=False) from None
        except MarketError as e:
            # The create may have been processed: Fleet._fail looks for our label, so nothing is left billing.
            fleet.record.event("answer", "create", f"error: {e}", host.id)
            raise PhaseFailed("create", f"{type(e).__name__}: {e}", blacklist=False) from None
        failpoints.reach("create_answered")  # bought, and the id not yet recorded: only the label knows it
        fleet.record.update(host, instance_id=instance_id)
        fleet.record.event("answer", "create", json.dumps({"instance_id": instance_id}), host.id)
        fleet.reporter.info(host.name, f"instance {instance_id} created; waiting for it to run")

    async def boot(self) -> None:
        self.instance = await wait_running(self.fleet, self.host, resuming=self.resume)
        self.fleet.record.update(self.host, running_at=utcnow())

    async def connect(self) -> None:
        assert self.instance is not None
        endpoint = self.instance.ssh_endpoint()
        if endpoint is None or self.instance.service_endpoint(SERVICE_PORT) is None:
            raise PhaseFailed("boot", f"running without an SSH endpoint or a mapping of port {SERVICE_PORT}")
        try:
            async with self.fleet.waits.on("ssh"):
                self.conn, host_key = await connect(
                    endpoint[0], endpoint[1], self.fleet.ssh_key, None, self.fleet.settings.timeouts.ssh
                )
        except RemoteError as e:
            raise PhaseFailed("connect", str(e)) from None
        self.fleet.record.update(
            self.host, ssh_host=endpoint[0], ssh_port=endpoint[1], host_key=host_key, connected_at=utcnow()
        )
        self.fleet.reporter.info(self.host.name, f"SSH {endpoint[0]}:{endpoint[1]} (host key pinned); pulling weights")

    async def pull(self) -> None:
        assert self.conn is not None
        fleet, host = self.fleet, self.host
        first_progress = [True]
        sizes: dict[str, int] = {}

        def progress(name: str, done: int, total: int) -> None:
            sizes[name] = total
            if first_progress[0] and done:
                first_progress[0] = False
                failpoints.reach("mid_pull")
            fleet.reporter.progress(host.name, name, done, total)

        if self.resume:
            async with fleet.waits.on("pull"):
                token = os.environ.get(fleet.settings.hub.token_env, "")
                self.files = await hostops.kept_files(self.conn, self.profile, fleet.hub_url, token)
            return
        async with fleet.waits.on("pull"):
            self.files = await hostops.pull_files(
                self.conn,
                self.profile,
                fleet.hub_url,
                os.environ.get(fleet.settings.hub.token_env, ""),
                fleet.settings.up.pull_connections,
                fleet.settings.timeouts.pull,
                progress,
                fleet.settings.timeouts.pull_stall,
            )
        fleet.record.update(host, pulled_at=utcnow(), pulled_bytes=sum(sizes.values()))

    async def start(self) -> None:
        assert self.conn is not None and self.instance is not None
        service = self.instance.service_endpoint(SERVICE_PORT)
        assert service is not None
        api_key = secrets.token_urlsafe(32)
        api_url = f"http://{service[0]}:{service[1]}"
        async with self.fleet.waits.on("server"):
            await hostops.start_server(
                self.conn,
                self.profile,
                SERVICE_PORT,
                self.files,
                api_key,
                api_url,
                self.fleet.settings.timeouts.load,
                await self.fleet.chat_template(self.profile) if self.profile.chat_template else None,
            )
        self.fleet.record.update(self.host, api_url=api_url, api_key=api_key, started_at=utcnow())
        await self.check_card()

    async def check_card(self) -> None:
        """With llama-server loaded, the host's card by nvidia-smi against the plan; a host without one
        (the local cloud on a CPU) is left alone. The reading is recorded as an event."""
        samples = await sample_card(self.conn)
        if not samples:
            return
        total = sum(s.mem_total_mib or 0 for s in samples)
        used = sum(s.mem_used_mib or 0 for s in samples)
        names = ", ".join(sorted({s.name or "unknown" for s in samples}))
        self.fleet.record.event("card", "loaded", f"{names}: {used:.0f} of {total:.0f} MiB in use", self.host.id)
        problem = card_problem(await self.fleet.plan(self.profile.name), total, used)
        if problem:
            raise PhaseFailed("start", problem)

    async def probe(self) -> None:
        names = list(self.profile.probes.on_up)
        self.fleet.reporter.info(self.host.name, f"llama-server up at {self.host.api_url}; probing: {', '.join(names)}")
        results = await self.fleet._probe(
            self.host, self.profile, names, self.conn, self.fleet.settings.timeouts.probes
        )
        failed = [r for r in results if not r.passed]
        if failed:
            # keep-alive and the prompt cache are the server build's, the template's and the flags' doing:
            # no other machine would pass them, and this one is not to blame
            software = all(r.name in SOFTWARE_PROBES for r in failed)
            reason = "; ".join(f"{r.name}: {r.diagnosis}" for r in failed)
            raise PhaseFailed(
                "probes",
                reason + (" (the same on every machine: fix the image or the profile)" if software else ""),
                blacklist=not software,
                retry=not software,
            )


SOFTWARE_PROBES = frozenset({"cache", "keepalive"})

PHASES: tuple[Phase, ...] = (
    Phase("create", HostState.CREATING, None, BringUp.create),
    Phase("boot", HostState.BOOTING, "create_to_running", BringUp.boot),
    Phase("connect", HostState.CONNECTING, "ssh", BringUp.connect),
    Phase("pull", HostState.PULLING, "pull", BringUp.pull),
    Phase("start", HostState.STARTING, "load", BringUp.start),
    Phase("probes", HostState.PROBING, "probes", BringUp.probe),
)


async def wait_stopped(fleet: Fleet, host: Host) -> None:
    """Wait, on the shared listing, until the instance reads `stopped` (the caller bounds the wait)."""
    assert host.instance_id is not None
    generation = 0
    async with fleet.watch.watching(host.instance_id):
        while True:
            async with fleet.waits.on("market"):
                snapshot = await fleet.watch.next(generation)
            generation = snapshot.generation
            instance = snapshot.instances.get(host.instance_id)
            if instance is not None and instance.status == "stopped":
                return
            if instance is not None and instance.status in ("exited", "frozen"):
                raise PhaseFailed("stop", f"instance is {instance.status}: {instance.status_msg or 'no message'}")


async def wait_running(fleet: Fleet, host: Host, resuming: bool = False) -> Instance:
    """Wait, on the shared listing, until the instance runs with its SSH and service ports mapped.

    Tolerated: not listed yet (vast.ai's reads lag create, up to timeouts.instance_visible) and a late
    heartbeat (`offline`/`unknown`, up to timeouts.heartbeat_gap). Fails fast on a container that cannot
    start, on a failed state, and on an instance that was listed and then is not. `resuming`: a standby
    instance just asked to start, which may still read `stopped` and then wait in `scheduling` for its
    machine's GPU: bounded by timeouts.standby_start instead."""
    assert host.instance_id is not None
    timeouts: Timeouts = fleet.settings.timeouts
    started = time.monotonic()
    bound = "standby_start" if resuming else "create_to_running"
    deadline = started + getattr(timeouts, bound)
    seen = False
    lost_since: float | None = None
    generation = 0
    async with fleet.watch.watching(host.instance_id):
        while True:
            async with fleet.waits.on("market"):
                snapshot = await fleet.watch.next(generation)
            generation = snapshot.generation
            now = time.monotonic()
            instance = snapshot.instances.get(host.instance_id)
            if instance is None:
                if seen:
                    raise PhaseFailed("boot", "the instance disappeared while booting")
                if now - started > timeouts.instance_visible:
                    raise PhaseFailed(
                        "boot", f"not listed {timeouts.instance_visible:g}s after create (timeouts.instance_visible)"
                    )
                continue
            if not seen:
                seen = True
                take_instance_price(fleet, host, instance)
            if instance.status == "running" and instance.ssh_endpoint() and instance.service_endpoint(SERVICE_PORT):
                return instance
            if error := instance.boot_error():
                raise PhaseFailed("boot", f"the container cannot start: {error}")
            if instance.status in FAILED and not (resuming and instance.status == "stopped"):
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
                    f"still {instance.status or 'provisioning'} after {getattr(timeouts, bound):g}s (timeouts.{bound})",
                )


def take_instance_price(fleet: Fleet, host: Host, instance: Instance) -> None:
    """Record what the instance really costs: vast.ai's price can differ from the offer's searched one."""
    if instance.dph_total <= 0 or abs(instance.dph_total - host.dph_total) < 1e-9:
        return
    fleet.record.event(
        "info",
        "price",
        json.dumps({"offer_dph_total": host.dph_total, "instance_dph_total": instance.dph_total}),
        host.id,
    )
    fleet.reporter.info(
        host.name, f"the instance costs ${instance.dph_total:.4f}/h (the offer said ${host.dph_total:.4f}/h)"
    )
    fleet.record.update(
        host,
        dph_total=instance.dph_total,
        effective_usd_per_hour=host.effective_usd_per_hour - host.dph_total + instance.dph_total,
    )
