"""Assembling a Fleet from fleet.toml: the marketplace endpoint, the record, our SSH key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fleet import config, db
from fleet.lifecycle import Fleet, Reporter
from fleet.market.connect import open_market, resolve
from fleet.remote import ensure_key


def ssh_key_path(settings: config.Settings) -> Path:
    return settings.database.file.parent / "ssh" / "id_ed25519"


@asynccontextmanager
async def open_fleet(settings: config.Settings, reporter: Reporter | None = None) -> AsyncIterator[Fleet]:
    endpoint = resolve(settings)
    engine = db.open_database(settings.database.target)
    market = open_market(endpoint, settings)
    fleet = Fleet(
        settings,
        db.Record(engine),
        market,
        ensure_key(ssh_key_path(settings)),
        settings.hub_url(endpoint.local_cloud_url),
        reporter,
    )
    try:
        yield fleet
    finally:
        await fleet.close()
        await market.close()
        engine.dispose()
