"""Starting, finding and stopping the local cloud's server process (what `fleet cloud` calls)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleet.core import paths
from fleet.core.errors import FleetError
from fleet.localcloud import procs


class CloudControlError(FleetError, RuntimeError):
    """The local cloud could not be started, reached or stopped."""

    prefix = "local cloud"


@dataclass(frozen=True)
class CloudInfo:
    url: str
    pid: int
    state_dir: Path

    @property
    def api_key_file(self) -> Path:
        return self.state_dir / "api_key"

    def api_key(self) -> str:
        return self.api_key_file.read_text().strip()


def default_state_dir() -> Path:
    """$FLEET_LOCALCLOUD_DIR, else `localcloud` in fleet's state directory (core/paths.py)."""
    explicit = os.environ.get("FLEET_LOCALCLOUD_DIR")
    return Path(explicit) if explicit else paths.state_dir() / "localcloud"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find(state_dir: Path) -> CloudInfo | None:
    """The running cloud of this state directory, or None. A cloud killed without its shutdown leaves its
    server.json behind, and its PID soon names another process: the process must also have the start time
    the file records (a file without one, an older fleet's: the process must be a local cloud's server)."""
    path = state_dir / "server.json"
    try:
        info = json.loads(path.read_text())
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if info.get("started") is not None:
        if procs.identity(pid) != info["started"]:
            return None
    elif not _alive(pid) or b"fleet.localcloud.server" not in _command_line(pid):
        return None
    return CloudInfo(url=info["url"], pid=pid, state_dir=state_dir)


def _command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def start(
    state_dir: Path,
    *,
    port: int = 0,
    offers_dir: Path | None = None,
    provision_delay_s: float | None = None,
    loading_delay_s: float | None = None,
    hub_bytes_per_s: int | None = None,
    kind: bool = False,
    simulated_card: str | None = None,
    publish: dict[str, Path] | None = None,
    timeout_s: float = 30.0,
) -> CloudInfo:
    """Start the cloud unless it already runs; return where it listens. `kind` turns off vast.ai's
    time-based hardships (rate limits, read lag, late SSH keys, heartbeat gaps): for tests that say why.
    `publish`: the hub also serves each directory's GGUF files as that repo (hashed before the cloud answers).
    `simulated_card`: every host simulated (simboot.py), decoding as that model of the card's tables."""
    running = find(state_dir)
    if running:
        return running
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "server.json").unlink(missing_ok=True)
    argv = [sys.executable, "-m", "fleet.localcloud.server", "--state-dir", str(state_dir), "--port", str(port)]
    if offers_dir:
        argv += ["--offers-dir", str(offers_dir)]
    if provision_delay_s is not None:
        argv += ["--provision-delay", str(provision_delay_s)]
    if loading_delay_s is not None:
        argv += ["--loading-delay", str(loading_delay_s)]
    if hub_bytes_per_s is not None:
        argv += ["--hub-bytes-per-s", str(hub_bytes_per_s)]
    if kind:
        argv.append("--kind")
    if simulated_card:
        argv += ["--simulated-card", simulated_card]
    for repo, directory in (publish or {}).items():
        argv += ["--publish", f"{repo}={directory}"]
    with (state_dir / "server.log").open("ab") as log:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise CloudControlError(
                f"the local cloud exited with status {process.returncode}; see {state_dir / 'server.log'}"
            )
        info = find(state_dir)
        if info:
            try:
                httpx.get(f"{info.url}/health", timeout=2.0).raise_for_status()
                return info
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    stop_pid(process.pid)
    raise CloudControlError(f"the local cloud did not start within {timeout_s:.0f}s; see {state_dir / 'server.log'}")


def stop_pid(pid: int, timeout_s: float = 30.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            if not _alive(pid):
                return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def stop(state_dir: Path) -> bool:
    """Stop the cloud (every host's processes end; instances stay recorded). False if it was not running."""
    info = find(state_dir)
    if info is None:
        return False
    stop_pid(info.pid)
    return True


def status(state_dir: Path) -> dict[str, object]:
    info = find(state_dir)
    if info is None:
        return {
            "running": False,
            "url": None,
            "api_key_file": str(state_dir / "api_key"),
            "state_dir": str(state_dir),
            "instances": None,
        }
    for _ in range(10):  # the listing is rate limited like vast.ai's: one a second per key
        response = httpx.get(
            f"{info.url}/api/v1/instances/",
            params={"limit": "1"},
            headers={"Authorization": f"Bearer {info.api_key()}"},
            timeout=10.0,
        )
        if response.status_code != 429:
            break
        time.sleep(float(response.headers.get("Retry-After") or 1.1))
    response.raise_for_status()
    return {
        "running": True,
        "url": info.url,
        "pid": info.pid,
        "api_key_file": str(info.api_key_file),
        "state_dir": str(state_dir),
        "instances": response.json()["total_instances"],
    }
