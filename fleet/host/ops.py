"""What fleet does on a host over SSH: pull the model files, start the server, watch it come up.

Each step runs one of the image's host scripts (images/llama-server/host/) with an argv, never a
shell string built by hand; the API key travels on stdin, and the Hugging Face token goes to no host. A
step that fails raises PhaseFailed with the phase and why.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

import asyncssh
import httpx

from fleet.core.config import Profile
from fleet.engines import MODELS_DIR, RUN_DIR, TEMPLATE_FILE
from fleet.engines.registry import engine_of
from fleet.host import hubfile
from fleet.host.phase import DiskFull, PhaseFailed
from fleet.host.remote import RemoteError, run, run_streaming
from fleet.market import DISK_FULL
from fleet.probes.server import Server

# What a host's script may print as a number: ASCII digits, as many as a byte count or /proc's kB take
# ("²".isdigit() is true, and int() of 5,000 digits raises)
COUNT = re.compile(r"[0-9]{1,20}")
KIB = re.compile(r"[0-9]{1,13}")  # up to ~9 EB in kB: more than any machine holds

# How many times one file's pull may be given a fresh signed URL: each time only after the last one moved
# bytes (a pull that outlives its URL resumes where it was; one that never moves fails).
URL_RENEWALS = 5


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
    whose bytes stop growing for `stall_s` fails the pull then, not at the end of `timeout_s`. The host
    gets each file's signed URL and never the token (hubfile.resolve)."""
    paths: dict[str, str] = {}
    try:
        async with asyncio.timeout(timeout_s):
            for f in profile.files:
                url = f"{hub_url}/{f.repo}/resolve/{f.revision}/{f.file}"
                dest = f"{MODELS_DIR}/{f.file}"
                await pull_file(conn, url, f.file, dest, hf_token, f.sha256, connections, stall_s, progress)
                paths[f.key] = dest
    except TimeoutError:
        raise PhaseFailed("pull", f"not done after {timeout_s:g}s (timeouts.pull)") from None
    return paths


async def pull_file(
    conn: asyncssh.SSHClientConnection,
    url: str,
    name: str,
    dest: str,
    hf_token: str,
    sha256: str | None,
    connections: int,
    stall_s: float,
    progress: Callable[[str, int, int], None],
) -> int:
    """One file from the hub's `url` to `dest` on the host by fleet-pull (aria2c, then its sha256 checked
    against the hub's and `sha256` where given), a fresh signed URL for each renewal; its size."""
    hub_file = await hubfile.resolve(url, hf_token, pinned_sha256=sha256)
    pulled = _FilePull(name, hub_file.size, progress)
    for renewal in range(URL_RENEWALS + 1):
        grown_to = pulled.moved_to
        try:
            last = await pulled.run(conn, hub_file, dest, connections, stall_s)
            break
        except RemoteError as e:
            if DISK_FULL.search(str(e)):
                raise DiskFull(
                    "pull",
                    f"{e} (the disk holds the image too: the profile's disk_gb may be too small, or the image larger"
                    " than provider.image_gb says)",
                ) from None
            if pulled.moved_to <= grown_to or renewal == URL_RENEWALS:
                raise PhaseFailed("pull", str(e)) from None
            # a long pull outlives its signed URL
            hub_file = await hubfile.resolve(url, hf_token, pinned_sha256=sha256)
    if last != f"ok {hub_file.sha256} {hub_file.size}":
        raise PhaseFailed("pull", f"{name}: unexpected result {last[:120]!r}")
    progress(name, hub_file.size, hub_file.size)
    return hub_file.size


class _FilePull:
    """One file's fleet-pull runs on a host, and what their progress lines said."""

    def __init__(self, name: str, total: int, progress: Callable[[str, int, int], None]) -> None:
        self.name, self.total, self._progress = name, total, progress
        self.moved_to = -1  # the largest size the file has reached
        self._moved_at = time.monotonic()
        self._shown_at = 0.0

    def on_line(self, line: str) -> None:
        if not line.startswith("progress "):
            return
        words = line.split()
        if len(line) > 80 or len(words) != 2 or not COUNT.fullmatch(words[1]):
            # the host's script says what no fleet-pull says: this machine is not to be believed
            raise PhaseFailed("pull", f"fleet-pull's progress is garbage: {line[:80]!r}")
        done = int(words[1])
        if done > self.moved_to:
            self.moved_to, self._moved_at = done, time.monotonic()
        if time.monotonic() - self._shown_at > 1.0:
            self._shown_at = time.monotonic()
            self._progress(self.name, done, self.total)

    async def run(
        self, conn: asyncssh.SSHClientConnection, hub_file: hubfile.HubFile, dest: str, connections: int, stall_s: float
    ) -> str:
        """fleet-pull's last line; RemoteError when it fails; PhaseFailed when the file stops growing."""
        argv = ["fleet-pull", hub_file.download_url, hub_file.sha256, dest, str(connections)]
        self._moved_at = time.monotonic()
        stream = asyncio.ensure_future(run_streaming(conn, argv, self.on_line))
        while not stream.done():
            await asyncio.wait({stream}, timeout=1.0)
            if not stream.done() and time.monotonic() - self._moved_at > stall_s:
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)
                raise PhaseFailed("pull", f"{self.name}: no progress for {stall_s:g}s (timeouts.pull_stall)")
        return stream.result()


