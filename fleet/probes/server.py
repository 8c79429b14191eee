"""How to reach one llama-server: its base URL, its API key, and what verifies its certificate."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, replace
from typing import Any

import httpx


@dataclass(frozen=True)
class Server:
    url: str  # https://ADDRESS:PORT for a host; plain http:// only for a server on this machine
    api_key: str | None = None
    # fleet's CA for a host (fleet/core/tls.py); None: the system's roots, which no fleet host is signed by
    tls: ssl.SSLContext | None = None

    def without_key(self) -> Server:
        return replace(self, api_key=None)

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        """An HTTP client for this server: its key on every request, its certificate checked."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, verify=self.tls or True, **kwargs)
