"""A model hub that serves files the way Hugging Face does.

`/{owner}/{repo}/resolve/{rev}/{file}` answers a file stored in LFS (weights) with a 302 to a signed,
expiring CDN URL, `X-Linked-Etag` (the sha256, quoted) and `X-Linked-Size`; a small file kept in git itself
(config.json, the tokenizer) in place, with its git blob id as ETag and no sha256 at all. `/api/models/
{owner}/{repo}/revision/{rev}` lists a repository's files (with `blobs=true`: each one's size, blob id and,
for LFS, sha256). A revision is `main` or the repository's commit; a gated repo answers 401 to a request
without its token. The
CDN serves bytes with HTTP ranges only to a URL whose signature holds and has not expired (checked when a
request starts, as S3 and CloudFront do), capped per connection so that multi-connection pulls matter,
and can reset a connection mid-file on demand.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from fleet.localcloud import replicas, replicas_hf, tinyhf, tinymodels
from fleet.localcloud.faults import Faults

TINY_REPO = "fleet-local/tiny-models"
CHUNK = 64 * 1024
# How long a signed CDN URL is good for: the shortest we have seen on the hub's storage (an S3 URL with
# X-Amz-Expires=900); a pull that outlives it must ask the hub again.
SIGNED_URL_TTL_S = 900.0


@dataclass
class HubFile:
    repo: str
    path: Path
    size: int
    sha256: str | None = None  # computed on first need (header replicas are many GB of hole)
    lfs: bool = True  # weights live in LFS; a small file in git, known by its blob id alone

    @property
    def name(self) -> str:
        return self.path.name

    def pointer(self) -> bytes:
        """What git holds of a file in LFS: its pointer, naming the content's sha256 and size."""
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.digest()}\nsize {self.size}\n".encode()

    def blob_id(self) -> str:
        """git's id of the file's blob (what the hub's API names it by): sha1 of "blob SIZE\\0" and the bytes,
        for a file in LFS the bytes of its pointer."""
        if self.lfs:
            pointer = self.pointer()
            return hashlib.sha1(f"blob {len(pointer)}\0".encode() + pointer).hexdigest()
        digest = hashlib.sha1(f"blob {self.size}\0".encode())
        with self.path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        return digest.hexdigest()

    def digest(self) -> str:
        """The sha256, cached beside the file so that a large replica is hashed once per machine."""
        if self.sha256 is None:
            sidecar = self.path.with_name(self.path.name + ".sha256")
            if sidecar.exists() and sidecar.stat().st_mtime >= self.path.stat().st_mtime:
                self.sha256 = sidecar.read_text().strip()
            else:
                self.sha256 = tinymodels.sha256_of(self.path)
                sidecar.write_text(self.sha256 + "\n")
        return self.sha256


@dataclass(frozen=True)
class Link:
    """The host a download is for (known by its address) and how fast its link is (bytes/s; None: no cap)."""

    instance_id: int
    bytes_per_s: float | None


