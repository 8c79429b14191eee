"""Who is working on a host: this process's owner ids (one a Context), and whether another owner is still alive.

Every host being worked on (brought up, drained, destroyed) carries its owner and a lease the owner
renews (Record.claim / renew / release). Housekeeping in any process (reconcile, `destroy --all`, the
daemon's jobs, a second `fleet up`) acts only on hosts with no owner, an expired lease, or an owner known
to be dead: a process on this machine that no longer runs (the id holds the process's start time, so a
reused PID is not mistaken for it). An owner on another machine is trusted until its lease runs out.
"""

from __future__ import annotations

import itertools
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


_contexts = itertools.count(1)


@cache
def process_owner() -> str:
    """This process, as an owner: host name, PID and start time."""
    return f"{socket.gethostname()}/{os.getpid()}/{_start_ticks(os.getpid())}"


def context_owner() -> str:
    """An owner of its own for one Context of this process. The daemon runs its jobs side by side, each in its
    own Context: a reconcile that took the process's leases for its own failed the host a reprice job beside it
    was bringing up, as interrupted."""
    # the Context's number goes before the host name: fleet of an earlier version reads such an owner as another
    # machine's, trusted until its lease runs out, never as a dead process's
    return f"{next(_contexts)}@{process_owner()}"


def owner_is_dead(owner: str) -> bool:
    """True only when the owner is a process of this machine (or a Context of one) that no longer runs."""
    try:
        host, pid, started = owner.rsplit("/", 2)
        host = host.rpartition("@")[2]
        number = int(pid)
    except ValueError:
        return False
    if host != socket.gethostname():
        return False
    return _start_ticks(number) != started
