"""SSH to hosts with asyncssh: our own key, the host key pinned at first contact, argv never a
hand-built shell string (each command is shlex-joined), secrets only on stdin."""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Awaitable, Callable

import asyncssh

from fleet.core.errors import FleetError
from fleet.core.keys import SshKey


class RemoteError(FleetError, RuntimeError):
    pass


class HostKeyMismatch(RemoteError):
    """The host presented a key other than the one pinned at first contact."""


async def connect(
    host: str, port: int, key: SshKey, pinned_host_key: str | None, timeout_s: float, *, settling: bool = False
) -> tuple[asyncssh.SSHClientConnection, str]:
    """Connect as root, retrying until `timeout_s` (sshd may still be starting).

    With `pinned_host_key` None, the first key seen is accepted and returned (only a host fleet did not
    rent itself has no pinned key); otherwise only that key is accepted. `settling`: a host just booted
    may present its platform's key until onstart installs the pinned one: another key is tried again
    until `timeout_s`, then refused as a mismatch.
    """
    known_hosts: object = None
    if pinned_host_key:
        known_hosts = ([asyncssh.import_public_key(pinned_host_key)], [], [])
    deadline = asyncio.get_running_loop().time() + timeout_s
    last: Exception | None = None
    while True:
        try:
            conn = await asyncssh.connect(
                host,
                port=port,
                username="root",
                client_keys=[str(key.private)],
                known_hosts=known_hosts,
                connect_timeout=min(10.0, timeout_s),
                keepalive_interval=30,
                # a stranger's root is on the other end: nothing of the operator's own SSH setup goes there
                # (no ~/.ssh/config, whose ForwardAgent would hand it the operator's agent; no agent at all)
                config=None,
                agent_path=None,
                agent_forwarding=False,
            )
            presented = conn.get_server_host_key()
            assert presented is not None
            return conn, presented.export_public_key().decode().strip()
        except asyncssh.HostKeyNotVerifiable as e:
            mismatch = HostKeyMismatch(f"{host}:{port} presented a host key other than the pinned one")
            if not settling or asyncio.get_running_loop().time() >= deadline:
                raise mismatch from e
            last = mismatch
        except (TimeoutError, OSError, asyncssh.Error) as e:
            last = e
        if asyncio.get_running_loop().time() >= deadline:
            if isinstance(last, HostKeyMismatch):
                raise last  # it answered, for the whole wait, with a key fleet did not make for it
            raise RemoteError(f"SSH to {host}:{port} failed: {type(last).__name__}: {last}")
        await asyncio.sleep(0.5)


async def run(
    conn: asyncssh.SSHClientConnection,
    argv: list[str],
    *,
    stdin: str | None = None,
    timeout_s: float | None = None,
) -> asyncssh.SSHCompletedProcess:
    """Run argv on the host; raise RemoteError with its stderr when it fails."""
    command = shlex.join(argv)
    try:
        result = await asyncio.wait_for(conn.run(command, input=stdin, check=False), timeout_s)
    except TimeoutError:
        raise RemoteError(f"{argv[0]} did not finish within {timeout_s:.0f}s") from None
    if result.exit_status != 0:
        err = str(result.stderr or "").strip().splitlines()
        raise RemoteError(f"{argv[0]} exited {result.exit_status}: {err[-1] if err else 'no error output'}")
    return result


async def run_streaming(
    conn: asyncssh.SSHClientConnection,
    argv: list[str],
    on_line: Callable[[str], Awaitable[None] | None],
    *,
    stdin: str | None = None,
) -> str:
    """Run argv, calling on_line for each stdout line; return the last line. RemoteError on failure."""
    process = await conn.create_process(shlex.join(argv), stdin=asyncssh.PIPE if stdin else asyncssh.DEVNULL)
    if stdin:
        process.stdin.write(stdin)
        process.stdin.write_eof()
    last = ""
    async for line in process.stdout:
        line = line.rstrip("\n")
        if not line:
            continue
        last = line
        maybe = on_line(line)
        if maybe is not None:
            await maybe
    stderr = await process.stderr.read()
    await process.wait()
    if process.exit_status != 0:
        errors = [ln for ln in str(stderr).strip().splitlines() if ln.startswith("error")] or str(stderr).splitlines()
        raise RemoteError(f"{argv[0]} exited {process.exit_status}: {errors[-1] if errors else 'no error output'}")
    return last
