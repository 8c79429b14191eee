"""The model hub serves files as Hugging Face does: redirect, linked etag and size, ranges, a bandwidth cap."""

import asyncio
import hashlib
import time

import httpx
import pytest

from fleet.localcloud import control
from tests.helpers import TINY_REPO


async def test_resolve_redirects_with_linked_etag_and_size(cloud):
    url = f"{cloud.url}/{TINY_REPO}/resolve/main/tiny-llama-bytes.gguf"
    async with httpx.AsyncClient() as client:
        head = await client.head(url)
        assert head.status_code == 302
        sha = head.headers["X-Linked-Etag"].strip('"')
        size = int(head.headers["X-Linked-Size"])
        body = (await client.get(url, follow_redirects=True)).content
    assert len(body) == size and hashlib.sha256(body).hexdigest() == sha
    assert body[:4] == b"GGUF"


async def test_ranges_are_served(cloud):
    url = f"{cloud.url}/{TINY_REPO}/resolve/main/tiny-mamba.gguf"
    async with httpx.AsyncClient(follow_redirects=True) as client:
        whole = (await client.get(url)).content
        part = await client.get(url, headers={"Range": "bytes=100-199"})
        tail = await client.get(url, headers={"Range": "bytes=-50"})
        beyond = await client.get(url, headers={"Range": f"bytes={len(whole) + 10}-"})
    assert part.status_code == 206 and part.content == whole[100:200]
    assert part.headers["Content-Range"] == f"bytes 100-199/{len(whole)}"
    assert tail.status_code == 206 and tail.content == whole[-50:]
    assert beyond.status_code == 416


async def test_unknown_file_is_404(cloud):
    async with httpx.AsyncClient() as client:
        r = await client.get(f"{cloud.url}/{TINY_REPO}/resolve/main/nope.gguf")
    assert r.status_code == 404 and r.headers["X-Error-Code"] == "EntryNotFound"


@pytest.fixture
def slow_hub(tmp_path, llama_server):
    info = control.start(tmp_path / "cloud", hub_bytes_per_s=200_000)
    yield info
    control.stop(tmp_path / "cloud")


async def test_bandwidth_is_capped_per_connection_so_parallel_ranges_are_faster(slow_hub):
    url = f"{slow_hub.url}/{TINY_REPO}/resolve/main/tiny-llama-bytes.gguf"
    async with httpx.AsyncClient(follow_redirects=True, timeout=30) as client:
        size = int((await client.head(url, follow_redirects=False)).headers["X-Linked-Size"])
        started = time.monotonic()
        await client.get(url)
        one = time.monotonic() - started
        half = size // 2
        started = time.monotonic()
        await asyncio.gather(
            client.get(url, headers={"Range": f"bytes=0-{half - 1}"}),
            client.get(url, headers={"Range": f"bytes={half}-"}),
        )
        two = time.monotonic() - started
    assert one >= 0.95 * size / 200_000  # never faster than the cap
    assert two < 0.75 * one  # two connections share no cap
