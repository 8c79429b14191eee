"""The SQLite (or PostgreSQL) engine: private file, WAL, busy timeout, schema by alembic migrations."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import event, or_, text
from sqlalchemy import update as sql_update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, SQLModel, col, create_engine, select

from fleet.core.errors import FleetError
from fleet.core.models import (
    TRANSITIONS,
    Attempt,
    BenchRun,
    Blacklist,
    Event,
    Host,
    HostState,
    Install,
    JobRun,
    ProbeRun,
    utcnow,
)
from fleet.core.ownership import owner_is_dead, process_owner
from fleet.core.schema import migrate

BUSY_TIMEOUT_MS = 10_000


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def _private_file(path: Path) -> None:
    """Create the database file (and its directory) readable by its owner only. A file that exists is never
    opened here: closing any descriptor of it would drop every POSIX lock this process holds on it, and
    another process would then believe itself the last connection and delete the WAL under ours (SQLite's
    "How To Corrupt An SQLite Database File", 2.2)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
        return
    os.close(fd)


def is_postgres(engine: Engine) -> bool:
    return engine.url.get_backend_name() == "postgresql"


def make_engine(target: Path | str) -> Engine:
    """An engine for a SQLite file (created private) or a PostgreSQL URL."""
    if isinstance(target, str):
        return create_engine(target, pool_pre_ping=True)
    path = target
    _private_file(path)
    # The sqlite3 driver's own transaction handling leaves DDL outside transactions, so a migration that
    # failed half-way would stay half-applied. Let SQLAlchemy say BEGIN itself instead.
    engine = create_engine(sqlite_url(path), connect_args={"timeout": BUSY_TIMEOUT_MS / 1000, "isolation_level": None})

    # BEGIN IMMEDIATE: a transaction takes the write lock when it starts, so two processes queue on the busy
    # timeout instead of one failing at once with "database is locked" when it turns a read into a write.
    @event.listens_for(engine, "begin")
    def _begin(conn) -> None:  # type: ignore[no-untyped-def]
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


_ENGINES: dict[str, Engine] = {}  # one engine per database in a process, migrated once


def open_database(target: Path | str) -> Engine:
    """This process's engine for the database, its schema brought to the newest migration the first time.
    Disposing it closes its idle connections; it stays usable."""
    key = str(target)
    engine = _ENGINES.get(key)
    if engine is None:
        engine = make_engine(target)
        migrate(engine)
        _ENGINES[key] = engine
    return engine


def session(engine: Engine) -> Session:
    return Session(engine, expire_on_commit=False)


ADVISORY_BASE = 0x666C6565 << 20  # "flee": keeps fleet's advisory keys apart from other users of the database
CAPS_LOCK = ADVISORY_BASE  # PostgreSQL: held while one process checks the caps and writes its intent
PACE_LOCK = ADVISORY_BASE + 1  # PostgreSQL: held while one process takes a marketplace turn (marketpace.py)


class CapReached(FleetError):
    """A cap in fleet.toml forbids another create."""


