"""How to reach one llama-server: its base URL, its API key, and what verifies its certificate; and how to
read what it answers (a host is a stranger's machine: every answer within a size and a deadline)."""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass, replace
from typing import Any

import httpx

MAX_REPLY = 4 << 20  # bytes: /props, /tokenize of a long system prompt and a short completion fit in far less


@dataclass(frozen=True)
class Server:
    url: str  # https://ADDRESS:PORT for a host; plain http:// only for a server on this machine
    api_key: str | None = None
    # fleet's CA for a host (fleet/core/tls.py); None: the system's roots, which no fleet host is signed by
    tls: ssl.SSLContext | None = None
    # the name its certificate must hold (a host's own, core/tls.py host_tls_name); None: the URL's address
    tls_name: str | None = None

    def without_key(self) -> Server:
        return replace(self, api_key=None)

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        """An HTTP client for this server: its key on every request, its certificate checked (for `tls_name`
        where it has one, sent as SNI and verified, while the connection goes to the URL's address)."""
        headers = {"Accept-Encoding": "identity"}  # what a host sends is read as sent: no decompression bomb
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if self.tls_name:
            hooks = kwargs.setdefault("event_hooks", {}).setdefault("request", [])
            hooks.append(self._name_the_host)
        return httpx.AsyncClient(base_url=self.url, headers=headers, verify=self.tls or True, **kwargs)

    async def _name_the_host(self, request: httpx.Request) -> None:
        request.extensions["sni_hostname"] = self.tls_name


class ReplyTooLarge(httpx.HTTPError):
    """A host answered more than fleet reads."""


@dataclass(frozen=True)
class Reply:
    status_code: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def raise_for_status(self) -> Reply:
        if self.status_code >= 400:
            raise httpx.HTTPError(f"the server answered {self.status_code}")
        return self


async def bounded(
    client: httpx.AsyncClient, method: str, path: str, *, deadline_s: float, max_bytes: int = MAX_REPLY, **kwargs: Any
) -> Reply:
    """One request, its whole answer read within `deadline_s` and at most `max_bytes` of it: a host that drips
    its answer a byte a second, or floods it, is an error (TimeoutError, ReplyTooLarge), never a wait."""
    async with asyncio.timeout(deadline_s), client.stream(method, path, **kwargs) as r:
        body = bytearray()
        async for chunk in r.aiter_raw():
            body += chunk
            if len(body) > max_bytes:
                raise ReplyTooLarge(f"{path} answered more than {max_bytes} bytes")
    return Reply(r.status_code, bytes(body))
