"""The gateway's verbs over a Context: start (HAProxy for every [[serve]] target, then the record applied),
stop, keep (the daemon's beat: restart a wanted gateway that died, apply the record), status, agent keys.

A gateway `start` made is wanted until `stop`: the daemon restarts it if HAProxy dies, and every change a
fleet process on this machine makes to the hosts is applied at once (app.py hangs `apply` on the Context)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

from fleet.context import Context, tls_dir
from fleet.core.apikeys import access_log_key, cache_salt_key
from fleet.core.config import Settings
from fleet.core.errors import BadInput
from fleet.core.files import write_private, write_public
from fleet.core.gatewayrecord import add_agent_key, agent_keys, revoke_agent_key
from fleet.core.gatewaysettings import PEER_NAME
from fleet.core.models import Host
from fleet.core.tls import HOSTS_DOMAIN, load_certificate, sign_peer
from fleet.gateway import acme, process
from fleet.gateway.files import CERTIFICATE_DAYS, GatewayCa, GatewayFiles, certificates, files_for
from fleet.gateway.observed import NOTHING_OBSERVED, SlotObserved
from fleet.gateway.runtime import Runtime
from fleet.gateway.sync import SyncReport, sync
from fleet.gateway.targets import Target, targets
from fleet.host.endpoints import publish_endpoints


def _files(ctx: Context) -> GatewayFiles:
    return files_for(ctx.settings)


def _ca(ctx: Context) -> GatewayCa:
    return GatewayCa(ctx.ca_file, lambda: ctx.ca)  # the key only where a certificate must be signed here


def _wanted(files: GatewayFiles) -> bool:
    return (files.directory / "wanted").exists()


def _targets(ctx: Context) -> list[Target]:
    found = targets(ctx.settings)
    if not found:
        raise BadInput(
            f"{ctx.settings.source}: no [[serve]] table: the gateway serves one endpoint per target (model, region)"
        )
    return found


def serves(ctx: Context, host: Host) -> bool:
    """Whether this machine's gateway is wanted and has a target for the host's model and region: the agents'
    door to it, so that no agent needs the host's own key."""
    return _wanted(_files(ctx)) and any((t.model, t.region) == (host.model, host.region) for t in targets(ctx.settings))


def hang(ctx: Context) -> None:
    """This machine's gateway follows every change a process makes to the hosts, and is the agents' door to
    the hosts it serves."""
    ctx.on_hosts_changed.append(apply)
    ctx.gateway_serves = lambda host: serves(ctx, host)


def peer_certificate(ctx: Context, name: str, out: Path) -> dict[str, str]:
    """A gateway peer's certificate and key for `name`, signed here by fleet's CA and written to `out` (the key
    0600): what a gateway's machine without the CA key sets as gateway.peer_certificate_file and peer_key_file."""
    if not re.fullmatch(PEER_NAME, name):
        raise BadInput(f"{name[:80]!r}: a peer's name is letters, digits, _ . - (at most 63)")
    if out.exists() and not out.is_dir():
        raise BadInput(f"{out}: not a folder")
    certificate_path, key_path = out / f"{name}.peer.pem", out / f"{name}.peer.key"
    taken = [str(p) for p in (certificate_path, key_path) if p.exists()]
    if taken:
        raise BadInput(f"{taken[0]} exists: remove it first, or write elsewhere")
    key, certificate = sign_peer(ctx.ca, name, CERTIFICATE_DAYS)
    write_private(key_path, key)
    write_public(certificate_path, certificate)
    return {"name": name, "certificate_file": str(certificate_path), "key_file": str(key_path)}


async def _start(ctx: Context, files: GatewayFiles, found: list[Target]) -> int:
    """HAProxy started for these targets, with the access log's key for calls' names and the agents' cache salts'
    key derived from fleet's secret."""
    secret = ctx.key_secret
    return await process.start(files, ctx.settings, found, _ca(ctx), access_log_key(secret), cache_salt_key(secret))


async def start(ctx: Context) -> dict[str, Any]:
    files = _files(ctx)
    found = _targets(ctx)
    running = process.running_pid(files)
    pid = await _start(ctx, files, found)
    try:
        report = await sync(ctx, files, found)
        if ctx.settings.gateway.acme.domain:
            await renew(ctx)  # HAProxy runs on a provisional certificate until the ACME CA gives the domain's
    except BaseException:
        if running is None:  # what this call started does not outlive its failure
            await process.stop(files)
        raise
    (files.directory / "wanted").touch()
    publish_endpoints(ctx)  # the hosts it serves leave their keys out of the endpoints file
    _record(ctx, "start", {"pid": pid, "added": report.added})
    return await status(ctx)


async def stop(ctx: Context, grace_s: float = 0.0) -> int | None:
    """Stop the gateway (it is no longer wanted); the PID it stopped, or None."""
    files = _files(ctx)
    (files.directory / "wanted").unlink(missing_ok=True)
    pid = await process.stop(files, grace_s)
    publish_endpoints(ctx)  # agents go to the hosts themselves again: their keys back in the endpoints file
    if pid is not None:
        _record(ctx, "stop", {"pid": pid})
    return pid