class Record:
    """Every read and write of the record goes through here."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def add(self, row: SQLModel) -> SQLModel:
        with session(self.engine) as s:
            s.add(row)
            s.commit()
            s.refresh(row)
            return row

    def add_all(self, rows: list[SQLModel]) -> None:
        """Many rows in one transaction."""
        with session(self.engine) as s:
            s.add_all(rows)
            s.commit()

    def update(self, row: SQLModel, **changes: object) -> SQLModel:
        """Write only `changes` to the row's record (UPDATE ... SET those columns WHERE id = ?), and mirror
        them on `row`. The rest of `row` may be minutes old: it is never written back over newer values."""
        table = type(row)
        with session(self.engine) as s:
            s.execute(sql_update(table).where(table.id == row.id).values(**changes))  # type: ignore[attr-defined]
            s.commit()
        for key, value in changes.items():
            setattr(row, key, value)
        return row

    def event(self, kind: str, action: str, detail: str = "", host_id: int | None = None) -> None:
        self.add(Event(kind=kind, action=action, detail=detail, host_id=host_id))

    def hosts(
        self,
        *,
        states: tuple[str, ...] | None = None,
        model: str | None = None,
        names: list[str] | None = None,
        region: str | None = None,
    ) -> list[Host]:
        with session(self.engine) as s:
            q = select(Host)
            if states is not None:
                q = q.where(col(Host.state).in_(states))
            if model is not None:
                q = q.where(Host.model == model)
            if region is not None:
                q = q.where(Host.region == region)
            if names is not None:
                q = q.where(col(Host.name).in_(names))
            return list(s.exec(q.order_by(Host.id)))

    def host(self, host_id: int) -> Host | None:
        with session(self.engine) as s:
            return s.get(Host, host_id)

    def open_hosts(self) -> list[Host]:
        """Every host whose bill is open: the marketplace has not confirmed its instance gone."""
        with session(self.engine) as s:
            return list(s.exec(select(Host).where(col(Host.destroyed_at).is_(None)).order_by(Host.id)))

    # ---- ownership and transitions ---------------------------------------------------------------
    def claim(self, host: Host, lease_s: float, owner: str | None = None) -> bool:
        """Take the host for `owner` (this process) for `lease_s`: when nobody holds it, its lease ran out,
        `owner` holds it already, or its owner is a dead process of this machine. False: someone else works
        on it now. Once taken, `host` is read again: the caller acts on the host as it is, not as it was seen
        (a bring-up that let go of it meanwhile moved it on)."""
        owner = owner or process_owner()
        now = utcnow()
        values = {"owner": owner, "lease_until": now + timedelta(seconds=lease_s)}
        free = or_(col(Host.owner).is_(None), Host.owner == owner, col(Host.lease_until) < now)
        taken = self._cas(host, values, free)
        if not taken:
            current = self.host(host.id) if host.id is not None else None
            if current is not None and current.owner and owner_is_dead(current.owner):
                taken = self._cas(host, values, Host.owner == current.owner)
        if taken:
            now_is = self.host(host.id) if host.id is not None else None
            for name in Host.model_fields if now_is is not None else ():
                setattr(host, name, getattr(now_is, name))
        return taken

    def renew(self, lease_s: float, owner: str | None = None) -> int:
        """Extend every lease `owner` holds on an open host; how many."""
        with session(self.engine) as s:
            result = s.execute(
                sql_update(Host)
                .where(Host.owner == (owner or process_owner()), col(Host.destroyed_at).is_(None))
                .values(lease_until=utcnow() + timedelta(seconds=lease_s))
            )
            s.commit()
            return int(result.rowcount or 0)  # type: ignore[attr-defined]

    def release(self, host: Host, owner: str | None = None) -> None:
        if self._cas(host, {"owner": None, "lease_until": None}, Host.owner == (owner or process_owner())):
            host.owner, host.lease_until = None, None

    def transition(self, host: Host, to: HostState, **changes: object) -> bool:
        """Move the host to `to`, compare-and-set: only from the state this process saw (`host.state`), where
        TRANSITIONS allows, while the bill is open. False (nothing written) when another process moved it first:
        a move judged on what the host was is not applied to what it is now."""
        if to not in TRANSITIONS[HostState(host.state)]:
            return False
        applied = self._cas(
            host, {"state": to, **changes}, col(Host.state) == host.state, col(Host.destroyed_at).is_(None)
        )
        if applied:
            host.state = to
            for key, value in changes.items():
                setattr(host, key, value)
        return applied

    def close(self, host: Host, final_state: HostState, accrued_usd: float, **changes: object) -> bool:
        """Close the host's bill, once: the marketplace confirmed its instance gone (or it never had one)."""
        now = utcnow()
        values = {
            "state": final_state,
            "destroyed_at": now,
            "accrued_usd": accrued_usd,
            "owner": None,
            "lease_until": None,
            "api_key": None,  # a key in clear, from before keys were derived, outlives no host
            **changes,
        }
        applied = self._cas(host, values, col(Host.destroyed_at).is_(None))
        if applied:
            for key, value in values.items():
                setattr(host, key, value)
        return applied

    def _cas(self, host: Host, values: dict[str, object], *conditions: Any) -> bool:
        with session(self.engine) as s:
            result = s.execute(sql_update(Host).where(Host.id == host.id, *conditions).values(**values))
            s.commit()
            return bool(result.rowcount)  # type: ignore[attr-defined]

    def reserve(self, host: Host, attempt: Attempt, check: Callable[[list[Host]], None]) -> None:
        """Write the intent (the host row, its attempt, an event) after `check` passed on the open hosts, in one
        transaction that no other process can interleave: SQLite's BEGIN IMMEDIATE, a PostgreSQL advisory
        lock. `check` raises CapReached to refuse; then nothing is written."""
        with session(self.engine) as s:
            if is_postgres(self.engine):
                s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": CAPS_LOCK})
            open_hosts = list(s.exec(select(Host).where(col(Host.destroyed_at).is_(None))))
            check(open_hosts)
            s.add(host)
            s.flush()
            attempt.host_id = host.id
            s.add(attempt)
            s.add(
                Event(
                    kind="intent",
                    action="create",
                    detail=json.dumps({"offer_id": host.offer_id, "label": host.label}),
                    host_id=host.id,
                )
            )
            s.commit()
            s.refresh(host)

    def blacklisted_machines(self, provider_url: str, now: datetime) -> set[int]:
        with session(self.engine) as s:
            q = select(Blacklist.machine_id).where(Blacklist.provider_url == provider_url, Blacklist.expires_at > now)
            return set(s.exec(q))

    def close_attempt(self, host_id: int, outcome: str, phase: str | None, reason: str | None) -> None:
        """End the host's (latest) attempt with its outcome."""
        with session(self.engine) as s:
            q = select(Attempt).where(Attempt.host_id == host_id).order_by(col(Attempt.id).desc()).limit(1)
            attempt = s.exec(q).one()
            attempt.ended_at = utcnow()
            attempt.outcome, attempt.phase, attempt.reason = outcome, phase, reason
            s.add(attempt)
            s.commit()

    def events(self, host_id: int | None = None) -> list[Event]:
        with session(self.engine) as s:
            q = select(Event)
            if host_id is not None:
                q = q.where(Event.host_id == host_id)
            return list(s.exec(q.order_by(Event.id)))

    def probe_runs(self, host_id: int) -> list[ProbeRun]:
        with session(self.engine) as s:
            return list(s.exec(select(ProbeRun).where(ProbeRun.host_id == host_id).order_by(ProbeRun.id)))

    def machine_rows(self) -> tuple[list[Host], list[ProbeRun], list[BenchRun], list[Blacklist]]:
        """Every row a machine's record is made from (fleet/economics/machines.py), in one read transaction."""
        with session(self.engine) as s:
            return (
                list(s.exec(select(Host))),
                list(s.exec(select(ProbeRun))),
                list(s.exec(select(BenchRun))),
                list(s.exec(select(Blacklist))),
            )

    def latest_bench(self, host_ids: list[int]) -> dict[int, BenchRun]:
        """Each host's most recent bench run (hosts never benched are absent)."""
        if not host_ids:
            return {}
        with session(self.engine) as s:
            rows = s.exec(select(BenchRun).where(col(BenchRun.host_id).in_(host_ids)).order_by(col(BenchRun.id)))
            return {row.host_id: row for row in rows}

    def install_id(self) -> str:
        """This database's install of fleet (made by its migration): the labels of its instances carry it."""
        with session(self.engine) as s:
            return s.exec(select(Install.install_id)).one()

    def ca_sha256(self) -> str | None:
        """The SHA-256 of the public key of the CA this install's hosts trust, once one was used."""
        with session(self.engine) as s:
            return s.exec(select(Install.ca_sha256)).one()

    def claim_ca(self, sha256: str) -> str:
        """Name this CA as the install's unless one is named already (compare-and-set); the one named now."""
        with session(self.engine) as s:
            s.execute(sql_update(Install).where(col(Install.ca_sha256).is_(None)).values(ca_sha256=sha256))
            s.commit()
            return s.exec(select(Install.ca_sha256)).one() or sha256

    def claim_tick(self, job: str, tick: int, daemon: str) -> str | None:
        """Claim `job` at `tick` for `daemon`: None when it got it, else the daemon that had it first."""
        try:
            self.add(JobRun(job=job, tick=tick, daemon=daemon))
        except IntegrityError:
            with session(self.engine) as s:
                row = s.get(JobRun, (job, tick))
                return row.daemon if row is not None else "unknown"
        return None

    def blacklist(self) -> list[Blacklist]:
        with session(self.engine) as s:
            return list(s.exec(select(Blacklist).order_by(Blacklist.id)))
