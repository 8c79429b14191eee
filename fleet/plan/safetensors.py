"""Read a safetensors file's header (each tensor's dtype, shape and byte range) from a URL with two HTTP
ranges, or from a local file, without reading tensor data.

The format: an 8-byte little-endian length N, then N bytes of JSON, an object naming each tensor's `dtype`,
`shape` and `data_offsets` (begin and end within the data that follows), and an optional `__metadata__` of
strings. A header is what the hub hands us, so it is read strictly: bounded (the format's own 100 MB), every
entry complete and of known type, every byte range the size its dtype and shape give and inside the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from fleet.core.errors import FleetError
from fleet.plan import ranges

# The format allows 100 MB; a shard's header of thousands of tensors is well under 1 MB, and parsing 100 MB of JSON
# would build gigabytes of Python objects.
MAX_HEADER = 16 * 1024 * 1024
MAX_TENSORS = 1_000_000
MAX_DIMS = 8
# Bits per element of each dtype the format names (the F4 and F6 floats are packed; NVFP4 checkpoints store
# their 4-bit weights as U8 pairs with F8_E4M3 scales).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "U16": 16, "I16": 16, "F16": 16, "BF16": 16,
    "U32": 32, "I32": 32, "F32": 32,
    "U64": 64, "I64": 64, "F64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip


class SafetensorsError(FleetError, ValueError):
    """Not a safetensors header we can read: the message says why, in one line."""

    prefix = "plan"


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class SafetensorsHeader:
    tensors: dict[str, Tensor]
    metadata: dict[str, str] = field(default_factory=dict)
    header_bytes: int = 0  # the 8-byte length and the JSON
    file_size: int | None = None
    bytes_fetched: int = 0
    source: str = ""

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data: what loading the file puts on the card."""
        return sum(t.nbytes for t in self.tensors.values())

    def bytes_by_dtype(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for t in self.tensors.values():
            found[t.dtype] = found.get(t.dtype, 0) + t.nbytes
        return found


def header_length(prefix: bytes, source: str) -> int:
    if len(prefix) < 8:
        raise SafetensorsError(f"{source}: shorter than a safetensors header's 8-byte length")
    n = int.from_bytes(prefix[:8], "little")
    if n < 2 or n > MAX_HEADER:
        raise SafetensorsError(f"{source}: a header of {n} bytes (a safetensors header holds 2 to {MAX_HEADER})")
    return n


def parse(data: bytes, source: str, file_size: int | None = None) -> SafetensorsHeader:
    """The header in `data` (the 8-byte length and at least that much JSON); `file_size`, when known, bounds
    the tensors' byte ranges."""
    n = header_length(data, source)
    if len(data) < 8 + n:
        raise SafetensorsError(f"{source}: truncated: the header runs past the bytes read")
    try:
        doc = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, an integer of 4300 digits
        raise SafetensorsError(f"{source}: the header is not JSON we read ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{source}: the header is not a JSON object")
    metadata = doc.pop("__metadata__", {})
    strings = isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    if not strings:
        raise SafetensorsError(f"{source}: __metadata__ must map strings to strings")
    if len(doc) > MAX_TENSORS:
        raise SafetensorsError(f"{source}: more than {MAX_TENSORS} tensors")
    data_size = None if file_size is None else file_size - 8 - n
    if data_size is not None and data_size < 0:
        raise SafetensorsError(f"{source}: the file is shorter than its header")
    spans = []
    tensors = {}
    for name, entry in doc.items():
        tensors[name], begin = _tensor(name, entry, source)
        spans.append((begin, begin + tensors[name].nbytes, name))
    # the tensors tile the data, as the format's own reader demands: no byte counted twice, none unaccounted
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise SafetensorsError(
                f"{source}: tensor {name[:80]!r} starts at {begin}, not where the last ended ({end})"
            )
        end = stop
    if data_size is not None and end != data_size:
        raise SafetensorsError(f"{source}: the tensors end at byte {end} of {data_size} bytes of data")
    return SafetensorsHeader(tensors=tensors, metadata=metadata, header_bytes=8 + n, file_size=file_size)


def _tensor(name: str, entry: object, source: str) -> tuple[Tensor, int]:
    """The tensor an entry names, and where its bytes begin in the data."""
    shown = f"{source}: tensor {name[:80]!r}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsError(f"{shown}: an entry is exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise SafetensorsError(f"{shown}: unknown dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_count(d) for d in shape):
        raise SafetensorsError(f"{shown}: a shape is a list of at most {MAX_DIMS} non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets):
        raise SafetensorsError(f"{shown}: data_offsets are two non-negative integers")
    begin, end = offsets
    expected = -(-math.prod(shape) * DTYPE_BITS[dtype] // 8)  # whole bytes, integers only
    if end - begin != expected:
        raise SafetensorsError(f"{shown}: {end - begin} bytes where {dtype} {str(shape)[:60]} holds {expected}"[:300])
    return Tensor(name=name, dtype=dtype, shape=tuple(shape), nbytes=expected), begin


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_local(path: Path) -> SafetensorsHeader:
    size = path.stat().st_size
    with path.open("rb") as f:
        n = header_length(f.read(8), str(path))
        f.seek(0)
        data = f.read(8 + n)
    header = parse(data, str(path), size)
    header.bytes_fetched, header.source = len(data), str(path)
    return header


async def read_url(url: str, headers: dict[str, str] | None = None, timeout_s: float = 60.0) -> SafetensorsHeader:
    """The header of a remote safetensors file by two HTTP ranges (redirects followed, ranges required)."""
    async with httpx.AsyncClient(follow_redirects=True, timeout=timeout_s) as client:
        prefix, size, target = await ranges.fetch(client, url, 0, 7, url, SafetensorsError, auth=headers)
        n = header_length(prefix, url)
        if size is not None and 8 + n > size:
            raise SafetensorsError(f"{url}: truncated: the header runs past the end of the file")
        # from where the hub sent us (its CDN): without the hub's headers, which ranges.fetch keeps for the hub
        body, _, _ = await ranges.fetch(client, target, 8, 8 + n - 1, url, SafetensorsError, auth=headers)
    header = parse(prefix + body, url, size)
    header.bytes_fetched, header.source = 8 + len(body), url
    return header
