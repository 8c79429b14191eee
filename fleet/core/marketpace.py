"""The install's one budget of marketplace calls, in the record: vast.ai limits an identity (its key and the
address it calls from), not a process, so the daemon and every command beside it take turns here.

A turn is held while its request is in flight, and the endpoint's next call may start its interval after the
answer arrived, as each process's own pacer does (fleet/market/pacing.py): the marketplace saw the request
before we saw its answer, so the interval it measures is never shorter than ours, however late a busy machine
sent it. A process that dies mid-request holds its turn until `hold_s` has passed.

Its times are the record's clock, not each machine's: on PostgreSQL the server's (one machine whose clock ran
ahead would otherwise hold every turn it took that far into the others' future, and stall them), on SQLite this
machine's, the only one that writes it."""

from __future__ import annotations

import json
import time

from sqlalchemy import text
from sqlalchemy.orm import Session

from fleet.core.models import MarketPace
from fleet.core.record import PACE_LOCK, Record, is_postgres, session

IN_FLIGHT_POLL_S = 0.2  # how soon to ask again while another process's call is in flight (its answer ends it)


def _clock(s: Session, record: Record) -> float:
    """Now, in epoch seconds, by the record's clock."""
    if is_postgres(record.engine):
        return float(s.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one())
    return time.time()


def claim_turn(
    record: Record, key: str, interval_s: float, per_minute: int, now: float | None, hold_s: float
) -> tuple[float | None, float]:
    """Take the turn at endpoint `key` (epoch seconds `now`; None: the record's clock), in one transaction no
    other process interleaves.
    (token, 0.0): send now, and give the token back with `release_turn` when the answer is in. (None, seconds):
    ask again after that long, since a call is in flight, the previous answer is under `interval_s` old, or
    `per_minute` calls (when set) started within the last minute."""
    with session(record.engine) as s:
        if is_postgres(record.engine):
            s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PACE_LOCK})
        now = _clock(s, record) if now is None else now
        row = s.get(MarketPace, key) or MarketPace(key=key)
        if row.held_until > now:
            return None, min(row.held_until - now, IN_FLIGHT_POLL_S)
        recent = sorted(t for t in json.loads(row.recent) if t > now - 60.0)
        ready = row.next_at
        if per_minute and len(recent) >= per_minute:
            ready = max(ready, recent[-per_minute] + 60.0)
        if ready > now:
            return None, ready - now
        row.held_until = now + hold_s
        row.recent = json.dumps([*recent, now][-per_minute:] if per_minute else [])
        s.add(row)
        s.commit()
        return row.held_until, 0.0


def release_turn(record: Record, key: str, token: float, interval_s: float, now: float | None) -> None:
    """The answer to the turn `token` arrived at `now` (None: the record's clock): the endpoint's next call may
    start `interval_s` later.
    A turn whose hold ran out (another process took the endpoint since) frees nothing but its interval."""
    with session(record.engine) as s:
        if is_postgres(record.engine):
            s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PACE_LOCK})
        now = _clock(s, record) if now is None else now
        row = s.get(MarketPace, key)
        if row is None:
            return
        row.next_at = max(row.next_at, now + interval_s)
        if row.held_until == token:
            row.held_until = 0.0
        s.add(row)
        s.commit()
