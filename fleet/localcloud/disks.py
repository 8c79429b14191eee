"""An instance's disk allocation, held as vast.ai holds it: the container writes into a filesystem of the size
the create call asked for less its image's, and a write past it fails with "No space left on device".

Each host's home (where its weights, its server's files and its logs go) is an ext4 filesystem in a sparse file
beside it (`disk.img`: only what is written takes room), loop-mounted while the local cloud runs: made at the
host's first boot, mounted again by a later boot (a stop keeps the disk), unmounted when the cloud stops or the
instance is destroyed. Mounting needs root and loop devices; where this machine gives neither, allocations are
not held and the cloud's log says so once (docs/vast-fidelity.md)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger("fleet.localcloud")

IMAGE_FILE = "disk.img"
MIN_BYTES = 256 << 10  # the least room a filesystem is made in: a disk the image leaves less of is refused at boot


class DiskError(RuntimeError):
    """The allocation could not be made or mounted."""


def _run(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise DiskError(f"{argv[0]} exited {done.returncode}: {said[-1] if said else 'no word'}")


def _make(image: Path, size_bytes: int) -> None:
    """A sparse file of `size_bytes` holding an empty ext4 filesystem: no blocks kept for root (vast.ai's
    allocation is the container's whole) and no journal (its room would count against a small allocation)."""
    part = image.with_suffix(".part")
    with part.open("wb") as f:
        f.truncate(size_bytes)
    _run("mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "lazy_itable_init=1", str(part))
    part.rename(image)


@cache
def holdable() -> bool:
    """Whether this machine can hold allocations: a small filesystem made, mounted and unmounted once."""
    missing = [p for p in ("mkfs.ext4", "mount", "umount") if shutil.which(p) is None]
    if missing or os.geteuid() != 0:
        why = f"{', '.join(missing)} not found" if missing else "the local cloud does not run as root"
        log.warning("disk allocations are not held: %s", why)
        return False
    with tempfile.TemporaryDirectory(prefix="fleet-disk-") as tmp:
        try:
            _make(Path(tmp) / IMAGE_FILE, MIN_BYTES)
            (Path(tmp) / "mnt").mkdir()
            _run("mount", "-o", "loop", str(Path(tmp) / IMAGE_FILE), str(Path(tmp) / "mnt"))
            _run("umount", str(Path(tmp) / "mnt"))
        except (DiskError, OSError, subprocess.TimeoutExpired) as e:
            log.warning("disk allocations are not held: no loop mount on this machine (%s)", e)
            return False
    return True


def attach(directory: Path, home: Path, size_bytes: int) -> bool:
    """Mount the allocation of the host in `directory` on its `home` (made at the first boot); False where this
    machine cannot hold allocations."""
    if not holdable():
        return False
    if home.is_mount():
        return True
    image = directory / IMAGE_FILE
    if not image.exists():
        if size_bytes < MIN_BYTES:
            raise DiskError(f"a disk of {size_bytes} bytes after the image holds no filesystem")
        _make(image, size_bytes)
    home.mkdir(parents=True, exist_ok=True)
    _run("mount", "-o", "loop", str(image), str(home))
    os.chmod(home, 0o700)
    return True


def detach(home: Path) -> None:
    """Unmount the host's allocation (its processes ended first); lazily if something still holds it."""
    if not home.is_mount():
        return
    try:
        _run("umount", str(home))
    except DiskError:
        _run("umount", "-l", str(home))
