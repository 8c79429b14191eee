"""The HAProxy process of a gateway instance: started by fleet with the configuration it rendered, known
by its pid file (and its command line, which names that configuration), stopped by that PID alone."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

from fleet.core.config import Settings
from fleet.core.errors import BadInput, FleetError
from fleet.core.files import write_public
from fleet.gateway import answers
from fleet.gateway.files import GatewayCa, GatewayFiles, prepare
from fleet.gateway.haproxy import CALL_KEY_ENV, SALT_KEY_ENV, render
from fleet.gateway.runtime import Runtime, RuntimeApiError
from fleet.gateway.targets import Target

START_TIMEOUT_S = 10.0
# HAProxy's alert for a port another process holds: "cannot bind socket (Address already in use) for [ADDR:PORT]"
TAKEN = re.compile(r"Address already in use\) for \[([^\]]+)\]")


class GatewayError(FleetError):
    """HAProxy would not start, or would not stop."""


def haproxy_binary() -> str:
    # root's PATH names /usr/sbin; another user's may not
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")
    if found is None:
        raise GatewayError("HAProxy is not installed (Debian's haproxy package: scripts/setup installs it)")
    return found


def running_pid(files: GatewayFiles) -> int | None:
    """The PID of this instance's HAProxy, if it runs: the pid file's, and only while that process's
    command line names this instance's configuration (a PID is reused once its process is gone)."""
    _writers[:] = [w for w in _writers if w.poll() is None]
    try:
        pid = int(files.pidfile.read_text().split()[0])
        child = _children.get(pid)
        if child is not None and child.poll() is not None:
            del _children[pid]  # this process started it, and it ended: reaped, so its PID is free again
            return None
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return None
    return pid if str(files.config).encode() in cmdline else None


def write_configuration(files: GatewayFiles, settings: Settings, targets: list[Target], ca: GatewayCa) -> None:
    prepare(files, settings, ca)
    for target in targets:
        write_public(files.models(target.index), json.dumps(answers.models(target.alias)).encode())
        write_public(files.model(target.index), json.dumps(answers.model(target.alias)).encode())
    write_public(files.config, render(settings, targets, files, str(ca.certificate_path)).encode())


async def start(
    files: GatewayFiles,
    settings: Settings,
    targets: list[Target],
    ca: GatewayCa,
    call_key: bytes | None = None,
    salt_key: bytes | None = None,
) -> int:
    """Start HAProxy for these targets (nothing when it runs already); its PID once its admin socket answers.

    HAProxy runs in the foreground of a session of its own, its standard output appended to the access log
    (a line a request, no content: haproxy.py's log format) and its alerts to haproxy.err: a daemonised HAProxy
    has no standard output to log to. fleet writes the pid file itself."""
    pid = running_pid(files)
    if pid is not None:
        return pid
    binary = haproxy_binary()
    # the access log's key for calls' names and the agents' cache salts' (fleet's own, derived: the same on
    # every gateway of the install); none given, one of this run's alone
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        CALL_KEY_ENV: base64.b64encode(call_key or secrets.token_bytes(32)).decode(),
        SALT_KEY_ENV: base64.b64encode(salt_key or secrets.token_bytes(32)).decode(),
    }
    overflow = settings.gateway.overflow
    if overflow.url:
        key = os.environ.get(overflow.key_env)
        if not key:
            raise BadInput(f"gateway.overflow: set {overflow.key_env} to the overflow provider's key")
        env[overflow.key_env] = key  # HAProxy's environment alone holds it: not its config file, not its argv
    write_configuration(files, settings, targets, ca)
    files.socket.unlink(missing_ok=True)
    writer = _log_writer(files)
    errors = _append_private(files.errors, truncate=True)
    try:
        process = subprocess.Popen(
            [binary, "-db", "-f", str(files.config)],
            env=env, stdin=subprocess.DEVNULL, stdout=writer.stdin, stderr=errors, start_new_session=True,
        )  # fmt: skip
    finally:
        assert writer.stdin is not None
        writer.stdin.close()  # HAProxy holds the pipe's one writing end: the writer ends when HAProxy does
        os.close(errors)
    _children[process.pid] = process  # reaped when it ends, so that its PID never reads as a live HAProxy
    _writers.append(writer)
    write_public(files.pidfile, f"{process.pid}\n".encode())
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            files.pidfile.unlink(missing_ok=True)
            said = files.errors.read_text(errors="replace").splitlines()
            alerts = [line for line in said if "ALERT" in line] or said[-1:] or [f"exit status {process.returncode}"]
            if taken := next((m for line in alerts if (m := TAKEN.search(line))), None):
                raise GatewayError(
                    f"the gateway's address {taken.group(1)[:80]} is taken by another process (another fleet "
                    "install's gateway?): give this install its own [gateway] port (and [[serve]] ports)"
                )
            raise GatewayError(f"HAProxy did not start: {alerts[0][:300]}")
        if files.socket.exists() and running_pid(files) == process.pid and await _answers(files.socket):
            return process.pid
        await asyncio.sleep(0.05)
    raise GatewayError(f"HAProxy started but its admin socket {files.socket} did not appear in {START_TIMEOUT_S:g}s")


async def _answers(socket: Path) -> bool:
    """HAProxy serves its admin socket once every listener is bound: the socket's file appears at its own bind,
    before a frontend whose port is taken ends the process (a busy machine once saw the file, took the start
    for done, and met a refused socket instead of the port's one line)."""
    try:
        (said,) = await Runtime(socket).run("show info")
    except RuntimeApiError:
        return False
    return "Pid:" in said


_children: dict[int, subprocess.Popen] = {}
_writers: list[subprocess.Popen] = []  # the access logs' writers, reaped once their HAProxy has ended


def _log_writer(files: GatewayFiles) -> subprocess.Popen:
    """What HAProxy's standard output (the access log) goes through: a pipe to `cat`, whose descriptor appends.
    HAProxy's own descriptor loses O_APPEND (it sets O_NONBLOCK with F_SETFL alone), so each restart wrote from
    offset 0 over the lines before, and a copytruncate rotation left the file full of NULs."""
    log = _append_private(files.access_log)
    try:
        return subprocess.Popen(
            [shutil.which("cat") or "/bin/cat"],
            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    finally:
        os.close(log)


def _append_private(path: Path, truncate: bool = False) -> int:
    """A descriptor that appends to `path`, a file of this user's alone (never through a link)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_TRUNC if truncate else os.O_APPEND)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


async def stop(files: GatewayFiles, grace_s: float = 0.0) -> int | None:
    """Stop this instance's HAProxy: a soft stop first (the calls in flight finish) for `grace_s`, then a hard
    one. The PID it stopped, or None when none ran."""
    pid = running_pid(files)
    if pid is None:
        return None
    os.kill(pid, signal.SIGUSR1 if grace_s > 0 else signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while running_pid(files) == pid and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if running_pid(files) == pid:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + START_TIMEOUT_S
    while _alive(pid):
        if time.monotonic() > deadline:
            raise GatewayError(f"HAProxy (pid {pid}) did not stop within {START_TIMEOUT_S:g}s of SIGTERM")
        await asyncio.sleep(0.05)
    files.pidfile.unlink(missing_ok=True)
    files.socket.unlink(missing_ok=True)
    shutil.rmtree(files.doors, ignore_errors=True)
    return pid


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
