"""A host proves the image it booted before fleet pays for a pull: its manifest (the sha256 of each program fleet
runs there, written by the image's build) must hash to what fleet.toml pins, and its programs must match it. For
an image rented by its tag, which vast.ai may resolve to other contents than fleet tested, or a machine may have
kept a stale copy of."""

from __future__ import annotations

import hashlib

import asyncssh

from fleet.core.errors import FleetError
from fleet.host.remote import run

PROGRAM = "fleet-image-proof"


class ImageNotPinned(FleetError, RuntimeError):
    """The host's image is not the one fleet.toml pins."""


async def prove(conn: asyncssh.SSHClientConnection, pinned: str, timeout_s: float) -> None:
    """Raise ImageNotPinned unless the host shows the manifest `pinned` ("sha256:<hex>") names, with every
    program it lists unchanged."""
    done = await run(conn, [PROGRAM], timeout_s=timeout_s, check=False)
    shown_as = "sha256:" + hashlib.sha256(done.stdout.encode()).hexdigest()
    if shown_as != pinned:
        said = done.stderr.strip().splitlines()
        raise ImageNotPinned(
            f"the host booted another image than fleet.toml pins: its manifest is {shown_as}, not {pinned} (a stale"
            f" copy of the tag on this machine, or the tag moved){': ' + said[-1][:200] if said else ''}"
        )
    if done.exit_status != 0:
        said = done.stderr.strip().splitlines()
        raise ImageNotPinned(
            f"the host's image has the pinned manifest but not its programs: {said[0][:200] if said else 'no word'}"
        )
