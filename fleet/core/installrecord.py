"""This install's own switches in the record, shared by every process and machine of it: whether its [[serve]]
targets are paused."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import update as sql_update
from sqlmodel import col, select

from fleet.core.models import Install, utcnow
from fleet.core.record import Record, session


def serve_paused(record: Record) -> datetime | None:
    """Since when the [[serve]] targets are paused, or None: they are kept."""
    with session(record.engine) as s:
        return s.exec(select(Install.serve_paused_at)).one()


def pause_serving(record: Record, paused: bool) -> datetime | None:
    """Pause the [[serve]] targets (a pause already on keeps its time) or resume them; since when they are paused."""
    with session(record.engine) as s:
        if paused:
            unpaused = col(Install.serve_paused_at).is_(None)
            s.execute(sql_update(Install).where(unpaused).values(serve_paused_at=utcnow()))
        else:
            s.execute(sql_update(Install).values(serve_paused_at=None))
        s.commit()
    return serve_paused(record)
