"""A Hugging Face repository at one commit, as the hub's API lists it, and the small files fleet reads itself.

`GET /api/models/{repo}/revision/{rev}?blobs=true` names the commit and every file: its size, its git blob
id and, for a file stored in LFS (the weights), its sha256. A small file kept in git (config.json, the
tokenizer) has no sha256 anywhere on the hub, only its blob id: fleet fetches it itself (the hub's token
stays here), checks the blob id, and hands a host the bytes with their sha256. Only the files a server loads
are kept (fleet/engines/vllm.py SNAPSHOT_FILES, at the top level, under a plain name): `.gitattributes`, a
README, pickles, the originals in a subdirectory, a name that could climb out of the model's directory are
left out, never a path on a host. What is kept is read strictly: a size that is not a count, a listing past
its bounds is a one-line error.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from dataclasses import dataclass

import httpx

from fleet.core.errors import FleetError
from fleet.engines.vllm import SNAPSHOT_FILES

MAX_LISTING = 4 << 20  # the API's answer for a repository of thousands of files is well under this
MAX_FILES = 2000
MAX_SMALL_FILE = 64 << 20  # git keeps files under 10 MB; a tokenizer.json of 33 MB is stored in LFS
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")
HEX40 = re.compile(r"[0-9a-f]{40}")
HEX64 = re.compile(r"[0-9a-f]{64}")


class SnapshotError(FleetError, ValueError):
    """The hub's listing of a repository, or one of its small files, is not what the hub serves."""

    prefix = "snapshot"


@dataclass(frozen=True)
class RepoFile:
    name: str
    size: int
    blob_id: str
    sha256: str | None  # LFS files alone; a small file's is computed from its bytes

    @property
    def in_lfs(self) -> bool:
        return self.sha256 is not None


@dataclass(frozen=True)
class Snapshot:
    repo: str
    commit: str
    files: tuple[RepoFile, ...]

    def resolve_url(self, hub_url: str, name: str) -> str:
        return f"{hub_url}/{self.repo}/resolve/{self.commit}/{name}"

    @property
    def weights_bytes(self) -> int:
        return sum(f.size for f in self.files if f.name.endswith(".safetensors"))


def parse_listing(data: bytes, repo: str, keep: tuple[str, ...] = SNAPSHOT_FILES) -> Snapshot:
    """The API's answer, strictly, with the files whose names match `keep` at the top level (a model loads
    from there). A repository that ships both puts its Hugging Face shards beside a `consolidated` file of
    another format: the shards are kept."""
    shown = f"the hub's listing of {repo}"
    if len(data) > MAX_LISTING:
        raise SnapshotError(f"{shown} runs past {MAX_LISTING >> 20} MiB")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise SnapshotError(f"{shown} is not JSON we read") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("siblings"), list):
        raise SnapshotError(f"{shown} has no list of files (siblings)")
    commit = doc.get("sha")
    if not isinstance(commit, str) or not HEX40.fullmatch(commit):
        raise SnapshotError(f"{shown} names no commit (sha: 40 hex digits)")
    siblings = doc["siblings"]
    if len(siblings) > MAX_FILES:
        raise SnapshotError(f"{shown} lists {len(siblings)} files; at most {MAX_FILES} are read")
    files: list[RepoFile] = []
    for entry in siblings:
        if not isinstance(entry, dict) or not isinstance(entry.get("rfilename"), str):
            raise SnapshotError(f"{shown}: a file without a name")
        name = entry["rfilename"]
        if not NAME.fullmatch(name) or name.startswith(".") or not any(fnmatch.fnmatchcase(name, p) for p in keep):
            continue
        size, blob = entry.get("size"), entry.get("blobId")
        if not _count(size) or not isinstance(blob, str) or not HEX40.fullmatch(blob):
            raise SnapshotError(f"{shown}: {name} has no size and blob id (the API's blobs=true)")
        lfs = entry.get("lfs")
        sha256 = None
        if lfs is not None:
            found = lfs.get("sha256") if isinstance(lfs, dict) else None
            if not isinstance(found, str) or not HEX64.fullmatch(found):
                raise SnapshotError(f"{shown}: {name} is in LFS without a sha256")
            if lfs.get("size") != size:
                raise SnapshotError(f"{shown}: {name}'s LFS size {str(lfs.get('size'))[:20]} is not its size {size}")
            sha256 = found
        elif size > MAX_SMALL_FILE:
            raise SnapshotError(f"{shown}: {name} holds {size} bytes outside LFS; at most {MAX_SMALL_FILE} are read")
        files.append(RepoFile(name, size, blob, sha256))
    shards = [f for f in files if f.name.endswith(".safetensors") and not f.name.startswith("consolidated")]
    if shards:
        files = [f for f in files if not (f.name.endswith(".safetensors") and f.name.startswith("consolidated"))]
    return Snapshot(repo, commit, tuple(files))


async def listing(hub_url: str, repo: str, revision: str, token: str = "", timeout_s: float = 30.0) -> Snapshot:
    """The repository at `revision` (a branch or a commit), as the hub lists it now."""
    url = f"{hub_url}/api/models/{repo}/revision/{revision}"
    body = await _get(url, {"blobs": "true"}, token, timeout_s, MAX_LISTING, f"the hub's listing of {repo}")
    return parse_listing(body, repo)


async def small_file(hub_url: str, snapshot: Snapshot, f: RepoFile, token: str = "", timeout_s: float = 60.0) -> bytes:
    """A file kept in git, its bytes checked against the blob id the listing gave."""
    shown = f"{snapshot.repo}/{f.name}"
    data = await _get(snapshot.resolve_url(hub_url, f.name), {}, token, timeout_s, f.size, shown)
    got = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
    if len(data) != f.size or got != f.blob_id:
        raise SnapshotError(f"{shown}: the hub served {len(data)} bytes of blob {got}, its listing says {f.blob_id}")
    return data


async def _get(url: str, params: dict[str, str], token: str, timeout_s: float, limit: int, shown: str) -> bytes:
    """A GET of the hub itself (no redirect followed, so the token goes nowhere else), at most `limit` bytes."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with (
            httpx.AsyncClient(timeout=timeout_s) as client,
            client.stream("GET", url, params=params, headers=headers) as r,
        ):
            if r.status_code in (301, 302, 303, 307, 308):
                # a renamed repository, or a file moved to LFS storage: say so (the token follows no redirect)
                where = r.headers.get("Location", "")[:120]
                raise SnapshotError(f"{shown}: the hub redirects it to {where!r}; name the repository as it is now")
            if r.status_code in (401, 403):
                where = "$HF_TOKEN or the variable hub.token_env names"
                why = f"the token in {where} does not open it" if token else f"gated or private, and {where} is empty"
                raise SnapshotError(f"{shown}: HTTP {r.status_code}: the hub refuses it ({why})")
            if r.status_code != 200:
                code = r.headers.get("X-Error-Code", "")[:40]
                raise SnapshotError(f"{shown}: HTTP {r.status_code} {code}".rstrip())
            body = bytearray()
            async for part in r.aiter_bytes():
                body += part
                if len(body) > limit:
                    raise SnapshotError(f"{shown}: the hub sent more than {limit} bytes")
            return bytes(body)
    except httpx.HTTPError as e:
        raise SnapshotError(f"{shown}: {type(e).__name__}: {e}") from None


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 50
