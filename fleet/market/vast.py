"""The vast.ai client (httpx, async). The same code talks to vast.ai and to the local cloud."""

from __future__ import annotations

import json
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from fleet.market import (
    AuthError,
    BadRequest,
    Instance,
    InstanceSpec,
    MarketError,
    Offer,
    OfferGone,
    OfferQuery,
    RateLimited,
    Transient,
)

PAGE = 25
_backoff = wait_exponential(multiplier=0.2, min=0.2, max=10)


def _wait(retry_state: Any) -> float:
    """Honour Retry-After when the server gives one (vast.ai usually does not), else back off."""
    error = retry_state.outcome.exception() if retry_state.outcome else None
    if isinstance(error, RateLimited) and error.retry_after_s is not None:
        return min(error.retry_after_s, 60.0)
    return _backoff(retry_state)


class VastMarket:
    def __init__(self, url: str, api_key: str, *, retries: int = 6, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._retries = retries
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {api_key}", "User-Agent": "fleet/0.1"},
            timeout=timeout_s,
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, *, retry_ambiguous: bool = True, **kw: Any) -> Any:
        retryable: tuple[type[Exception], ...] = (RateLimited, Transient) if retry_ambiguous else (RateLimited,)
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(retryable),
            stop=stop_after_attempt(self._retries),
            wait=_wait,
            reraise=True,
        ):
            with attempt:
                return await self._once(method, path, **kw)
        raise AssertionError("unreachable")

    async def _once(self, method: str, path: str, **kw: Any) -> Any:
        try:
            response = await self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise Transient(f"{method} {path}: {type(e).__name__}: {e}") from None
        if response.status_code == 429:
            after = response.headers.get("Retry-After")
            raise RateLimited(f"{method} {path}: rate limited", float(after) if after and after.isdigit() else None)
        if response.status_code >= 500:
            raise Transient(f"{method} {path}: HTTP {response.status_code}")
        try:
            body = response.json()
        except ValueError:
            raise MarketError(f"{method} {path}: HTTP {response.status_code} with a body that is not JSON") from None
        if response.status_code in (401, 403):
            raise AuthError(f"the marketplace refused the API key: {_msg(body)}")
        if response.status_code >= 400:
            error = body.get("error") if isinstance(body, dict) else None
            msg = _msg(body)
            if error == "no_such_ask" or "no_such_ask" in msg:
                raise OfferGone(msg)
            if error in ("no_such_instance", "not_found"):
                raise _NotFound(msg)
            raise BadRequest(f"{method} {path}: HTTP {response.status_code}: {msg}")
        return body

    async def search(self, query: OfferQuery) -> list[Offer]:
        # The pool: where, rentable now, enough GPU memory. Every quality filter is applied locally
        # (offers.py) so the funnel can say how many offers each one removed.
        body: dict[str, Any] = {
            "external": {"eq": False},
            "rentable": {"eq": True},
            "rented": {"eq": False},
            "geolocation": {"in": list(query.countries)},
            "order": [["dph_total", "asc"]],
            "type": "on-demand",
            "limit": query.limit,
            "allocated_storage": query.allocated_disk_gb,
        }
        if query.min_gpu_ram_mb:
            body["gpu_ram"] = {"gte": float(query.min_gpu_ram_mb)}
        answer = await self._request("POST", "/api/v0/bundles/", json=body)
        offers = answer.get("offers") if isinstance(answer, dict) else None
        if not isinstance(offers, list):
            raise MarketError("search answered without an offers list")
        return [Offer.from_raw(row) for row in offers]

    async def create(self, offer_id: int, spec: InstanceSpec) -> int:
        env = dict(spec.env)
        env.update({f"-p {p}:{p}": "1" for p in spec.ports})
        body = {
            "client_id": "me",
            "image": spec.image,
            "disk": spec.disk_gb,
            "label": spec.label,
            "env": env,
            "onstart": spec.onstart,
            "runtype": "ssh_direc ssh_proxy",
            "price": None,
            "cancel_unavail": True,
        }
        # A create that may have been processed is never retried: a retry can buy twice.
        answer = await self._request("PUT", f"/api/v0/asks/{offer_id}/", json=body, retry_ambiguous=False)
        if not isinstance(answer, dict) or not answer.get("success") or not answer.get("new_contract"):
            raise MarketError(f"create answered without a new instance: {answer!r}")
        return int(answer["new_contract"])

    async def get(self, instance_id: int) -> Instance | None:
        answer = await self._request("GET", f"/api/v0/instances/{instance_id}/", params={"owner": "me"})
        if not isinstance(answer, dict) or "instances" not in answer:
            raise MarketError(f"show instance {instance_id}: malformed answer")
        row = answer["instances"]
        if row is None:
            return None
        return _instance(row)

    async def list(self, label_prefix: str) -> list[Instance]:
        found: list[Instance] = []
        token: str | None = None
        while True:
            params = {
                "select_filters": json.dumps({}),
                "order_by": json.dumps([{"col": "id", "dir": "asc"}]),
                "limit": str(PAGE),
            }
            if token:
                params["after_token"] = token
            answer = await self._request("GET", "/api/v1/instances/", params=params)
            rows = answer.get("instances") if isinstance(answer, dict) else None
            if not isinstance(rows, list) or not answer.get("success", True):
                raise MarketError("instance listing was malformed; refusing to read it as 'no instances'")
            found.extend(_instance(r) for r in rows if (r.get("label") or "").startswith(label_prefix))
            token = answer.get("next_token")
            if not token:
                return found

    async def ensure_ssh_key(self, public_key: str) -> None:
        """Register our public key on the account (vast.ai puts account keys on new instances)."""
        answer = await self._request("GET", "/api/v0/ssh/")
        rows = answer if isinstance(answer, list) else answer.get("keys", []) if isinstance(answer, dict) else []
        wanted = public_key.split()[:2]
        for row in rows:
            if isinstance(row, dict) and str(row.get("public_key") or row.get("key") or "").split()[:2] == wanted:
                return
        await self._request("POST", "/api/v0/ssh/", json={"ssh_key": public_key})

    async def destroy(self, instance_id: int) -> None:
        try:
            await self._request("DELETE", f"/api/v0/instances/{instance_id}/", json={})
        except _NotFound:
            return


class _NotFound(MarketError):
    pass


def _msg(body: Any) -> str:
    if isinstance(body, dict):
        return str(body.get("msg") or body.get("message") or body.get("detail") or body.get("error") or body)
    return str(body)


def _instance(row: dict[str, Any]) -> Instance:
    try:
        ports: dict[int, tuple[str, int]] = {}
        for key, mappings in (row.get("ports") or {}).items():
            if mappings:
                ports[int(key.split("/")[0])] = (str(mappings[0]["HostIp"]), int(mappings[0]["HostPort"]))
        return Instance(
            id=int(row["id"]),
            status=row.get("actual_status"),
            status_msg=row.get("status_msg"),
            label=row.get("label"),
            machine_id=int(row["machine_id"]),
            dph_total=float(row.get("dph_total") or 0.0),
            public_ip=(row.get("public_ipaddr") or "").strip() or None,
            ssh_host=(row.get("ssh_host") or "").strip() or None,
            ssh_port=int(row["ssh_port"]) if row.get("ssh_port") else None,
            ports=ports,
            start_date=float(row["start_date"]) if row.get("start_date") else None,
            raw=row,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise MarketError(f"malformed instance row {row.get('id')!r}: {e}") from None
