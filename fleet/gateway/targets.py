"""What the gateway should serve, derived from fleet.toml and the record: one target per [[serve]] table,
and in each target's backend one member per open host that serves it (READY, or DRAINING to finish its
calls), in the slot the record gave it, taking new calls up to the calls its latest bench held in conversation
and streams up to the speakers it held at once."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from fleet.context import Context
from fleet.core.config import Settings
from fleet.core.gatewayrecord import assign_slot
from fleet.core.models import BenchRun, Host, HostState, as_utc, utcnow
from fleet.economics.capacity import calls_held

SERVED = (HostState.READY, HostState.DRAINING)


@dataclass(frozen=True)
class Target:
    index: int
    model: str
    region: str
    alias: str  # the model name the agents send and /v1/models lists: the profile's
    port: int

    @property
    def backend(self) -> str:
        return f"calls_t{self.index}"

    def slot_section(self, slot: int) -> str:
        """The section that holds the host in `slot`: one host each, so that its key goes with it."""
        return f"{self.section_prefix}{slot}"

    @property
    def section_prefix(self) -> str:
        return f"host_t{self.index}_"


@dataclass(frozen=True)
class Member:
    slot: int
    host: str  # its name
    tls_name: str  # the name its certificate holds, which HAProxy sends as SNI and checks
    address: str
    port: int
    streams: int  # concurrent streams it takes: the speakers its bench held at the voice target, or its slots
    # calls pinned to it at once: the calls in conversation its bench held (within its slots); None until a bench
    # measured them, and a new call then takes a free stream
    calls: int | None
    draining: bool
    key: str = field(repr=False)  # the host's llama-server key: only HAProxy's memory holds it

    @property
    def server(self) -> str:
        return self.host


def held(host: Host) -> bool:
    """Held from new calls (a thermal re-probe waits for its calls to end): its door drains like a draining host's."""
    return host.held_until is not None and as_utc(host.held_until) > utcnow()


def targets(settings: Settings) -> list[Target]:
    return [
        Target(i, t.model, t.region, settings.profile(t.model).name, t.port or settings.gateway.port + i)
        for i, t in enumerate(settings.serve)
    ]


def address_of(api_url: str) -> tuple[str, int] | None:
    """The IP and port of a host's https:// URL; None for anything else (the record is not trusted blindly:
    what reaches HAProxy's configuration is an IP and a number)."""
    parts = urlsplit(api_url)
    try:
        ip = ipaddress.ip_address(parts.hostname or "")
        port = parts.port
    except ValueError:
        return None
    if parts.scheme != "https" or port is None:
        return None
    return str(ip), port


def members(ctx: Context, target: Target) -> list[Member]:
    """The target's hosts as the gateway should hold them now, each in its slot (given here on first sight)."""
    hosts = [
        h
        for h in ctx.record.hosts(states=SERVED, model=target.model, region=target.region)
        if h.api_url and address_of(h.api_url)
    ]
    benches = ctx.record.latest_bench([h.id for h in hosts if h.id is not None])
    out = []
    for host in sorted(hosts, key=lambda h: (h.gateway_slot is None, h.id or 0)):
        if host.gateway_slot is None and host.state != HostState.READY:
            continue  # a draining host that never had a slot has no call to finish here
        slot = assign_slot(ctx.record, host, ctx.settings.gateway.slots)
        out.append(_member(ctx, host, slot, benches.get(host.id) if host.id is not None else None))
    return out


def _member(ctx: Context, host: Host, slot: int, run: BenchRun | None) -> Member:
    address, port = address_of(host.api_url or "") or ("", 0)
    # a host holds at most the slots it was started with, whatever a bench of it recorded
    streams = host.slots if run is None else max(min(run.capacity, host.slots), 0)
    calls = None if run is None or run.calls_capacity is None else calls_held(run, host.slots)
    return Member(
        slot=slot,
        host=host.name,
        tls_name=host.tls_name or host.name,  # signed before names: its common name, which HAProxy then checks
        address=address,
        port=port,
        streams=streams,
        calls=calls,
        draining=host.state == HostState.DRAINING or streams <= 0 or held(host),
        key=ctx.api_key(host) or "",
    )
