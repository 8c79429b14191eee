"""What fleet does on a host over SSH: pull the model files, start the server, watch it come up.

Each step runs one of the image's host scripts (images/llama-server/host/) with an argv, never a
shell string built by hand; secrets (the Hugging Face token, the API key) travel on stdin. A step that
fails raises PhaseFailed with the phase and why.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable

import asyncssh
import httpx

from fleet.core.config import Profile
from fleet.core.errors import FleetError
from fleet.engines import MODELS_DIR, RUN_DIR, TEMPLATE_FILE
from fleet.engines.llama_server import server_argv
from fleet.host.remote import RemoteError, run, run_streaming


class PhaseFailed(FleetError):
    """A phase of a bring-up failed: destroy the instance and try the next offer. `blacklist`: the machine
    is to blame (not the marketplace's answer), so it is not tried again for a while. `retry` false: the
    software or the profile is to blame (the server build, the template, the flags), so every other
    machine would fail the same: the bring-up stops instead of renting the next offer."""

    def __init__(self, phase: str, reason: str, *, blacklist: bool = True, retry: bool = True) -> None:
        super().__init__(f"{phase}: {reason}")
        self.phase = phase
        self.reason = reason
        self.blacklist = blacklist
        self.retry = retry


async def linked_etag(url: str, hf_token: str) -> tuple[str, int]:
    """The sha256 and size the hub states for a file, from its first (redirect) answer."""
    headers = {"Authorization": f"Bearer {hf_token}"} if hf_token else {}
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.head(url, headers=headers, follow_redirects=False)
    etag = (r.headers.get("X-Linked-Etag") or "").strip('"')
    size = r.headers.get("X-Linked-Size")
    if r.status_code >= 400 or not re.fullmatch(r"[0-9a-f]{64}", etag) or not size:
        raise PhaseFailed("pull", f"the hub gave no sha256 for {url} (HTTP {r.status_code})")
    return etag, int(size)


async def pull_files(
    conn: asyncssh.SSHClientConnection,
    profile: Profile,
    hub_url: str,
    hf_token: str,
    connections: int,
    timeout_s: float,
    progress: Callable[[str, int, int], None],
    stall_s: float = 120.0,
) -> dict[str, str]:
    """Every file of the profile, with aria2c and its sha256 checked; file key -> path on the host. A file
    whose bytes stop growing for `stall_s` fails the pull then, not at the end of `timeout_s`."""
    paths: dict[str, str] = {}
    try:
        async with asyncio.timeout(timeout_s):
            for f in profile.files:
                url = f"{hub_url}/{f.repo}/resolve/{f.revision}/{f.file}"
                sha256, size = await linked_etag(url, hf_token)
                dest = f"{MODELS_DIR}/{f.file}"
                shown = [0.0]
                moved = [time.monotonic(), -1.0]  # when the file last grew, and to what size

                def on_line(
                    line: str, name: str = f.file, total: int = size, shown: list[float] = shown, moved: list = moved
                ) -> None:
                    if not line.startswith("progress "):
                        return
                    words = line.split()
                    if len(line) > 80 or len(words) != 2 or not words[1].isdigit():
                        # the host's script says what no fleet-pull says: this machine is not to be believed
                        raise PhaseFailed("pull", f"fleet-pull's progress is garbage: {line[:80]!r}")
                    done = int(words[1])
                    if done > moved[1]:
                        moved[:] = [time.monotonic(), done]
                    if time.monotonic() - shown[0] > 1.0:
                        shown[0] = time.monotonic()
                        progress(name, done, total)

                # The token travels on stdin into the script's environment, never on a command line.
                argv = [
                    "sh",
                    "-c",
                    'IFS= read -r HF_TOKEN; export HF_TOKEN; exec fleet-pull "$@"',
                    "fleet-pull",
                    url,
                    sha256,
                    dest,
                    str(connections),
                ]
                stream = asyncio.ensure_future(run_streaming(conn, argv, on_line, stdin=hf_token + "\n"))
                while not stream.done():
                    await asyncio.wait({stream}, timeout=1.0)
                    if not stream.done() and time.monotonic() - moved[0] > stall_s:
                        stream.cancel()
                        await asyncio.gather(stream, return_exceptions=True)
                        raise PhaseFailed("pull", f"{f.file}: no progress for {stall_s:g}s (timeouts.pull_stall)")
                last = stream.result()
                if last != f"ok {sha256} {size}":
                    raise PhaseFailed("pull", f"{f.file}: unexpected result {last!r}")
                progress(f.file, size, size)
                paths[f.key] = dest
    except TimeoutError:
        raise PhaseFailed("pull", f"not done after {timeout_s:g}s (timeouts.pull)") from None
    except RemoteError as e:
        raise PhaseFailed("pull", str(e)) from None
    return paths


async def kept_files(
    conn: asyncssh.SSHClientConnection, profile: Profile, hub_url: str, hf_token: str
) -> dict[str, str]:
    """A standby host's files, on the disk it kept while stopped: each verified by sha256 before the stop,
    now checked for its size against the hub's (a hash of 15-20 GB would cost a resume most of its gain)."""
    paths: dict[str, str] = {}
    for f in profile.files:
        _, size = await linked_etag(f"{hub_url}/{f.repo}/resolve/{f.revision}/{f.file}", hf_token)
        dest = f"{MODELS_DIR}/{f.file}"
        try:
            result = await run(conn, ["stat", "-c", "%s", dest], timeout_s=30)
        except RemoteError as e:
            raise PhaseFailed("pull", f"{f.file}: not on the kept disk ({e})") from None
        have = str(result.stdout or "").strip()
        if have != str(size):
            raise PhaseFailed("pull", f"{f.file}: {have} bytes on the kept disk, the hub says {size}")
        paths[f.key] = dest
    return paths


async def start_server(
    conn: asyncssh.SSHClientConnection,
    profile: Profile,
    port: int,
    files: dict[str, str],
    api_key: str,
    api_url: str,
    timeout_s: float,
    chat_template: str | None = None,
) -> None:
    """Put the profile's chat template on the host (its text on stdin), start llama-server (the key on
    stdin) and wait for /health; fail fast when it dies."""
    try:
        if chat_template is not None:
            put = 'mkdir -p "$1" && chmod 700 "$1" && cat > "$2"'
            await run(conn, ["sh", "-c", put, "sh", RUN_DIR, TEMPLATE_FILE], stdin=chat_template, timeout_s=60)
        await run(
            conn, ["fleet-serve", RUN_DIR, "--", *server_argv(profile, port, files)], stdin=api_key + "\n", timeout_s=60
        )
    except RemoteError as e:
        raise PhaseFailed("start", str(e)) from None
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as client:
        polls = 0
        while time.monotonic() < deadline:
            try:
                if (await client.get(f"{api_url}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            polls += 1
            if polls % 20 == 0 and not await server_alive(conn):
                raise PhaseFailed("start", f"llama-server exited: {await server_log_tail(conn)}")
            await asyncio.sleep(0.1)
    raise PhaseFailed("start", f"no /health 200 after {timeout_s:g}s (timeouts.load): {await server_log_tail(conn)}")


async def server_alive(conn: asyncssh.SSHClientConnection) -> bool:
    try:
        await run(conn, ["sh", "-c", 'kill -0 "$(cat "$1/llama-server.pid")"', "sh", RUN_DIR], timeout_s=30)
    except RemoteError:
        return False
    return True


async def server_log_tail(conn: asyncssh.SSHClientConnection) -> str:
    try:
        result = await run(conn, ["tail", "-n", "3", f"{RUN_DIR}/llama-server.log"], timeout_s=30)
    except RemoteError:
        return "no log"
    return " | ".join(str(result.stdout or "").strip().splitlines()) or "no log"
