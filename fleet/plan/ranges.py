"""One HTTP range of a remote file, as the header readers ask for it: a server that ignores ranges is refused
at its first byte (never a whole download), a server that sends more than was asked is cut off, and a
connection that breaks is tried again (CDNs reset connections too)."""

from __future__ import annotations

import asyncio

import httpx


class _Broken(Exception):
    pass


async def fetch(
    client: httpx.AsyncClient, url: str, start: int, end: int, shown: str, error: type[Exception], tries: int = 3
) -> tuple[bytes, int | None, str]:
    """Bytes `start`..`end` of `url`, the file's size when the server states it, and the URL that answered
    (after redirects). Raises `error` with a one-line reason naming `shown`."""
    for attempt in range(tries):
        try:
            return await _once(client, url, start, end, shown, error)
        except _Broken as e:
            if attempt == tries - 1:
                raise error(f"{shown}: {e}") from None
            await asyncio.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


async def _once(
    client: httpx.AsyncClient, url: str, start: int, end: int, shown: str, error: type[Exception]
) -> tuple[bytes, int | None, str]:
    try:
        async with client.stream("GET", url, headers={"Range": f"bytes={start}-{end}"}) as r:
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
            body = b""
            async for part in r.aiter_bytes():
                body += part
                if len(body) > end - start + 1:
                    raise error(f"{shown}: the server sent more than the range asked for")
            return body, int(total) if total.isdigit() else None, str(r.url)
    except httpx.TransportError as e:
        raise _Broken(f"{type(e).__name__}: {e}") from None
    except httpx.HTTPError as e:
        raise error(f"{shown}: {type(e).__name__}: {e}") from None