async def kept_files(
    conn: asyncssh.SSHClientConnection, profile: Profile, hub_url: str, hf_token: str
) -> dict[str, str]:
    """A standby host's files, on the disk it kept while stopped: each verified by sha256 before the stop,
    now checked for its size against the hub's (a hash of 15-20 GB would cost a resume most of its gain)."""
    paths: dict[str, str] = {}
    for f in profile.files:
        size = (await hubfile.resolve(f"{hub_url}/{f.repo}/resolve/{f.revision}/{f.file}", hf_token)).size
        dest = f"{MODELS_DIR}/{f.file}"
        try:
            result = await run(conn, ["stat", "-c", "%s", dest], timeout_s=30)
        except RemoteError as e:
            raise PhaseFailed("pull", f"{f.file}: not on the kept disk ({e})") from None
        have = str(result.stdout or "").strip()
        if have != str(size):
            raise PhaseFailed("pull", f"{f.file}: {have[:40]} bytes on the kept disk, the hub says {size}")
        paths[f.key] = dest
    return paths


async def start_server(
    conn: asyncssh.SSHClientConnection,
    profile: Profile,
    port: int,
    files: dict[str, str],
    server: Server,
    timeout_s: float,
    chat_template: str | None = None,
) -> None:
    """Put the profile's chat template on the host (its text on stdin), start its server (the key on stdin)
    and wait for /health over verified TLS; fail fast when it dies."""
    try:
        if chat_template is not None:
            put = 'mkdir -p "$1" && chmod 700 "$1" && cat > "$2"'
            await run(conn, ["sh", "-c", put, "sh", RUN_DIR, TEMPLATE_FILE], stdin=chat_template, timeout_s=60)
        await run(
            conn,
            ["fleet-serve", RUN_DIR, "--", *engine_of(profile).server_argv(profile, port, files)],
            stdin=f"{server.api_key}\n",
            timeout_s=60,
        )
    except RemoteError as e:
        raise PhaseFailed("start", str(e)) from None
    deadline = time.monotonic() + timeout_s
    async with server.without_key().client(timeout=5) as client:
        polls = 0
        while time.monotonic() < deadline:
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.ConnectError as e:
                if isinstance(e.__context__, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(e):
                    # not the certificate fleet signed for this host: someone in the middle, or the host lying
                    why = f"the server's certificate does not verify against fleet's CA: {e}"
                    raise PhaseFailed("start", why) from None
            except httpx.TransportError:
                pass
            polls += 1
            if polls % 20 == 0 and not await server_alive(conn, profile):
                name = engine_of(profile).server_name
                raise PhaseFailed("start", f"{name} exited: {await server_log_tail(conn, profile)}")
            await asyncio.sleep(0.1)
    tail = await server_log_tail(conn, profile)
    raise PhaseFailed("start", f"no /health 200 after {timeout_s:g}s (timeouts.load): {tail}")


async def server_alive(conn: asyncssh.SSHClientConnection, profile: Profile) -> bool:
    pid = f"{RUN_DIR}/{engine_of(profile).pid_file}"
    try:
        await run(conn, ["sh", "-c", 'kill -0 "$(cat "$1")"', "sh", pid], timeout_s=30)
    except RemoteError:
        return False
    return True


async def server_log_tail(conn: asyncssh.SSHClientConnection, profile: Profile) -> str:
    try:
        result = await run(conn, ["tail", "-n", "3", f"{RUN_DIR}/{engine_of(profile).log_file}"], timeout_s=30)
    except RemoteError:
        return "no log"
    return " | ".join(str(result.stdout or "").strip().splitlines()) or "no log"


@dataclass(frozen=True)
class HostMemory:
    total_mib: float  # the machine's RAM as /proc/meminfo says (a container sees the machine's)
    available_mib: float
    server_rss_mib: float | None  # None: the server is not running


# the machine's meminfo, then the server's resident set (nothing when its process is gone)
_MEMORY = (
    'grep -E "^(MemTotal|MemAvailable):" /proc/meminfo; grep "^VmRSS:" "/proc/$(cat "$1")/status" 2>/dev/null; true'
)


async def read_memory(conn: asyncssh.SSHClientConnection, profile: Profile, timeout_s: float) -> HostMemory:
    """The host's RAM and its server's resident set. What the host prints is a stranger's: only the three
    lines asked for are read, each a finite number of kB, or RemoteError."""
    result = await run(
        conn, ["sh", "-c", _MEMORY, "sh", f"{RUN_DIR}/{engine_of(profile).pid_file}"], timeout_s=timeout_s
    )
    return parse_memory(str(result.stdout or ""))


def parse_memory(text: str) -> HostMemory:
    """_MEMORY's output, strictly: RemoteError for anything else."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        number, _, unit = value.strip().partition(" ")
        if (
            name not in ("MemTotal", "MemAvailable", "VmRSS")
            or name in found
            or unit != "kB"
            or not KIB.fullmatch(number)
        ):
            raise RemoteError(f"the host's memory read is not /proc's: {line[:80]!r}")
        found[name] = int(number) / 1024
    if "MemTotal" not in found or "MemAvailable" not in found:
        raise RemoteError("the host's /proc/meminfo names no MemTotal or MemAvailable")
    total = found["MemTotal"]
    if found["MemAvailable"] > total or found.get("VmRSS", 0) > total:
        raise RemoteError("the host's memory read holds more than its total")
    return HostMemory(total, found["MemAvailable"], found.get("VmRSS"))
