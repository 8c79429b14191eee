"""One HTTP range of a remote file, as the header readers ask for it: a server that ignores ranges is refused
at its first byte (never a whole download), a server that sends more than was asked is cut off, and a
connection that breaks is tried again (CDNs reset connections too). The hub's credentials go to the hub
alone: a range asked of the URL a redirect led to (the hub's CDN) carries none, as httpx strips them from a
redirect that leaves the hub."""

from __future__ import annotations

import asyncio
import re

import httpx

TOTAL = re.compile(r"[0-9]{1,20}")


def same_origin(a: str, b: str) -> bool:
    x, y = httpx.URL(a), httpx.URL(b)
    return (x.scheme, x.host, x.port) == (y.scheme, y.host, y.port)


class _Broken(Exception):
    pass


async def fetch(
    client: httpx.AsyncClient,
    url: str,
    start: int,
    end: int,
    shown: str,
    error: type[Exception],
    auth: dict[str, str] | None = None,
    tries: int = 3,
) -> tuple[bytes, int | None, str]:
    """Bytes `start`..`end` of `url`, the file's size when the server states it, and the URL that answered
    (after redirects). `auth` (the hub's headers) is sent only where `url` is on the hub `shown` names.
    Raises `error` with a one-line reason naming `shown`."""
    headers = {"Range": f"bytes={start}-{end}", **(auth if auth and same_origin(url, shown) else {})}
    for attempt in range(tries):
        try:
            return await _once(client, url, headers, start, end, shown, error)
        except _Broken as e:
            if attempt == tries - 1:
                raise error(f"{shown}: {e}") from None
            await asyncio.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


async def _once(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    start: int,
    end: int,
    shown: str,
    error: type[Exception],
) -> tuple[bytes, int | None, str]:
    try:
        async with client.stream("GET", url, headers=headers) as r:
            if r.status_code == 200:
                raise error(f"{shown}: the server ignores HTTP ranges; refusing to download the whole file")
            if r.status_code == 416:
                return b"", start, str(r.url)
            if r.status_code in (401, 403):
                code = r.headers.get("X-Error-Code", "")[:40]
                raise error(
                    f"{shown}: HTTP {r.status_code} {code}: the hub refuses it (gated or private: fleet needs a Hugging"
                    " Face token that opens it, in $HF_TOKEN or the variable hub.token_env names)"
                )
            if r.status_code != 206:
                raise error(f"{shown}: HTTP {r.status_code}")
            total = r.headers.get("Content-Range", "").rpartition("/")[2]
            body = bytearray()
            async for part in r.aiter_bytes():
                body += part
                if len(body) > end - start + 1:
                    raise error(f"{shown}: the server sent more than the range asked for")
            return bytes(body), int(total) if TOTAL.fullmatch(total) else None, str(r.url)
    except httpx.TransportError as e:
        raise _Broken(f"{type(e).__name__}: {e}") from None
    except httpx.HTTPError as e:
        raise error(f"{shown}: {type(e).__name__}: {e}") from None
