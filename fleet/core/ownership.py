"""Who is working on a host: this process's owner id, and whether another owner is still alive.

Every host being worked on (brought up, drained, destroyed) carries its owner and a lease the owner
renews (Record.claim / renew / release). Housekeeping in any process (reconcile, `destroy --all`, the
daemon's jobs, a second `fleet up`) acts only on hosts with no owner, an expired lease, or an owner known
to be dead: a process on this machine that no longer runs (the id holds the process's start time, so a
reused PID is not mistaken for it). An owner on another machine is trusted until its lease runs out.
"""

from __future__ import annotations

import os
import socket
from functools import cache
from pathlib import Path


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


@cache
def process_owner() -> str:
    """This process, as an owner: host name, PID and start time."""
    return f"{socket.gethostname()}/{os.getpid()}/{_start_ticks(os.getpid())}"


def owner_is_dead(owner: str) -> bool:
    """True only when the owner is a process of this machine that no longer runs."""
    try:
        host, pid, started = owner.rsplit("/", 2)
        number = int(pid)
    except ValueError:
        return False
    if host != socket.gethostname():
        return False
    return _start_ticks(number) != started
