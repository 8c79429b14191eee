"""vast.ai's request_logs on the local cloud: the call answers a URL that gives the instance's logs a moment later
(404 till then, as vast-cli's `logs` polls it). The container's own output is the platform's lines; what the
create call's onstart printed is in it only under fault `onstart_in_logs`: no source says vast.ai's is, and
`fleet doctor --live` reads it."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from fleet.localcloud.instances import Instance

LOGS_READY_S = 1.0  # a request_logs URL answers 404 until then


class InstanceLogs:
    def __init__(self) -> None:
        self._requests: dict[str, tuple[int, float]] = {}  # token -> instance, ready at (monotonic)

    def request(self, instance_id: int) -> str:
        """A token for the URL of the instance's logs."""
        token = secrets.token_urlsafe(16)
        self._requests[token] = (instance_id, time.monotonic() + LOGS_READY_S)
        return token

    def text(self, token: str, instances: dict[int, Instance], state_dir: Path, onstart_in_logs: bool) -> str | None:
        """The logs a token names, once ready; None before, or for an unknown token or a gone instance."""
        instance_id, ready_at = self._requests.get(token, (0, 0.0))
        inst = instances.get(instance_id)
        if inst is None or time.monotonic() < ready_at:
            return None
        lines = [f"Starting container {inst.id} ({inst.image})", "Starting sshd"]
        onstart = state_dir / "hosts" / str(inst.id) / "log" / "onstart.log"
        if onstart_in_logs and onstart.exists():
            lines += onstart.read_text(errors="replace").splitlines()
        return "\n".join(lines) + "\n"
