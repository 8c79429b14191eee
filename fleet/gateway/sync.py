"""Apply the desired state (targets.py) to a running HAProxy through its Runtime API, changing only what
differs: the agents' keys, and in each target's backend, slot by slot, the host its door holds (added
with its address, its certificate's name and its key; removed once gone), its streams limit and weight, the
calls it takes pinned at once, and whether it takes new calls (ready) or only finishes its own (drain)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleet.context import Context
from fleet.core.gatewayrecord import agent_keys
from fleet.gateway.files import GatewayFiles
from fleet.gateway.haproxy import REVOKED
from fleet.gateway.runtime import Runtime, ServerState, checked
from fleet.gateway.targets import Member, Target, members

WEIGHT_MAX = 256
DRAIN_FORCED = 0x08  # HAProxy's admin state bit of a server set to drain


@dataclass
class SyncReport:
    added: list[str] = field(default_factory=list)  # host names given a server
    removed: list[str] = field(default_factory=list)  # servers taken out (host gone, moved or restarted)
    agents: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)


async def sync(ctx: Context, files: GatewayFiles, targets: list[Target]) -> SyncReport:
    runtime = Runtime(files.socket)
    report = SyncReport()
    await _agents(ctx, runtime, files, report)
    states: dict[str, list[ServerState]] = {}
    for server in await runtime.servers():
        states.setdefault(server.backend, []).append(server)
    maps = Maps(
        await runtime.map_entries(files.host_map),
        await runtime.map_entries(files.name_map),
        await runtime.map_entries_if_loaded(files.calls_map),
    )
    for target in targets:
        wanted = {m.slot: m for m in members(ctx, target)}
        doors = {s.name: s for s in states.get(target.backend, [])}
        for slot in range(ctx.settings.gateway.slots):
            inside = next(iter(states.get(target.slot_section(slot), [])), None)
            await _slot(runtime, files, target, slot, wanted.get(slot), doors.get(f"s{slot}"), inside, maps, report)
    return report


@dataclass
class Maps:
    keys: dict[str, str]  # slot section -> its host's key
    names: dict[str, str]  # slot section -> its host's name
    calls: dict[str, str] | None  # a door (calls_tN/sS) -> the calls its host takes pinned; None: no such map


async def _agents(ctx: Context, runtime: Runtime, files: GatewayFiles, report: SyncReport) -> None:
    desired = {k.sha256: k.name for k in agent_keys(ctx.record)}
    current = await runtime.map_entries(files.agent_map)
    for digest in current.keys() - desired.keys():
        # revoked: marked first in the table the peers share (every gateway refuses it, and ends its streams, at
        # once), then out of this one's map
        await runtime.must(checked("set", "table", REVOKED, "key", digest, "data.gpc0", "1"))
        await runtime.must(checked("del", "map", str(files.agent_map), digest))
    for digest in desired.keys() - current.keys():
        await runtime.must(checked("add", "map", str(files.agent_map), digest, desired[digest]))
    report.agents = len(desired)


async def _slot(
    runtime: Runtime,
    files: GatewayFiles,
    target: Target,
    slot: int,
    member: Member | None,
    door: ServerState | None,
    inside: ServerState | None,
    maps: Maps,
    report: SyncReport,
) -> None:
    """One slot: the host it holds (name, address) made what the record says, then its door's limit, weight
    and state. A slot that changes hands is taken out first: its sessions shut, its calls re-placed."""
    section = target.slot_section(slot)
    front, server = f"{target.backend}/s{slot}", f"{section}/host"
    held = None
    if inside is not None and not inside.in_maintenance:
        held = (maps.names.get(section), inside.address, inside.port)
    wanted = (member.tls_name, member.address, member.port) if member is not None else None
    if held != wanted:
        if door is not None and not door.in_maintenance:
            await runtime.must(checked("set", "server", front, "state", "maint"))
            door = None
        if held is not None:
            await runtime.must(checked("set", "server", server, "state", "maint"))
            await runtime.run(checked("shutdown", "sessions", "server", server))
            report.removed.append(held[0] or section)
    if member is None:
        if door is not None and not door.in_maintenance:
            await runtime.must(checked("set", "server", front, "state", "maint"))
        for map_file, entries, key in (
            (files.host_map, maps.keys, section),
            (files.name_map, maps.names, section),
            (files.calls_map, maps.calls or {}, front),
        ):
            if key in entries:
                await runtime.must(checked("del", "map", str(map_file), key))
        return
    for map_file, entries, value in (
        (files.host_map, maps.keys, member.key),
        (files.name_map, maps.names, member.tls_name),
    ):
        if entries.get(section) != value:
            verb = "set" if section in entries else "add"
            await runtime.must(checked(verb, "map", str(map_file), section, value))
    if held != wanted:
        # observe.lua's counts start again for the new host (an HAProxy started by an older fleet has no such
        # command: it keeps serving, its counts unreset, until it is started again)
        await runtime.run(checked("fleet", "forget", target.backend, f"s{slot}"))
        await runtime.must(checked("clear", "table", section))  # the calls it counts are the old host's
        await runtime.must(checked("set", "server", server, "addr", member.address, "port", str(member.port)))
        await runtime.must(checked("set", "server", server, "state", "ready"))
        report.added.append(member.host)
    streams = max(member.streams, 1)  # 0 would be no limit to HAProxy; a host measured at 0 drains instead
    # limit and weight are set together: a door whose weight is the limit already holds it (every beat would
    # otherwise send both again), unless the limit is past what a weight can say
    if door is None or door.weight != min(streams, WEIGHT_MAX) or streams > WEIGHT_MAX:
        await runtime.must(checked("set", "maxconn", "server", front, str(streams)))
        await runtime.must(checked("set", "weight", front, str(min(streams, WEIGHT_MAX))))
    # the calls it takes pinned at once (admission.lua counts them against this; without it, a free stream)
    if maps.calls is not None:
        if member.calls is None and front in maps.calls:
            await runtime.must(checked("del", "map", str(files.calls_map), front))
        elif member.calls is not None and maps.calls.get(front) != str(member.calls):
            verb = "set" if front in maps.calls else "add"
            await runtime.must(checked(verb, "map", str(files.calls_map), front, str(member.calls)))
    if door is None or door.in_maintenance or bool(door.admin_state & DRAIN_FORCED) != member.draining:
        await runtime.must(checked("set", "server", front, "state", "drain" if member.draining else "ready"))
