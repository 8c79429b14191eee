"""Finding and ending a local host's processes: by the marker in their environment, and by descent.

Every process of a local host (every SSH session, whatever a session daemonises, the onstart
script) inherits `FLEET_LOCALCLOUD_HOST=<token>`, a token unique to that host. sshd rewrites its
process title over its environment, so sshd and its per-connection children are found instead as
descendants of the host's sshd PID. Ending a host means signalling exactly those PIDs, never
matching by process name: other work shares this machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

MARKER = "FLEET_LOCALCLOUD_HOST"


def pids_with_marker(token: str) -> list[int]:
    """PIDs whose environment carries this host's marker."""
    needle = f"{MARKER}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses): state, ppid, ..."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def _parents() -> dict[int, int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(entry.name)) is not None:
            parents[int(entry.name)] = int(fields[1])
    return parents


def identity(pid: int) -> str | None:
    """The process's start time, which tells it from a later process given the same PID; None once it
    has exited (a zombie included: a container's init may never reap it)."""
    fields = _stat_fields(pid)
    return None if fields is None or fields[0] in ("Z", "X") else fields[19]


def descendants(roots: list[int]) -> list[int]:
    """The roots that still exist, and every process below them."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [r for r in roots if r in parents]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def host_pids(token: str, roots: list[int]) -> list[int]:
    """Every process of a host: those with its marker, and the trees below its root PIDs."""
    return sorted(set(pids_with_marker(token)) | set(descendants(roots)))


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def end_host_processes(token: str, roots: list[int], grace_s: float = 3.0) -> int:
    """SIGTERM (then SIGKILL after `grace_s`) every process of the host; return how many were found.

    Returns only once every process it found has exited: one that took the signal but has not yet run
    to its end is still there, and once its parent died it is no longer below the roots, so each found
    process stays followed (and its own children with it) until it is gone.
    """
    seen: dict[int, str] = {}
    deadline = time.monotonic() + grace_s
    while True:
        alive = [pid for pid, start in seen.items() if identity(pid) == start]
        for pid in host_pids(token, [*roots, *alive]):
            if pid != os.getpid() and pid not in alive and (start := identity(pid)) is not None:
                seen[pid], alive = start, [*alive, pid]
        if not alive:
            return len(seen)
        _signal_all(alive, signal.SIGCONT)  # a throttled (stopped) process must run to die
        _signal_all(alive, signal.SIGTERM if time.monotonic() < deadline else signal.SIGKILL)
        time.sleep(0.05)
        _reap()


def _reap() -> None:
    """Collect our own exited children so they do not linger as zombies with the marker."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def pause(pids: list[int]) -> None:
    _signal_all(pids, signal.SIGSTOP)


def resume(pids: list[int]) -> None:
    _signal_all(pids, signal.SIGCONT)
