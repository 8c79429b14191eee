"""The database's schema, brought to the newest alembic migration: every fleet command opens the database,
so a schema already there is read in one query, and alembic is loaded only when a migration is to run."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def head_revision() -> str:
    """The newest migration's revision. Each migration is named by its revision (0021_market_turn.py is
    "0021") and follows the one before it (tests/core hold alembic's own reading of the head to this)."""
    return max(p.name.partition("_")[0] for p in (MIGRATIONS / "versions").glob("[0-9]*_*.py"))


def _at_head(engine: Engine) -> bool:
    """Whether the schema is at the newest migration already: every fleet command opens the database, and
    alembic's own check (its package and every migration file loaded) cost a command a quarter of a second."""
    try:
        with engine.connect() as connection:
            found = connection.exec_driver_sql("SELECT version_num FROM alembic_version").scalars().all()
    except DBAPIError:
        return False  # a new database: no table yet
    return found == [head_revision()]


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to the newest migration (or to `revision`)."""
    if revision != "head" or not _at_head(engine):
        _upgrade(engine, revision)
    # WAL and SHM side files must be as private as the database itself.
    url = engine.url
    if url.drivername.startswith("sqlite") and url.database:
        for suffix in ("-wal", "-shm"):
            side = Path(url.database + suffix)
            if side.exists():
                os.chmod(side, 0o600)


def _upgrade(engine: Engine, revision: str) -> None:
    from alembic import command  # only when there is a migration to run (see _at_head)
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.connect() as connection:
        sqlite = connection.dialect.name == "sqlite"
        raw = connection.connection.driver_connection
        if sqlite:
            # SQLite alters a table by copying it; its foreign keys must not fire while the old copy is
            # dropped. The pragma only takes effect outside a transaction: say it on the driver's
            # connection, before SQLAlchemy begins one.
            raw.execute("PRAGMA foreign_keys=OFF")
        with connection.begin():
            cfg.attributes["connection"] = connection
            command.upgrade(cfg, revision)
            if sqlite:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise RuntimeError(f"migration left rows whose references are broken: {broken[:5]}")
        if sqlite:
            raw.execute("PRAGMA foreign_keys=ON")
