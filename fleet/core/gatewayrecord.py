"""The gateway's rows: each open host's server slot in its target's backend, and the agents' keys, kept as
their SHA-256 alone (an agent key is 256 random bits: a hash of it cannot be guessed back)."""

from __future__ import annotations

import hashlib
import re
import secrets

from sqlalchemy import update as sql_update
from sqlalchemy.exc import IntegrityError
from sqlmodel import col, select

from fleet.core.errors import BadInput
from fleet.core.gatewaysettings import AGENT_NAME
from fleet.core.models import AgentKey, Host, utcnow
from fleet.core.record import Record, session

AGENT_KEY_PREFIX = "fa-"  # what tells an agent key apart in a leaked file or a log: fleet agent


class SlotsFull(BadInput):
    """Every slot of a target's backend holds an open host: raise gateway.slots."""


def key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def assign_slot(record: Record, host: Host, slots: int) -> int:
    """The host's slot, the lowest one no other open host of its model and region holds, given once and kept
    until the host closes. Two processes assigning at once: the unique index lets one win a slot, and the
    other takes the next."""
    if host.gateway_slot is not None:
        return host.gateway_slot
    with session(record.engine) as s:
        taken = set(
            s.exec(
                select(Host.gateway_slot).where(
                    Host.model == host.model,
                    Host.region == host.region,
                    col(Host.destroyed_at).is_(None),
                    col(Host.gateway_slot).is_not(None),
                )
            )
        )
    for slot in (n for n in range(slots) if n not in taken):
        try:
            with session(record.engine) as s:
                done = s.execute(
                    sql_update(Host)
                    .where(Host.id == host.id, col(Host.gateway_slot).is_(None))
                    .values(gateway_slot=slot)
                )
                s.commit()
        except IntegrityError:
            continue  # another host took it meanwhile
        if not done.rowcount:  # type: ignore[attr-defined]
            current = record.host(host.id) if host.id is not None else None
            slot = current.gateway_slot if current is not None and current.gateway_slot is not None else slot
        host.gateway_slot = slot
        return slot
    raise SlotsFull(f"{host.model} in {host.region}: all {slots} gateway slots hold open hosts (raise gateway.slots)")


def add_agent_key(record: Record, name: str) -> str:
    """A new key for the agent `name`, returned once; its hash is what the record keeps."""
    if not re.fullmatch(AGENT_NAME, name):
        raise BadInput(f"{name[:80]!r}: an agent's name is letters, digits and _ . @ - (at most 64)")
    if any(k.name == name for k in agent_keys(record)):
        raise BadInput(f"agent {name!r} has a key already: revoke it first, or name this one otherwise")
    key = AGENT_KEY_PREFIX + secrets.token_urlsafe(32)
    record.add(AgentKey(name=name, sha256=key_sha256(key)))
    return key


def agent_keys(record: Record, include_revoked: bool = False) -> list[AgentKey]:
    with session(record.engine) as s:
        q = select(AgentKey).order_by(col(AgentKey.id))
        if not include_revoked:
            q = q.where(col(AgentKey.revoked_at).is_(None))
        return list(s.exec(q))


def revoke_agent_key(record: Record, name: str) -> int:
    """Revoke the agent's live keys; how many."""
    with session(record.engine) as s:
        result = s.execute(
            sql_update(AgentKey)
            .where(AgentKey.name == name, col(AgentKey.revoked_at).is_(None))
            .values(revoked_at=utcnow())
        )
        s.commit()
        return int(result.rowcount or 0)  # type: ignore[attr-defined]
