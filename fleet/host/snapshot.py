"""A repository snapshot onto a vLLM host: each weights file (in LFS) pulled by the host with aria2c and its
hub sha256 checked, as a GGUF is; each small file (config, tokenizer, template: kept in git, with no sha256 on
the hub) fetched here, checked against its git blob id, and written there by fleet-put with the sha256 of
the bytes fleet sent. The host never sees the hub's token. All of them land in one directory, the one the
server loads, named by the repository."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import Callable

import asyncssh

from fleet.engines import MODELS_DIR
from fleet.host.ops import pull_file
from fleet.host.phase import PhaseFailed
from fleet.host.remote import RemoteError, run
from fleet.plan.snapshot import RepoFile, Snapshot, SnapshotError, small_file


def directory(snapshot: Snapshot) -> str:
    """Where the host keeps the repository: under models/, by its name and commit (a standby host resumed
    after its branch moved finds no directory of the new commit, and is not served stale files)."""
    return f"{MODELS_DIR}/{snapshot.repo.replace('/', '--')}@{snapshot.commit}"


def wanted(snapshot: Snapshot) -> list[RepoFile]:
    """The files a server loads; PhaseFailed when the repository holds no config or no weights."""
    files = list(snapshot.files)
    names = {f.name for f in files}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise PhaseFailed(
            "pull",
            f"{snapshot.repo}@{snapshot.commit[:12]} has no config.json or no safetensors",
            blacklist=False,
            retry=False,
        )
    return files


async def pull_snapshot(
    conn: asyncssh.SSHClientConnection,
    snapshot: Snapshot,
    hub_url: str,
    hf_token: str,
    connections: int,
    timeout_s: float,
    progress: Callable[[str, int, int], None],
    stall_s: float = 120.0,
) -> dict[str, str]:
    """Every file the server loads onto the host; {"main": the directory}."""
    where = directory(snapshot)
    try:
        async with asyncio.timeout(timeout_s):
            for f in wanted(snapshot):
                dest = f"{where}/{f.name}"
                if f.in_lfs:
                    url = snapshot.resolve_url(hub_url, f.name)
                    await pull_file(conn, url, f.name, dest, hf_token, f.sha256, connections, stall_s, progress)
                else:
                    await put_small_file(conn, hub_url, snapshot, f, dest, hf_token)
                    progress(f.name, f.size, f.size)
    except TimeoutError:
        raise PhaseFailed("pull", f"not done after {timeout_s:g}s (timeouts.pull)") from None
    return {"main": where}


async def put_small_file(
    conn: asyncssh.SSHClientConnection, hub_url: str, snapshot: Snapshot, f: RepoFile, dest: str, hf_token: str
) -> None:
    try:
        data = await small_file(hub_url, snapshot, f, hf_token)
    except SnapshotError as e:
        raise PhaseFailed("pull", str(e), blacklist=False) from None
    sha256 = hashlib.sha256(data).hexdigest()
    try:
        result = await run(conn, ["fleet-put", dest, sha256], stdin=base64.b64encode(data).decode(), timeout_s=120)
    except RemoteError as e:
        raise PhaseFailed("pull", f"{f.name}: {e}") from None
    if str(result.stdout or "").strip() != f"ok {sha256} {len(data)}":
        raise PhaseFailed("pull", f"{f.name}: fleet-put answered {str(result.stdout)[:120]!r}")


async def kept_snapshot(conn: asyncssh.SSHClientConnection, snapshot: Snapshot) -> dict[str, str]:
    """A standby host's repository on the disk it kept: each file the size the listing gives (each was
    verified before the stop)."""
    where = directory(snapshot)
    for f in wanted(snapshot):
        try:
            result = await run(conn, ["stat", "-c", "%s", f"{where}/{f.name}"], timeout_s=30)
        except RemoteError as e:
            raise PhaseFailed("pull", f"{f.name}: not on the kept disk ({e})") from None
        have = str(result.stdout or "").strip()
        if have != str(f.size):
            raise PhaseFailed("pull", f"{f.name}: {have[:40]} bytes on the kept disk, the hub lists {f.size}")
    return {"main": where}
