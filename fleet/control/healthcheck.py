"""Whether a READY host serves: the marketplace's view of its instance (one listing for every host), then its
server's /health and a short completion, and beside them its memory read over SSH. The health sweep
(fleet/control/rotation.py) judges and replaces; this module only looks."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import httpx

from fleet.context import Context
from fleet.core.models import Host
from fleet.engines import SERVICE_PORT
from fleet.host.measure import host_memory
from fleet.host.ops import HostMemory
from fleet.host.remote import HostKeyMismatch
from fleet.market import HEARTBEAT_LOST, Instance
from fleet.probes.server import bounded

HEALTH_REPLY_BYTES = 64 * 1024  # /health and a two-token completion are a few hundred bytes

Check = tuple[tuple[bool, bool, str], HostMemory | None]


async def checked_as_listed(ctx: Context, hosts: list[Host]) -> tuple[dict[int, Instance | None], list[Check]]:
    """Each host's instance from one listing, and each host checked (in the order given) as soon as the listing's
    page with its instance answers. At many hosts the listing is most of a sweep (25 instances a page, a page a
    second at vast.ai's limits): the hosts of the pages before are checked meanwhile, a page's worth at a time
    rather than every host's connections at once. Those the listing lacks are asked by id (gone, or a gap in the
    listing), then checked."""
    waiting: dict[int, list[int]] = {}  # instance id -> the places in `hosts` of the hosts on it
    for i, host in enumerate(hosts):
        if host.instance_id is not None:
            waiting.setdefault(host.instance_id, []).append(i)
    view: dict[int, Instance | None] = {}
    started: dict[int, asyncio.Task[Check]] = {}

    def start(places: list[int], instance: Instance | None) -> None:
        for i in places:
            started[i] = asyncio.get_running_loop().create_task(checked(ctx, hosts[i], instance))

    try:
        if waiting:
            async for page in ctx.market.instance_pages(list(waiting)):
                for instance_id, instance in page.items():
                    view[instance_id] = instance
                    start(waiting.pop(instance_id, []), instance)
        for instance_id in list(waiting):
            view[instance_id] = await ctx.market.get(instance_id)
            start(waiting.pop(instance_id), view[instance_id])
        # a READY host without an instance id: gone, as the marketplace has nothing of it
        start([i for i, h in enumerate(hosts) if h.instance_id is None], None)
        checks = await asyncio.gather(*(started[i] for i in range(len(hosts))))
    except BaseException:
        for task in started.values():
            task.cancel()
        await asyncio.gather(*started.values(), return_exceptions=True)
        raise
    return view, list(checks)


async def checked(ctx: Context, host: Host, instance: Instance | None) -> Check:
    """check_host and, beside it, the host's memory (what a growing prompt cache or a leak shows first), both
    within rotation.health_timeout_s. A host whose SSH key is not the pinned one is gone, whatever it serves."""
    if instance is None or instance.stopped or instance.down:
        return await check_host(ctx, host, instance), None
    timeout = ctx.settings.rotation.health_timeout_s
    check, memory = await asyncio.gather(
        check_host(ctx, host, instance), host_memory(ctx, host, timeout), return_exceptions=True
    )
    if isinstance(check, BaseException):
        raise check
    if isinstance(memory, HostKeyMismatch):
        ctx.record.event("error", "host_key", json.dumps({"error": str(memory)}), host.id)
        return (False, True, "its SSH host key is not the one pinned at first contact"), None
    if isinstance(memory, BaseException):
        raise memory
    return check, memory


ADDRESS_CHANGED = "its machine's public address changed"
# vast.ai stopping an instance (spent credit, an ended contract) and a dynamic address changing are not the
# machine's fault: its host is replaced, the machine not blacklisted
NOT_THE_MACHINES = ("vast.ai stopped", ADDRESS_CHANGED)


async def check_host(ctx: Context, host: Host, instance: Instance | None) -> tuple[bool, bool, str]:
    """(healthy, gone, reason): the marketplace's view (`instance`, None when it no longer shows it),
    /health, and a short completion. A late heartbeat (`offline`/`unknown`) is vast.ai's view of its own
    agent, not of our server: the server decides."""
    if instance is None:
        return False, True, "the instance is gone"
    if instance.stopped:
        return False, True, f"vast.ai stopped the instance: {instance.status_msg or 'no message'}"
    if instance.down:
        return False, True, f"the instance is {instance.status}"
    listed = instance.service_endpoint(SERVICE_PORT)
    recorded = urlsplit(host.api_url or "")
    if listed is None or (listed[0], listed[1]) != (recorded.hostname, recorded.port):
        if listed is not None and listed[1] == recorded.port:
            # the same mapping at another address: a dynamic IP changed under the host (static_ip false)
            return False, True, f"{ADDRESS_CHANGED}: now {listed[0][:60]}, was {recorded.hostname}"
        # a restarted instance's old port may be another renter's now: nothing more goes to this host
        where = f"{listed[0]}:{listed[1]}" if listed else "no address"
        return False, True, f"the marketplace now lists its server at {where[:80]}, not {recorded.netloc}"
    # The whole check within health_timeout_s and every answer bounded: a host that drips its answers one
    # byte a second (each read "in time") holds up neither the sweep nor the daemon; it is unhealthy.
    timeout = ctx.settings.rotation.health_timeout_s
    try:
        async with asyncio.timeout(timeout), ctx.server(host).client(timeout=timeout) as client:
            health = await bounded(client, "GET", "/health", deadline_s=timeout, max_bytes=HEALTH_REPLY_BYTES)
            if health.status_code != 200:
                return False, False, f"/health answered {health.status_code}"
            reply = await bounded(
                client,
                "POST",
                "/v1/chat/completions",
                deadline_s=timeout,
                max_bytes=HEALTH_REPLY_BYTES,
                json={"messages": [{"role": "user", "content": "ping"}], "max_tokens": 2},
            )
            if reply.status_code != 200:
                return False, False, f"completion answered {reply.status_code}"
    except TimeoutError:
        return False, False, f"no whole answer within {timeout:g}s (rotation.health_timeout_s)"
    except httpx.HTTPError as e:
        return False, False, f"{type(e).__name__}: {e}"
    if instance.status in HEARTBEAT_LOST:
        return True, False, f"ok (the marketplace reads it {instance.status})"
    return True, False, "ok"
