"""Apply the desired state (targets.py) to a running HAProxy through its Runtime API, changing only what
differs: the agents' keys, and in each target's backend, slot by slot, the host its door holds (added
with its address, its certificate's name and its key; removed once gone), its limit and weight, and
whether it takes new calls (ready) or only finishes its own (drain)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from fleet.context import Context
from fleet.core.gatewayrecord import agent_keys
from fleet.gateway.files import GatewayFiles
from fleet.gateway.runtime import Runtime, ServerState, checked, refusal
from fleet.gateway.targets import Member, Target, members

WEIGHT_MAX = 256
POOL_PURGE = "50s"  # hosts keep an idle connection 60 s: the gateway is never the side that lets it go


@dataclass
class SyncReport:
    added: list[str] = field(default_factory=list)  # host names given a server
    removed: list[str] = field(default_factory=list)  # servers taken out (host gone, moved or restarted)
    draining: list[str] = field(default_factory=list)
    agents: int = 0
    left: list[str] = field(default_factory=list)  # servers that could not be removed yet (connections left)

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)


def server_name(member: Member) -> str:
    """The server's name in its slot: the host's, and its address, so that a host that moved (a standby host
    resumed elsewhere) or restarted with a new key is a new server."""
    return f"{member.host}.{hashlib.sha256(f'{member.address}:{member.port}'.encode()).hexdigest()[:8]}"


async def sync(ctx: Context, files: GatewayFiles, targets: list[Target]) -> SyncReport:
    runtime = Runtime(files.socket)
    report = SyncReport()
    await _agents(ctx, runtime, files, report)
    states: dict[str, list[ServerState]] = {}
    for server in await runtime.servers():
        states.setdefault(server.backend, []).append(server)
    host_keys = await runtime.map_entries(files.host_map)
    for target in targets:
        wanted = {m.slot: m for m in members(ctx, target)}
        slots = {s.name: s for s in states.get(target.backend, [])}
        for slot in range(ctx.settings.gateway.slots):
            await _slot(
                ctx, runtime, files, target, slot, wanted.get(slot), slots.get(f"s{slot}"),
                states.get(target.slot_section(slot), []), host_keys, report,
            )  # fmt: skip
    return report


async def _agents(ctx: Context, runtime: Runtime, files: GatewayFiles, report: SyncReport) -> None:
    desired = {k.sha256: k.name for k in agent_keys(ctx.record)}
    current = await runtime.map_entries(files.agent_map)
    for digest in current.keys() - desired.keys():
        await runtime.must(checked("del", "map", str(files.agent_map), digest))
    for digest in desired.keys() - current.keys():
        await runtime.must(checked("add", "map", str(files.agent_map), digest, desired[digest]))
    report.agents = len(desired)


async def _slot(
    ctx: Context,
    runtime: Runtime,
    files: GatewayFiles,
    target: Target,
    slot: int,
    member: Member | None,
    door: ServerState | None,
    inside: list[ServerState],
    host_keys: dict[str, str],
    report: SyncReport,
) -> None:
    section = target.slot_section(slot)
    front = f"{target.backend}/s{slot}"
    name = server_name(member) if member else None
    kept = None
    for server in inside:
        if server.name == name and not server.in_maintenance:
            kept = server
        elif await _remove(runtime, section, server):
            report.removed.append(server.name)
        else:
            report.left.append(server.name)
    if member is None:
        if door is not None and not door.in_maintenance:
            await runtime.must(checked("set", "server", front, "state", "maint"))
        if section in host_keys:
            await runtime.must(checked("del", "map", str(files.host_map), section))
        return
    if host_keys.get(section) != member.key:
        verb = "set" if section in host_keys else "add"
        await runtime.must(checked(verb, "map", str(files.host_map), section, member.key))
    if kept is None:
        await _add(ctx, runtime, section, member)
        report.added.append(member.host)
    calls = max(member.calls, 1)  # 0 would be no limit to HAProxy; a host measured at 0 drains instead
    await runtime.must(checked("set", "maxconn", "server", front, str(calls)))
    await runtime.must(checked("set", "weight", front, str(min(calls, WEIGHT_MAX))))
    want = "drain" if member.draining else "ready"
    if door is None or door.in_maintenance or bool(door.admin_state & 0x08) != member.draining:
        await runtime.must(checked("set", "server", front, "state", want))
    if member.draining:
        report.draining.append(member.host)


async def _add(ctx: Context, runtime: Runtime, section: str, member: Member) -> None:
    """The host's server in its door: TLS verified against fleet's CA and the name fleet signed for it, a
    health check every second, marked down at its first connection error (the request is retried on another
    host), idle connections kept past the patched server's 60 s."""
    g = ctx.settings.gateway
    server = f"{section}/{server_name(member)}"
    await runtime.must(
        checked(
            "add", "server", server, f"{member.address}:{member.port}",
            "ssl", "verify", "required", "ca-file", str(ctx.ca.certificate_path),
            "verifyhost", member.host, "sni", f"str({member.host})",
            "check", "inter", f"{int(g.check_every_s * 1000)}ms", "fall", "2", "rise", "2",
            "observe", "layer4", "error-limit", "1", "on-error", "mark-down",
            "pool-purge-delay", POOL_PURGE,
        )
    )  # fmt: skip
    await runtime.must(checked("enable", "health", server))
    await runtime.must(checked("set", "server", server, "state", "ready"))


async def _remove(runtime: Runtime, section: str, server: ServerState) -> bool:
    """Take a server out of its door: maintenance, its sessions shut, then deleted. False when HAProxy still
    holds connections to it (it stays in maintenance, and goes at a later sync)."""
    name = f"{section}/{server.name}"
    if not server.in_maintenance:
        await runtime.must(checked("set", "server", name, "state", "maint"))
    await runtime.run(checked("shutdown", "sessions", "server", name))
    (answer,) = await runtime.run(checked("del", "server", name))
    return refusal(answer) is None
