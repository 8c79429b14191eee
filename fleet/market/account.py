"""What fleet reads about the account and the marketplace itself, not about an offer or an instance: the key's
permissions, the credit, the fields the account's answer names, whether the search filters on `rented`, an
instance's logs (`fleet doctor --live` reads the last three). VastMarket takes them from here."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import httpx

from fleet.market import AuthError

LOG_BYTES = 1 << 20  # the most of an instance's logs read (fleet doctor --live looks for one line)


class AccountReads:
    async def _request(self, endpoint: str, method: str, path: str, **kw: Any) -> Any:
        """VastMarket's: one paced call to the marketplace."""
        raise NotImplementedError

    async def missing_permissions(self, only: tuple[str, ...] | None = None) -> dict[str, str]:
        """The permissions fleet needs that this key lacks, each with what fleet needs it for (empty: none), by one
        read of each kind (vast-cli's api_scopes.json says which an endpoint needs of a scoped key). The writes
        (instance_write; user_write, which fleet can do without) cannot be tried without doing something."""
        probes: list[tuple[str, str, str, str, dict[str, Any]]] = [
            ("misc", "searching offers", "POST", "/api/v0/bundles/", {"json": {"limit": 1}}),
            ("instance_read", "reading its instances", "GET", "/api/v1/instances/", {"params": {"limit": 1}}),
            ("user_read", "reading the account's credit and SSH keys", "GET", "/api/v0/users/current/", {}),
        ]
        missing: dict[str, str] = {}
        for permission, why, method, path, kw in probes:
            if only is not None and permission not in only:
                continue
            endpoint = {"/api/v0/bundles/": "search", "/api/v1/instances/": "list"}.get(path, "user")
            try:
                await self._request(endpoint, method, path, **kw)
            except AuthError:
                missing[permission] = why
        return missing

    async def credit(self) -> float | None:
        """The account's available credit in $: `users/current`'s `credit` ("The credit field shows your available
        balance", DOCS authentication.mdx), else its `balance` (the field show_user.yaml documents, `credit` not
        among them); None when the answer says neither."""
        answer = await self._request("user", "GET", "/api/v0/users/current/")
        for field in ("credit", "balance"):
            value = answer.get(field) if isinstance(answer, dict) else None
            if not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value):
                return float(value)
        return None

    async def account_fields(self) -> list[str]:
        """The names of the fields `users/current` answers (`fleet doctor --live`): names only, never a value (the
        answer can carry keys)."""
        answer = await self._request("user", "GET", "/api/v0/users/current/")
        if not isinstance(answer, dict):
            return []
        return sorted(name[:64] for name in list(answer)[:200] if isinstance(name, str) and name.isprintable())

    async def rented_filter_applies(self) -> bool | None:
        """Whether the search filters on `rented` (vast-cli 52b515c: "backend doesnt filter by rented at all"):
        asked for rented offers alone, does it answer any that is not? None when it answers none at all."""
        body = {"rented": {"eq": True}, "type": "on-demand", "limit": 64, "order": [["dph_total", "asc"]]}
        answer = await self._request("search", "POST", "/api/v0/bundles/", json=body)
        offers = answer.get("offers") if isinstance(answer, dict) else None
        rows = [o for o in offers if isinstance(o, dict)] if isinstance(offers, list) else []
        if not rows:
            return None
        return all(o.get("rented") is True for o in rows)

    async def logs(self, instance_id: int, tail: int = 200, wait_s: float = 30.0) -> str | None:
        """The tail of an instance's logs (vast-cli `logs`: PUT request_logs answers a `result_url`, fetched
        without the API key until it is ready); None when it never is. The URL is another server's: fleet's key
        never goes there, and at most LOG_BYTES of its answer are read."""
        answer = await self._request(
            "manage", "PUT", f"/api/v0/instances/request_logs/{instance_id}/", json={"tail": str(tail)}
        )
        url = answer.get("result_url") if isinstance(answer, dict) else None
        if not isinstance(url, str) or not url.startswith(("https://", "http://")):
            return None
        deadline = time.monotonic() + wait_s
        async with httpx.AsyncClient(timeout=10.0, follow_redirects=False) as anonymous:
            while time.monotonic() < deadline:
                try:
                    async with anonymous.stream("GET", url) as response:
                        if response.status_code == 200:
                            body = b""
                            async for chunk in response.aiter_bytes():
                                body += chunk
                                if len(body) >= LOG_BYTES:
                                    break
                            return body[:LOG_BYTES].decode("utf-8", "replace")
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.5)  # a bucket's URL, no API call: no interval to keep
        return None
