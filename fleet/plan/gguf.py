"""Read a GGUF file's header (metadata and tensor infos) from a URL with HTTP range requests, or from
a local file, without reading tensor data.

The first range is small; when the header runs past what was fetched, the next range doubles the
prefix, up to a cap. A server that ignores ranges (answers 200 with the whole file) is refused at
its first byte, never downloaded. The bytes fetched are counted.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import httpx

from fleet.core.errors import FleetError
from fleet.plan import ranges

if TYPE_CHECKING:
    import gguf

FIRST_RANGE = 256 * 1024
MAX_HEADER = 128 * 1024 * 1024
MAGIC = b"GGUF"


class GgufError(FleetError, ValueError):
    """Not a GGUF header we can read: the message says why, in one line."""

    prefix = "plan"


class _NeedMore(Exception):
    def __init__(self, upto: int) -> None:
        self.upto = upto


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row (contiguous) length
    type: gguf.GGMLQuantizationType
    offset: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        block, type_size = gguf_package().GGML_QUANT_SIZES[self.type]
        if self.shape and self.shape[0] % block:
            raise GgufError(
                f"tensor {self.name}: row of {self.shape[0]} is not a multiple of {self.type.name}'s block of {block}"
            )
        return self.n_elements // block * type_size


@dataclass
class GgufHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    header_bytes: int  # where the tensor data starts
    file_size: int | None = None
    bytes_fetched: int = 0
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def key(self, name: str, default: Any = None) -> Any:
        """An architecture key (`block_count`, `attention.head_count_kv`, ...), or default."""
        return self.metadata.get(f"{self.arch}.{name}", default)


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise _NeedMore(end)
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack("<" + fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.unpack("Q")
        if n > MAX_HEADER:
            raise GgufError(f"a string of {n} bytes: not a GGUF header")
        return self.take(n).decode("utf-8", errors="replace")


# GGUF's metadata value types (the format's specification numbers them; gguf.GGUFValueType holds the same)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _value(cur: _Cursor, vtype: int) -> Any:
    if vtype in _SCALARS:
        return cur.unpack(_SCALARS[vtype])
    if vtype == _STRING:
        return cur.string()
    if vtype != _ARRAY:
        raise GgufError(f"unknown metadata value type {vtype}")
    item_type = cur.unpack("I")
    count = cur.unpack("Q")
    if count > MAX_HEADER:
        raise GgufError(f"an array of {count} items: not a GGUF header")
    if item_type in _SCALARS:  # read numeric arrays in one go
        fmt = _SCALARS[item_type]
        size = struct.calcsize(fmt)
        return list(struct.unpack(f"<{count}{fmt}", cur.take(size * count)))
    return [_value(cur, item_type) for _ in range(count)]


def gguf_package() -> ModuleType:
    """The gguf package (its tensor types and their sizes), loaded when a header is first read: with numpy it
    is a seventh of every fleet command's start, and most commands read no header."""
    import gguf

    return gguf


def parse(data: bytes) -> GgufHeader:
    """Parse a header from the first bytes of a file; raises _NeedMore when they are not enough."""
    cur = _Cursor(data)
    if cur.take(4) != MAGIC:
        raise GgufError("not a GGUF file (no GGUF magic)")
    version = cur.unpack("I")
    if version not in (2, 3):
        raise GgufError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    if n_tensors > 10_000_000 or n_kv > 1_000_000:
        raise GgufError("implausible tensor or key count: not a GGUF header")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = _value(cur, cur.unpack("I"))
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        if n_dims > 8:
            raise GgufError(f"tensor {name}: {n_dims} dimensions")
        shape = tuple(cur.unpack("Q") for _ in range(n_dims))
        raw_type = cur.unpack("I")
        try:
            ttype = gguf_package().GGMLQuantizationType(raw_type)
        except ValueError:
            raise GgufError(f"tensor {name}: unknown type {raw_type}") from None
        tensors.append(TensorInfo(name, shape, ttype, cur.unpack("Q")))
    alignment = int(metadata.get("general.alignment", gguf_package().GGUF_DEFAULT_ALIGNMENT))
    start = cur.pos + (-cur.pos % alignment)
    return GgufHeader(version, metadata, tensors, start)


def read_local(path: Path) -> GgufHeader:
    size = path.stat().st_size
    with path.open("rb") as f:
        upto = FIRST_RANGE
        while True:
            f.seek(0)
            data = f.read(min(upto, size))
            try:
                header = parse(data)
            except _NeedMore as e:
                if len(data) >= size:
                    raise GgufError(f"{path}: truncated: the header runs past the end of the file") from None
                upto = max(e.upto, upto * 2)
                if upto > MAX_HEADER:
                    raise GgufError(f"{path}: header larger than {MAX_HEADER >> 20} MiB") from None
                continue
            header.file_size, header.bytes_fetched, header.source = size, len(data), str(path)
            return header


async def read_url(
    url: str,
    headers: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    cache: Path | None = None,
    progress: Callable[[int], None] | None = None,
) -> GgufHeader:
    """The header of a remote GGUF, by HTTP ranges only (redirects followed, ranges required). With `cache`,
    the header's bytes are kept there by the file's sha256 (the hub's X-Linked-Etag): a file read once is
    never read again. `progress` hears the bytes fetched so far after each range."""
    fetched = b""
    size: int | None = None
    target = url
    # the hub's headers go with each request to the hub alone (ranges.fetch): never to where it redirects
    async with httpx.AsyncClient(follow_redirects=True, timeout=timeout_s) as client:
        kept = await _kept(client, url, cache, headers) if cache is not None else None
        if kept is not None and kept.exists():
            header = parse(kept.read_bytes())
            header.source, header.file_size = url, int(kept.stem.split("-")[1])
            return header
        upto = FIRST_RANGE
        while True:
            if len(fetched) < upto:
                chunk, size, target = await ranges.fetch(
                    client, target, len(fetched), upto - 1, url, GgufError, auth=headers
                )
                fetched += chunk
                if progress is not None:
                    progress(len(fetched))
            try:
                header = parse(fetched)
            except _NeedMore as e:
                if size is not None and len(fetched) >= size:
                    raise GgufError(f"{url}: truncated: the header runs past the end of the file") from None
                upto = max(e.upto, upto * 2)
                if upto > MAX_HEADER:
                    raise GgufError(f"{url}: header larger than {MAX_HEADER >> 20} MiB") from None
                if size is not None:
                    upto = min(upto, size)
                continue
            header.file_size, header.bytes_fetched, header.source = size, len(fetched), url
            if kept is not None and size is not None and kept.stem.endswith(f"-{size}"):
                kept.parent.mkdir(parents=True, exist_ok=True)
                partial = kept.with_suffix(f".{os.getpid()}.tmp")
                partial.write_bytes(fetched[: header.header_bytes])
                os.replace(partial, kept)
            return header


async def _kept(client: httpx.AsyncClient, url: str, cache: Path, headers: dict[str, str] | None) -> Path | None:
    """Where this file's header is kept: by the sha256 and size the hub states for it (None when it states
    none: a header that may change is never kept)."""
    try:
        r = await client.head(url, follow_redirects=False, headers=headers)
    except httpx.HTTPError:
        return None
    sha256 = (r.headers.get("X-Linked-Etag") or "").strip('"')
    size = r.headers.get("X-Linked-Size") or ""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256) or not size.isdigit():
        return None
    return cache / f"{sha256}-{size}.gguf-header"
