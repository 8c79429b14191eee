"""SSH to hosts with asyncssh: our own key, the host key pinned at first contact, argv never a
hand-built shell string (each command is shlex-joined), secrets only on stdin."""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

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


MAX_OUTPUT = 1 << 20  # bytes fleet reads from one stream of one command on a host
MAX_LINE = 16 * 1024  # the longest line a streamed command may print


@dataclass(frozen=True)
class Completed:
    stdout: str
    stderr: str
    exit_status: int


async def run(
    conn: asyncssh.SSHClientConnection,
    argv: list[str],
    *,
    stdin: str | None = None,
    timeout_s: float | None = None,
    check: bool = True,
) -> Completed:
    """Run argv on the host; raise RemoteError with its stderr when it fails (`check`; else its exit status is
    the caller's to read). What the host writes back is read up to MAX_OUTPUT a stream, within `timeout_s` in
    all: a host that floods or drips is an error."""
    try:
        async with asyncio.timeout(timeout_s):
            process = await start_process(conn, argv, stdin)
            try:
                stdout, stderr = await asyncio.gather(
                    _read_capped(process.stdout, argv[0]), _read_capped(process.stderr, argv[0])
                )
                await process.wait()
            finally:
                process.close()
    except TimeoutError:
        raise RemoteError(f"{argv[0]} did not finish within {timeout_s:.0f}s") from None
    status = process.exit_status if process.exit_status is not None else -1
    if status != 0 and check:
        err = stderr.strip().splitlines()
        raise RemoteError(f"{argv[0]} exited {status}: {err[-1][:300] if err else 'no error output'}")
    return Completed(stdout, stderr, status)


async def run_streaming(
    conn: asyncssh.SSHClientConnection,
    argv: list[str],
    on_line: Callable[[str], Awaitable[None] | None],
    *,
    stdin: str | None = None,
) -> str:
    """Run argv, calling on_line for each stdout line (none longer than MAX_LINE); return the last line.
    RemoteError on failure."""
    process = await start_process(conn, argv, stdin)
    try:
        errors_read = asyncio.ensure_future(_read_capped(process.stderr, argv[0]))
        last = ""
        try:
            async for line in lines_of(process.stdout, argv[0]):
                if not line:
                    continue
                last = line
                maybe = on_line(line)
                if maybe is not None:
                    await maybe
            stderr = await errors_read
        finally:
            errors_read.cancel()
        await process.wait()
    finally:
        process.close()
    if process.exit_status != 0:
        errors = [ln for ln in stderr.strip().splitlines() if ln.startswith("error")] or stderr.splitlines()
        raise RemoteError(
            f"{argv[0]} exited {process.exit_status}: {errors[-1][:300] if errors else 'no error output'}"
        )
    return last


async def start_process(
    conn: asyncssh.SSHClientConnection, argv: list[str], stdin: str | None
) -> asyncssh.SSHClientProcess:
    """argv started on the host (shlex-joined), `stdin` written to it and closed. Its output is text, with
    bytes that are not UTF-8 replaced: what a host prints is never trusted to be well formed."""
    process = await conn.create_process(
        shlex.join(argv), stdin=asyncssh.PIPE if stdin is not None else asyncssh.DEVNULL, errors="replace"
    )
    if stdin is not None:
        process.stdin.write(stdin)
        process.stdin.write_eof()
    return process


async def _read_capped(stream: asyncssh.SSHReader, what: str) -> str:
    parts: list[str] = []
    size = 0
    while chunk := await stream.read(65536):
        size += len(chunk)
        if size > MAX_OUTPUT:
            raise RemoteError(f"{what} wrote more than {MAX_OUTPUT} bytes")
        parts.append(chunk)
    return "".join(parts)


async def lines_of(stream: asyncssh.SSHReader, what: str) -> AsyncIterator[str]:
    """A host's output line by line; RemoteError for a line over MAX_LINE."""
    pending = ""
    while chunk := await stream.read(65536):
        pending += chunk
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line
        if len(pending) > MAX_LINE:
            raise RemoteError(f"{what} printed a line longer than {MAX_LINE} characters")
    if pending:
        yield pending
