"""Finding and ending a local host's processes by the marker in their environment.

Every process of a local host (its sshd, every SSH session, whatever a session daemonises, the
onstart script) inherits `FLEET_LOCALCLOUD_HOST=<token>`, a token unique to that host. Ending a
host means signalling exactly those PIDs, never matching by process name: other work shares
this machine.
"""

from __future__ import annotations

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


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def end_host_processes(token: str, grace_s: float = 3.0) -> int:
    """SIGTERM (then SIGKILL after `grace_s`) every process of the host; return how many were found.

    Repeats until none is left, since a dying session can still fork.
    """
    total: set[int] = set()
    deadline = time.monotonic() + grace_s
    while True:
        pids = [p for p in pids_with_marker(token) if p != os.getpid()]
        if not pids:
            return len(total)
        total.update(pids)
        _signal_all(pids, signal.SIGCONT)  # a throttled (stopped) process must run to die
        _signal_all(pids, signal.SIGTERM if time.monotonic() < deadline else signal.SIGKILL)
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