async def apply(ctx: Context) -> SyncReport | None:
    """The record applied to this machine's gateway, if one runs (after any change to the hosts)."""
    files = _files(ctx)
    if not ctx.settings.serve or process.running_pid(files) is None:
        return None
    report = await sync(ctx, files, targets(ctx.settings))
    if report.changed:
        _record(ctx, "sync", {"added": report.added, "removed": report.removed})
    return report


async def keep(ctx: Context) -> SyncReport | None:
    """The daemon's beat: a wanted gateway whose HAProxy died is started again, then the record applied."""
    files = _files(ctx)
    if not _wanted(files) or not ctx.settings.serve:
        return None
    if process.running_pid(files) is None:
        pid = await _start(ctx, files, targets(ctx.settings))
        _record(ctx, "restart", {"pid": pid})
        ctx.reporter.info("gateway", f"HAProxy was not running: started again (pid {pid})")
        return await apply(ctx)
    # the record first: a renewal the CA refuses must not hold back a revoked key, a drain or a new host
    report = await apply(ctx)
    try:
        await renew(ctx)
    except acme.AcmeError as e:
        _record(ctx, "renew-refused", {"error": str(e)[:300]})
        ctx.reporter.info("gateway", f"{e}; the certificate it serves stays until the next try")
    return report


async def renew(ctx: Context) -> list[str]:
    """The gateway's certificates renewed in place where they near their end (or were replaced on disk): the
    running HAProxy takes the new ones through its admin socket. The files renewed."""
    files = _files(ctx)
    changed = certificates(files, ctx.settings, _ca(ctx))
    domain = ctx.settings.gateway.acme.domain
    if domain and process.running_pid(files) is not None:
        authority = load_certificate(_ca(ctx).certificate_path)
        now = time.time()
        if authority is not None and acme.due(files, domain, authority.subject) and acme.may_try(files, now):
            try:
                await acme.issue(files, ctx.settings)  # the CA checks the domain through the running HAProxy
            except acme.AcmeError as e:
                wait = acme.refused(files, now)
                raise acme.AcmeError(f"{e}; asked again in {wait:.0f}s at the earliest") from None
            acme.renewed(files)
            changed = [*changed, files.pem] if files.pem not in changed else changed
    if changed and process.running_pid(files) is not None:
        runtime = Runtime(files.socket)
        for path in changed:
            await runtime.replace_certificate(path, path.read_bytes())
        _record(ctx, "renew", {"certificates": [p.name for p in changed]})
        ctx.reporter.info("gateway", f"certificate(s) renewed in place: {', '.join(p.name for p in changed)}")
    return [str(p) for p in changed]


async def calls_on(ctx: Context, host: Host) -> int:
    """Calls on the host in this machine's gateway with a turn within gateway.call_idle_s (its slot's door
    counts them: the table's size is read, never its entries)."""
    files = _files(ctx)
    if host.gateway_slot is None or process.running_pid(files) is None:
        return 0
    used = await Runtime(files.socket).tables_used()
    return sum(
        used.get(target.slot_section(host.gateway_slot), 0)
        for target in targets(ctx.settings)
        if (target.model, target.region) == (host.model, host.region)
    )


async def wait_calls_end(ctx: Context, host: Host, deadline_s: float) -> int:
    """Wait until no call pinned to the draining host has a recent turn, or `deadline_s`; the calls left."""
    deadline = time.monotonic() + deadline_s
    while (left := await calls_on(ctx, host)) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    return left


def _record(ctx: Context, action: str, detail: dict[str, Any]) -> None:
    ctx.record.event("gateway", action, json.dumps(detail))


async def status(ctx: Context) -> dict[str, Any]:
    """The gateway as it runs: each target's URL and hosts (slot, state, streams now, the limit), its counts
    of new calls, turns and refusals (or overflows), and the agents' keys."""
    files = _files(ctx)
    pid = process.running_pid(files)
    signed_by = signer(ctx.settings)
    ca_file = str(tls_dir(ctx.settings) / "ca.pem") if signed_by == "fleet" else None
    return {
        "running": pid is not None,
        "pid": pid,
        "wanted": _wanted(files),
        "directory": str(files.directory),
        # who signs the agents' door, and the CA file an agent verifies it with (None: its own trust store, or
        # the team's CA): read, never made here, status starts nothing
        "signed_by": signed_by,
        "ca_file": ca_file,
        "tls_check": tls_check(ctx.settings, ca_file),
        "agents": [k.name for k in agent_keys(ctx.record)],
        "targets": await targets_now(ctx.settings),
    }


def signer(settings: Settings) -> str:
    """Who signs the agents' door's certificate: "acme" (a CA every client trusts), "own" (the team's
    certificate_file) or "fleet" (fleet's CA, whose file an agent is given)."""
    g = settings.gateway
    return "acme" if g.acme.domain else "own" if g.certificate_file else "fleet"