class Hub:
    def __init__(
        self,
        root: Path,
        bytes_per_s: int,
        faults: Callable[[], Faults],
        links: Callable[[str], Link | None] = lambda address: None,
        on_download: Callable[[int, int], None] = lambda instance_id, n: None,
    ) -> None:
        self.root = root
        self.bytes_per_s = bytes_per_s
        self._faults = faults  # () -> Faults, so admin changes apply at once
        self._links = links  # a downloader's address -> its host's link
        self._on_download = on_download  # (instance id, bytes): the host's traffic, billed
        self._link_free_at: dict[int, float] = {}  # instance id -> when its link is free again
        self._by_repo: dict[tuple[str, str], HubFile] = {}
        self.bytes_served: dict[str, int] = {}  # repo/file -> body bytes written, for tests and demos
        self.token_requests = 0  # requests that carried a bearer token (a Hugging Face token, on the real hub)
        self.host_token_requests = 0  # ... of them, from a rented host's address: a token on a stranger's machine
        self.refused_urls = 0  # CDN requests refused: no signature, a forged one, or expired
        self._signing_key = os.urandom(32)
        self._expired: set[str] = set()  # signatures ended early (a fault standing in for the clock)

    def publish_tiny_models(self) -> None:
        directory = self.root / TINY_REPO
        for path in tinymodels.ensure(directory).values():
            self.add(TINY_REPO, path).digest()
        for name, path in tinyhf.ensure(self.root / tinyhf.REPO).items():
            self.add(tinyhf.REPO, path, lfs=name.endswith(".safetensors")).digest()

    def publish_hf_replica(self, directory: Path) -> None:
        """The header replica of the NVFP4 checkpoint vLLM users serve, as a repository (replicas_hf.py)."""
        for name, path in replicas_hf.ensure(directory).items():
            self.add(replicas_hf.REPO, path, lfs=name.endswith(".safetensors"))

    def publish_replicas(self, directory: Path) -> None:
        """The header replicas of the real models, under their Hugging Face repos."""
        for (repo, _), path in replicas.ensure(directory).items():
            self.add(repo, path)

    def publish_directory(self, repo: str, directory: Path) -> None:
        """Every GGUF file in `directory` under `repo` (a large generated model, say), hashed now."""
        for path in sorted(directory.glob("*.gguf")):
            self.add(repo, path).digest()

    def add(self, repo: str, path: Path, lfs: bool = True) -> HubFile:
        entry = HubFile(repo, path, path.stat().st_size, lfs=lfs)
        self._by_repo[(repo, path.name)] = entry
        return entry

    def lookup(self, repo: str, filename: str) -> HubFile | None:
        return self._by_repo.get((repo, filename))

    def repo_files(self, repo: str) -> list[HubFile]:
        return sorted((f for (r, _), f in self._by_repo.items() if r == repo), key=lambda f: f.name)

    def commit(self, repo: str) -> str:
        """The repository's commit: the same for the same files (a stand-in for git's, 40 hex digits)."""
        names = "\n".join(f"{f.name} {f.size}" for f in self.repo_files(repo))
        return hashlib.sha1(f"{repo}\n{names}".encode()).hexdigest()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.route("*", "/cdn/{owner}/{repo}/{file}", self.serve),
            web.route("*", "/{owner}/{repo}/resolve/{rev}/{file:.+}", self.resolve),
            web.get("/api/models/{owner}/{repo}/revision/{rev}", self.listing),
            web.get("/api/models/{owner}/{repo}", self.listing),
        ]

    def _refusal(self, request: web.Request, repo: str) -> web.Response | None:
        """401 for a gated repo asked without its token, 404 for a repo or revision it does not have."""
        gate = self._faults().gated_repos.get(repo)
        if gate is not None and request.headers.get("Authorization", "") != f"Bearer {gate}":
            return web.json_response(
                {"error": f"Access to model {repo} is restricted. You must have access to it and be authenticated."},
                status=401,
                headers={"X-Error-Code": "GatedRepo"},
            )
        if not self.repo_files(repo):
            return web.json_response(
                {"error": "Repository not found"}, status=404, headers={"X-Error-Code": "RepoNotFound"}
            )
        if request.match_info.get("rev", "main") not in ("main", self.commit(repo)):
            return web.json_response(
                {"error": f"Invalid rev id: {request.match_info['rev'][:80]}"},
                status=404,
                headers={"X-Error-Code": "RevisionNotFound"},
            )
        return None

    async def listing(self, request: web.Request) -> web.StreamResponse:
        self._count_token(request)
        repo = f"{request.match_info['owner']}/{request.match_info['repo']}"
        refused = self._refusal(request, repo)
        if refused is not None:
            return refused
        siblings: list[dict[str, object]] = []
        for f in self.repo_files(repo):
            sibling: dict[str, object] = {"rfilename": f.name}
            if request.query.get("blobs") == "true":
                sibling.update(size=f.size, blobId=await asyncio.to_thread(f.blob_id))
                if f.lfs:
                    pointer = await asyncio.to_thread(f.pointer)
                    sibling["lfs"] = {"sha256": f.digest(), "size": f.size, "pointerSize": len(pointer)}
            siblings.append(sibling)
        return web.json_response({"id": repo, "modelId": repo, "sha": self.commit(repo), "siblings": siblings})

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
        self._count_token(request)
        repo = f"{request.match_info['owner']}/{request.match_info['repo']}"
        refused = self._refusal(request, repo)
        if refused is not None:
            return refused
        entry = self.lookup(repo, request.match_info["file"])
        if entry is None:
            return web.json_response(
                {"error": "Entry not found"}, status=404, headers={"X-Error-Code": "EntryNotFound"}
            )
        if not entry.lfs:
            return await self._in_place(request, entry)
        sha256 = await asyncio.to_thread(entry.digest)
        ttl = self._faults().signed_url_ttl_s
        expires = int(time.time() + (SIGNED_URL_TTL_S if ttl is None else ttl))
        path = f"/cdn/{repo}/{entry.path.name}"
        nonce = os.urandom(8).hex()
        signed = f"{path}?Expires={expires}&Nonce={nonce}&Signature={self._sign(path, expires, nonce)}"
        return web.Response(
            status=302,
            headers={
                "Location": f"{request.scheme}://{request.host}{signed}",
                "X-Linked-Etag": f'"{sha256}"',
                "X-Linked-Size": str(entry.size),
                "ETag": f'"{sha256}"',
                "X-Repo-Commit": self.commit(repo),
            },
        )

    async def _in_place(self, request: web.Request, entry: HubFile) -> web.StreamResponse:
        """A file kept in git: its bytes from the hub itself, known by its blob id (no sha256 is stated)."""
        headers = {"ETag": f'"{await asyncio.to_thread(entry.blob_id)}"', "X-Repo-Commit": self.commit(entry.repo)}
        if request.method == "HEAD":
            return web.Response(status=200, headers={**headers, "Content-Length": str(entry.size)})
        return web.Response(status=200, body=entry.path.read_bytes(), headers=headers)

    def _sign(self, path: str, expires: int, nonce: str) -> str:
        return hmac.new(self._signing_key, f"{path}\n{expires}\n{nonce}".encode(), hashlib.sha256).hexdigest()

    def _count_token(self, request: web.Request) -> None:
        if request.headers.get("Authorization", "").startswith("Bearer "):
            self.token_requests += 1
            if self._links(request.remote or "") is not None:
                self.host_token_requests += 1

    def _signature_holds(self, request: web.Request) -> bool:
        expires, signature = request.query.get("Expires", ""), request.query.get("Signature", "")
        if not expires.isdigit() or int(expires) < time.time() or signature in self._expired:
            return False
        return hmac.compare_digest(signature, self._sign(request.path, int(expires), request.query.get("Nonce", "")))

    async def serve(self, request: web.Request) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
        self._count_token(request)
        if not self._signature_holds(request):
            self.refused_urls += 1
            return web.Response(status=403, text="Auth failed: the URL's signature is missing, wrong or expired")
        repo = f"{request.match_info['owner']}/{request.match_info['repo']}"
        entry = self.lookup(repo, request.match_info["file"])
        if entry is None:
            raise web.HTTPNotFound()
        start, end = 0, entry.size - 1
        status = 200
        if request.http_range.start is not None or request.http_range.stop is not None:
            try:
                rng = request.http_range
            except ValueError:
                raise web.HTTPRequestRangeNotSatisfiable() from None
            start = rng.start or 0
            if start < 0:
                start = max(entry.size + start, 0)
            end = (rng.stop - 1) if rng.stop is not None else entry.size - 1
            end = min(end, entry.size - 1)
            if start > end:
                raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{entry.size}"})
            status = 206
        length = end - start + 1
        response = web.StreamResponse(
            status=status,
            headers={
                "Accept-Ranges": "bytes",
                "ETag": f'"{entry.sha256}"',
                "Content-Type": "application/octet-stream",
                "Content-Length": str(length),
            },
        )
        if status == 206:
            response.headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
        await response.prepare(request)
        if request.method == "HEAD":
            return response

        faults = self._faults()
        stall = faults.pull_stall
        if stall and stall.count > 0 and entry.path.name in stall.files and length == entry.size:  # a download
            stall.count -= 1
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.5)  # headers sent, then not one byte: the pull never progresses
            return response
        corrupt_at = entry.size // 2 if entry.path.name in faults.corrupt_files else None
        reset = faults.pull_reset
        reset_after = None
        if reset and reset.count > 0 and length > reset.after_bytes:
            reset.count -= 1
            reset_after = reset.after_bytes
            if reset.expire_url:
                self._expired.add(request.query.get("Signature", ""))
        sent = 0
        served, key = self.bytes_served, f"{entry.repo}/{entry.path.name}"
        link = self._links(request.remote or "")
        began = time.monotonic()
        with entry.path.open("rb") as f:
            f.seek(start)
            while sent < length:
                block = f.read(min(CHUNK, length - sent))
                offset = start + sent
                if corrupt_at is not None and offset <= corrupt_at < offset + len(block):
                    i = corrupt_at - offset
                    block = block[:i] + bytes([block[i] ^ 0xFF]) + block[i + 1 :]
                if reset_after is not None and sent + len(block) > reset_after:
                    await response.write(block[: reset_after - sent])
                    served[key] = served.get(key, 0) + reset_after - sent
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                ahead = (sent + len(block)) / self.bytes_per_s - (time.monotonic() - began)
                if link is not None and link.bytes_per_s:
                    # every connection of one host shares its link: each block waits its turn on it
                    now = time.monotonic()
                    free_at = max(self._link_free_at.get(link.instance_id, now), now) + len(block) / link.bytes_per_s
                    self._link_free_at[link.instance_id] = free_at
                    ahead = max(ahead, free_at - now)
                if ahead > 0:
                    await asyncio.sleep(ahead)
                await response.write(block)
                sent += len(block)
                served[key] = served.get(key, 0) + len(block)
                if link is not None:
                    self._on_download(link.instance_id, len(block))
        await response.write_eof()
        return response
