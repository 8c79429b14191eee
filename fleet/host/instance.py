"""A host's instance at the marketplace: waiting, on the one listing every instance in flight shares, for it
to run (or to stop), and taking the price the instance really costs."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime

from fleet.context import Context
from fleet.core.config import Timeouts
from fleet.core.models import Host, as_utc, utcnow
from fleet.engines import SERVICE_PORT
from fleet.host.phase import DiskFull, PhaseFailed
from fleet.market import HEARTBEAT_LOST, Instance


def inside_read_lag(ctx: Context, create_sent_at: datetime | None) -> bool:
    """Whether a "no such instance" may still be the marketplace's lag: its reads, and its writes by id, may
    not know a new instance for timeouts.instance_visible after its create left. False when no create is known."""
    if create_sent_at is None:
        return False
    return (utcnow() - as_utc(create_sent_at)).total_seconds() < ctx.settings.timeouts.instance_visible


async def wait_stopped(ctx: Context, host: Host) -> None:
    """Wait, on the shared listing, until the instance reads stopped as asked (vast.ai shows it `exited` with
    `stopped` intended; the caller bounds the wait)."""
    assert host.instance_id is not None
    generation = 0
    async with ctx.watch.watching(host.instance_id):
        while True:
            async with ctx.waits.on("market"):
                snapshot = await ctx.watch.next(generation)
            generation = snapshot.generation
            instance = snapshot.instances.get(host.instance_id)
            if instance is None:
                continue
            if instance.stopped:
                return
            if instance.status == "frozen":
                raise PhaseFailed("stop", f"instance is frozen: {instance.status_msg or 'no message'}")


def image_pull_s(host: Host, timeouts: Timeouts) -> float:
    """How long a new instance's image may take to pull, at timeouts.pull_speed_share of the link its offer
    listed: the boot waits that long beyond timeouts.create_to_running (a big image on a slow link is no sign
    of a bad machine; a link slower than it listed is)."""
    if host.image_bytes <= 0 or host.inet_down_mbps <= 0:
        return 0.0
    return host.image_bytes / (host.inet_down_mbps * 1e6 / 8 * timeouts.pull_speed_share)


async def wait_running(ctx: Context, host: Host, resuming: bool = False) -> Instance:
    """Wait, on the shared listing, until the instance runs with its SSH and service ports mapped.

    Tolerated: not listed yet (vast.ai's reads lag create, up to timeouts.instance_visible) and a late
    heartbeat (`offline`/`unknown`, up to timeouts.heartbeat_gap). Fails fast on a container that cannot
    start, on an image that cannot be pulled (that one stops the bring-up: no machine would do better), on a
    start the platform gave up, on a failed state, and on an instance that was listed and then is not.
    `resuming`: a standby instance just asked to start, which may still read stopped and then wait in
    `scheduling` for its machine's GPU: bounded by timeouts.standby_start instead."""
    assert host.instance_id is not None
    timeouts: Timeouts = ctx.settings.timeouts
    started = time.monotonic()
    bound = "standby_start" if resuming else "create_to_running"
    limit = getattr(timeouts, bound) + (0.0 if resuming else image_pull_s(host, timeouts))
    deadline = started + limit
    seen = False
    status: str | None = None  # the instance's status at the last listing that showed it
    lost_since: float | None = None
    generation = 0

    def overdue() -> PhaseFailed:
        if not seen:
            return PhaseFailed(
                "boot", f"not listed {timeouts.instance_visible:g}s after create (timeouts.instance_visible)"
            )
        pull = "" if limit == getattr(timeouts, bound) else ", with the image's pull at the listed link"
        return PhaseFailed("boot", f"still {status or 'provisioning'} after {limit:.0f}s (timeouts.{bound}{pull})")

    async with ctx.watch.watching(host.instance_id):
        while True:
            # the deadline is kept while the next listing is awaited: on a slow or rate-limited marketplace the
            # listing may come after the phase's own backstop, which says only that the phase ran out of time
            wait_until = deadline if seen else started + timeouts.instance_visible
            try:
                async with ctx.waits.on("market"), asyncio.timeout(max(0.0, wait_until - time.monotonic())):
                    snapshot = await ctx.watch.next(generation)
            except TimeoutError:
                raise overdue() from None
            generation = snapshot.generation
            now = time.monotonic()
            instance = snapshot.instances.get(host.instance_id)
            if instance is None:
                if seen:
                    raise PhaseFailed("boot", "the instance disappeared while booting")
                if now - started > timeouts.instance_visible:
                    raise overdue()
                continue
            status = instance.status
            if not seen:
                seen = True
                take_instance_price(ctx, host, instance)
            if instance.status == "running" and instance.ssh_endpoint() and instance.service_endpoint(SERVICE_PORT):
                return instance
            if error := instance.disk_error():
                raise DiskFull(
                    "boot",
                    "the instance's disk does not hold the image (the profile's disk_gb may be too small, or the"
                    f" image larger than provider.image_gb or vllm_image_gb says): {error}",
                )
            if error := instance.image_error():
                # the same on every machine: our image's name, or its registry's login, is wrong
                raise PhaseFailed(
                    "boot",
                    f"the image {ctx.settings.provider.image} cannot be pulled or run here, nor on any machine like"
                    f" this one: {error}",
                    blacklist=False,
                    retry=False,
                )
            if error := instance.boot_error():
                raise PhaseFailed("boot", f"the container cannot start: {error}")
            if why := instance.abandoned():
                raise PhaseFailed("boot", f"vast.ai gave up starting it: {why}")
            if instance.down and not resuming:
                raise PhaseFailed("boot", f"instance is {instance.status}: {instance.status_msg or 'no message'}")
            # resuming: the instance reads stopped (exited) until the platform schedules its start
            if instance.status in HEARTBEAT_LOST:
                lost_since = lost_since or now
                if now - lost_since > timeouts.heartbeat_gap:
                    raise PhaseFailed(
                        "boot", f"{instance.status} for {timeouts.heartbeat_gap:g}s (timeouts.heartbeat_gap)"
                    )
            else:
                lost_since = None
            if now >= deadline:
                raise overdue()


def take_instance_price(ctx: Context, host: Host, instance: Instance) -> None:
    """Record what the instance really costs: vast.ai's price can differ from the offer's searched one."""
    if instance.dph_total <= 0 or abs(instance.dph_total - host.dph_total) < 1e-9:
        return
    ctx.record.event(
        "info",
        "price",
        json.dumps({"offer_dph_total": host.dph_total, "instance_dph_total": instance.dph_total}),
        host.id,
    )
    ctx.reporter.info(
        host.name, f"the instance costs ${instance.dph_total:.4f}/h (the offer said ${host.dph_total:.4f}/h)"
    )
    ctx.record.update(
        host,
        dph_total=instance.dph_total,
        effective_usd_per_hour=host.effective_usd_per_hour - host.dph_total + instance.dph_total,
    )