def door_host(settings: Settings) -> str:
    """The name agents reach the gateway by, which its certificate holds: the ACME domain; else the first of
    `gateway.names`; else `localhost` for a loopback or every-interface listen, the listen address otherwise."""
    g = settings.gateway
    if g.acme.domain:
        return g.acme.domain
    if g.names:
        return f"[{g.names[0]}]" if ":" in g.names[0] else g.names[0]
    if g.listen in ("127.0.0.1", "0.0.0.0", "::", "::1"):
        return "localhost"
    return f"[{g.listen}]" if ":" in g.listen else g.listen


def tls_check(settings: Settings, ca_file: str | None) -> str:
    """A command a user runs to see whether a client trusts the gateway's first door as an agent must (`ok`, or
    the verification error): what pipecat's "Connection error." hides."""
    host = door_host(settings).strip("[]")
    port = next((t.port for t in targets(settings)), settings.gateway.port)
    trust = f"cafile={ca_file!r}" if ca_file else ""
    return (
        f'python3 -c "import ssl,socket; c=ssl.create_default_context({trust}); '
        f"c.wrap_socket(socket.create_connection(({host!r},{port})),server_hostname={host!r}).close(); print('ok')\""
    )


async def targets_now(settings: Settings) -> list[dict[str, Any]]:
    """Each target as this machine's gateway holds it now (no host and no count when it does not run): what
    `status` shows and the daemon's metrics export. Reads the record not at all."""
    files = files_for(settings)
    rows: list[dict[str, str]] = []
    names: dict[str, str] = {}
    seen: dict[tuple[str, int], SlotObserved] = {}
    runtime = Runtime(files.socket)
    running = process.running_pid(files) is not None
    if running:
        rows = await runtime.stats()
        names = await runtime.map_entries(files.name_map)
        seen = {(o.backend, o.slot): o for o in await runtime.observed()}
    host = door_host(settings)
    out = []
    for target in targets(settings):
        entry: dict[str, Any] = {
            "model": target.model,
            "region": target.region,
            "alias": target.alias,
            "base_url": f"https://{host}:{target.port}/v1",
            "hosts": [],
            "calls": {},
        }
        for row in rows:
            door = row.get("pxname") == target.backend and row.get("svname", "").startswith("s")
            if door and row.get("status") != "MAINT":
                slot = int(row["svname"][1:])
                observed = seen.get((target.backend, slot))
                shown = names.get(target.slot_section(slot), "").removesuffix(f".{HOSTS_DOMAIN}")
                entry["hosts"].append(_host_row(row, shown, observed))
        if running:
            counts = await runtime.table(f"counts_t{target.index}")
            entry["calls"] = {k: int(v.get("http_req_cnt", 0)) for k, v in counts.items()}
            overflow = [r for r in rows if r.get("pxname") == f"overflow_t{target.index}" and r["svname"] == "BACKEND"]
            if overflow:
                entry["calls"]["overflowed"] = int(overflow[0].get("stot") or 0)
        out.append(entry)
    return out


def line(status: dict[str, Any]) -> str:
    """The gateway in one line, for `fleet status`."""
    if not status["running"]:
        return "gateway: not running (`fleet gateway start`)" + (
            " - wanted: fleet daemon starts it" if status["wanted"] else ""
        )
    parts = []
    for t in status["targets"]:
        up = sum(1 for h in t["hosts"] if str(h["status"]).startswith(("UP", "DRAIN")))
        parts.append(f"{t['base_url']} ({t['model']} in {t['region']}, {up} host(s))")
    return f"gateway: {'; '.join(parts)}; {len(status['agents'])} agent key(s)"


def _host_row(row: dict[str, str], host: str, observed: SlotObserved | None) -> dict[str, Any]:
    """A host as its slot's door shows it, with what the agents felt there since it took the slot: first
    content (p50, p95 and the histogram the daemon exports) and the share of warm turns that hit its cache."""
    return {
        "slot": int(row["svname"][1:]),
        "host": host,
        "status": row.get("status"),
        "streams": int(row.get("scur") or 0),
        "limit": int(row.get("slim") or 0),
        # requests it served since it took the slot (HAProxy's own count is the slot's, over every host it held)
        "served": observed.answered if observed and observed.answered is not None else int(row.get("stot") or 0),
        **(observed.summary() if observed else NOTHING_OBSERVED),
    }


async def add_key(ctx: Context, name: str) -> str:
    """A new agent key (returned once: the record keeps its hash), taken by this machine's gateway at once."""
    key = add_agent_key(ctx.record, name)
    await apply(ctx)
    return key


def list_keys(ctx: Context) -> list[dict[str, Any]]:
    return [
        {
            "name": k.name,
            "created_at": k.created_at.isoformat(),
            "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None,
        }
        for k in agent_keys(ctx.record, include_revoked=True)
    ]


async def revoke_key(ctx: Context, name: str) -> int:
    revoked = revoke_agent_key(ctx.record, name)
    if not revoked:
        raise BadInput(f"no live key for agent {name!r} (`fleet gateway key list`)")
    await apply(ctx)  # refused at once by this machine's gateway; another machine's at its daemon's next beat
    return revoked
