"""A process's leases outlive a database that stays busy past its timeout: the renewal tries again rather
than dying, so a long bring-up is never taken for an interrupted one (found in the full suite under a CPU
hog: a reconcile failed two hosts "bring-up interrupted in probing" while their `fleet up` ran)."""

import asyncio
import sqlite3

from fleet.context import Leases
from fleet.core.record import BUSY_TIMEOUT_MS, Record, open_database
from tests.control.test_rotation import host


def test_a_lease_is_renewed_after_the_database_was_busy_past_its_timeout(tmp_path):
    path = tmp_path / "fleet.db"
    record = Record(open_database(path))
    held = record.add(host(name="h1", label="fleet:h1"))
    lease_s = 3.0  # the least fleet.toml allows: a renewal every second

    async def run() -> tuple[float, float]:
        leases = Leases(record, lease_s, "me/1/1")
        assert leases.claim(held)
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")  # another process writing, longer than the busy timeout
        await asyncio.sleep(BUSY_TIMEOUT_MS / 1000 + 2)  # a renewal waits its timeout in vain meanwhile
        blocker.execute("COMMIT")
        blocker.close()
        after_release = record.host(held.id).lease_until
        await asyncio.sleep(lease_s)  # a live renewal task renews within a lease
        renewed = record.host(held.id).lease_until
        leases.close()
        return after_release.timestamp(), renewed.timestamp()

    after_release, renewed = asyncio.run(run())
    assert renewed > after_release
