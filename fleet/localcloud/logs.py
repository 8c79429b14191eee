"""vast.ai's request_logs on the local cloud: the call answers a URL that gives the instance's logs a moment later
(404 till then, as vast-cli's `logs` polls it), as they were when asked for, their last `tail` lines.

An instance's logs are its container's: what its PID 1 printed (Docker's logs are the container's main process's
output). Here that is the platform's lines, then the host's console (`log/console.log`, where a host's processes
write what a container's write to /proc/1/fd/1; fleet-host-key announces the host's key there). What onstart
prints goes to its own file, as vast.ai's SSH launch mode sends it to /var/log/onstart.log, never to the logs.
Fault `logs_without_console` names machines whose logs hold the platform's lines alone."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from fleet.localcloud.instances import Instance

LOGS_READY_S = 1.0  # a request_logs URL answers 404 until then
DEFAULT_TAIL = 1000


class InstanceLogs:
    def __init__(self) -> None:
        self._requests: dict[str, tuple[str, float]] = {}  # token -> the logs' text, ready at (monotonic)

    def request(self, inst: Instance, host_dir: Path, console: bool, tail: int) -> str:
        """A token for the URL of the instance's logs as they are now, their last `tail` lines."""
        lines = [f"Starting container {inst.id} ({inst.image})", "Starting sshd"]
        path = host_dir / "log" / "console.log"
        if console and path.exists():
            lines += path.read_text(errors="replace").splitlines()
        token = secrets.token_urlsafe(16)
        text = "".join(line + "\n" for line in lines[-tail:]) if tail > 0 else ""
        self._requests[token] = (text, time.monotonic() + LOGS_READY_S)
        return token

    def text(self, token: str) -> str | None:
        """The logs a token names, once ready; None before, or for an unknown token."""
        text, ready_at = self._requests.get(token, (None, 0.0))
        if text is None or time.monotonic() < ready_at:
            return None
        return text
