"""Files fleet's secrets live in: private from their first byte, written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, data: bytes) -> bool:
    """Write a private file at `path`, mode 0600 from its first byte, all or nothing; False when another
    process made it first (its file is kept: two fleet processes starting at once agree on one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.unlink(missing_ok=True)  # this PID's leftover from a crash
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(partial, path)
        except FileExistsError:
            return False
        return True
    finally:
        partial.unlink(missing_ok=True)


def write_public(path: Path, data: bytes) -> None:
    """Replace `path` whole (mode 0644): a reader sees the old file or the new one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_bytes(data)
    partial.chmod(0o644)
    os.replace(partial, path)
