"""How long the record keeps what only housekeeping wrote: the daemon's claimed ticks (`job_runs`), the events no
host owns (a credit reading per reconcile, the gateway's syncs) and the offers each search saw. A day of a
daemon at its default schedules writes thousands of these; every host, its attempts, probes, benches and bill,
and every event of a host, stay for good. Deleted in small batches, each its own short transaction, so that no
bring-up, lease renewal or gateway sync waits on housekeeping."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import delete
from sqlmodel import col, select

from fleet.core.models import Event, JobRun, OfferSeen
from fleet.core.record import Record, session

BATCH = 2000  # rows a transaction: a few milliseconds of a write lock on SQLite


@dataclass
class Pruned:
    rows: dict[str, int] = field(default_factory=dict)  # table -> rows deleted

    def total(self) -> int:
        return sum(self.rows.values())


def prune(record: Record, before: datetime, batch: int = BATCH) -> Pruned:
    """Delete what housekeeping wrote before `before`, `batch` rows a transaction."""
    done = Pruned()
    targets = (
        ("job_runs", JobRun, col(JobRun.started_at) < before, (JobRun.job, JobRun.tick)),
        ("events", Event, (col(Event.at) < before) & col(Event.host_id).is_(None), (Event.id,)),
        ("offers_seen", OfferSeen, col(OfferSeen.seen_at) < before, (OfferSeen.id,)),
    )
    for name, table, old, key in targets:
        done.rows[name] = 0
        while True:
            with session(record.engine) as s:
                keys = list(s.exec(select(*key).where(old).limit(batch)))
                if not keys:
                    break
                if len(key) == 1:
                    ids = [k if not isinstance(k, tuple) else k[0] for k in keys]
                    s.execute(delete(table).where(col(key[0]).in_(ids)))
                else:
                    for job, tick in keys:
                        s.execute(delete(table).where(JobRun.job == job, JobRun.tick == tick))
                s.commit()
            done.rows[name] += len(keys)
            if len(keys) < batch:
                break
    return done
