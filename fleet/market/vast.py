"""The vast.ai client (httpx, async). The same code talks to vast.ai and to the local cloud.

Every request goes through the process's pacer (fleet/market/pacing.py), so fleet keeps inside
vast.ai's per-endpoint intervals; a 429 that happens anyway is retried after its Retry-After (or the
endpoint's penalty), each retry logged, a bounded number of times. A 5xx or a broken connection is
retried too, except on create, where the request may have been processed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from fleet.market import (
    AuthError,
    BadRequest,
    CreateFailed,
    CreditSpent,
    Instance,
    InstanceSpec,
    Maintenance,
    MarketError,
    NotFound,
    Offer,
    OfferGone,
    OfferQuery,
    Offers,
    RateLimited,
    SearchQuotaExceeded,
    Transient,
    reads_gone,
)
from fleet.market.account import AccountReads
from fleet.market.answers import (
    instance_from_row,
    is_number,
    json_or_none,
    maintenances_from,
    message,
    quota_message,
    reset_time,
    seconds_within,
    text_excerpt,
)
from fleet.market.pacing import Budget, Pacer, shared_pacer
from fleet.market.search import search_filters

log = logging.getLogger("fleet.market")

PAGE = 25  # vast.ai's most rows per listing page
RUNTYPE = "ssh_direc ssh_proxy"  # the platform starts sshd with the account's keys; 22 mapped directly too


class VastMarket(AccountReads):
    def __init__(
        self,
        url: str,
        api_key: str,
        *,
        attempts: int = 8,
        timeout_s: float = 30.0,
        create_timeout_s: float = 120.0,
        pacer: Pacer | None = None,
        budget: Budget | None = None,
        rate_limited_wait_s: float = 600.0,
    ) -> None:
        self.url = url.rstrip("/")
        self._attempts = attempts
        self._budget = budget
        self._rate_limited_wait_s = rate_limited_wait_s
        self._create_timeout_s = create_timeout_s
        self.pacer = pacer or shared_pacer(self.url, api_key)
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {api_key}", "User-Agent": "fleet/0.1"},
            timeout=timeout_s,
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(
        self,
        endpoint: str,
        method: str,
        path: str,
        *,
        retry_ambiguous: bool = True,
        on_sent: Callable[[], None] | None = None,
        **kw: Any,
    ) -> Any:
        """One logical call: paced (this process's pacer, and the install's budget that every process shares),
        retried on 429 (always safe: nothing was done) for as long as `rate_limited_wait_s` allows, honouring
        Retry-After (a caller's own deadline, a bring-up phase's, ends it sooner), and, unless the call may have
        been processed, on 5xx and broken connections, `attempts` times."""
        failures = refusals = 0
        refused_for = 0.0
        while True:
            try:
                async with self.pacer.slot(endpoint):
                    turn = await self._take_turn(endpoint)
                    try:
                        if on_sent is not None:
                            on_sent()
                        return await self._once(method, path, **kw)
                    finally:
                        if turn is not None and self._budget is not None:
                            await self._budget.release(endpoint, self.pacer.pace(endpoint), turn)
            except RateLimited as e:
                refusals += 1
                if refused_for >= self._rate_limited_wait_s:
                    raise RateLimited(
                        f"{e} for {refused_for:.0f}s (provider.rate_limited_wait_s)", e.retry_after_s
                    ) from None
                wait = self.pacer.penalize(endpoint, e.retry_after_s, refusals)
                refused_for += wait
                log.warning("%s %s: rate limited (429, %d in a row); retry in %.1fs", method, path, refusals, wait)
            except Transient as e:
                failures += 1
                if not retry_ambiguous or failures == self._attempts:
                    raise
                wait = self.pacer.defer(endpoint, min(0.5 * 2 ** (failures - 1), 30.0))
                log.warning("%s; retry %d/%d in %.1fs", e, failures, self._attempts - 1, wait)
            self.pacer.retried(endpoint)

    async def _take_turn(self, endpoint: str) -> float | None:
        """Wait for this call's turn in the install's budget (None: this market has none)."""
        if self._budget is None:
            return None
        while True:
            turn, wait = await self._budget.claim(endpoint, self.pacer.pace(endpoint))
            if turn is not None:
                return turn
            self.pacer.counters.waited_s += wait
            await asyncio.sleep(wait)

    async def _once(self, method: str, path: str, **kw: Any) -> Any:
        try:
            response = await self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise Transient(f"{method} {path}: {type(e).__name__}: {e}") from None
        body = json_or_none(response)
        status = response.status_code
        if status == 429:
            if isinstance(body, dict) and body.get("error") == "search_quota_exceeded":
                reset_at = reset_time(response.headers.get("X-RateLimit-Reset"))
                raise SearchQuotaExceeded(quota_message(reset_at), reset_at)
            # a Retry-After is taken only as a wait this client would ever make (nan, negative, 1e9 and inf are
            # none): an unbounded one waited forever in the pacer every process of the install shares
            after = seconds_within(response.headers.get("Retry-After"), self._rate_limited_wait_s)
            raise RateLimited(f"{method} {path}: rate limited", after)
        if status >= 500:
            raise Transient(f"{method} {path}: HTTP {status}")
        # vast.ai's error bodies vary: some omit `success`, some `error`, some are not JSON at all. What an
        # error means is read from its status first and its words second; its shape never crashes us.
        msg = message(body) if body is not None else text_excerpt(response)
        error = body.get("error") if isinstance(body, dict) else None
        # the search, invoices and charges answer a wrong key with a 404 (DOCS search_offers.yaml), not a 401
        if status in (401, 403) or (status == 404 and error == "auth_error"):
            raise AuthError(f"the marketplace refused the API key: {msg}")
        if status >= 400:
            if error == "no_such_ask" or "no_such_ask" in msg:
                raise OfferGone(msg)
            if status == 404 or error in ("no_such_instance", "not_found"):
                raise NotFound(msg)
            if error == "insufficient_credit" or "insufficient credit" in msg.lower():
                raise CreditSpent(f"the account's credit is spent: {msg}")
            raise BadRequest(f"{method} {path}: HTTP {status}: {msg}")
        if body is None:
            raise MarketError(f"{method} {path}: HTTP {status} with a body that is not JSON")
        return body

    async def search(self, query: OfferQuery) -> Offers:
        # The pool (where, rentable now, enough GPU memory), and every filter the search understands unless
        # only the pool is asked for. fleet re-checks each of them on the answer (economics/offers.py).
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
        if not query.pool_only:
            body.update(search_filters(query))
        answer = await self._request("search", "POST", "/api/v0/bundles/", json=body)
        offers = answer.get("offers") if isinstance(answer, dict) else None
        if not isinstance(offers, list):
            raise MarketError("search answered without an offers list")
        found = Offers()
        for row in offers:
            try:
                found.append(Offer.from_raw(row))
            except MarketError as e:
                found.malformed += 1
                log.warning("search: %s (skipped)", e)
        return found

    async def create(self, offer_id: int, spec: InstanceSpec, on_sent: Callable[[], None] | None = None) -> int:
        env = dict(spec.env)
        env.update({f"-p {p}:{p}": "1" for p in spec.ports})
        body = {
            "client_id": "me",
            "image": spec.image,
            "disk": spec.disk_gb,
            "label": spec.label,
            "env": env,
            "onstart": spec.onstart,
            "runtype": RUNTYPE,
            "price": None,
            "cancel_unavail": True,
            # what vast.ai's SDK and CLI always send beside them (build_create_instance_payload), at their defaults
            "extra": None,
            "python_utf8": False,
            "lang_utf8": False,
            "use_jupyter_lab": False,
            "jupyter_dir": None,
            "force": False,
            "template_hash_id": None,
            "user": None,
        }
        if spec.image_login:
            body["image_login"] = spec.image_login
        # A create that may have been processed is never retried: a retry can buy twice.
        answer = await self._request(
            "create",
            "PUT",
            f"/api/v0/asks/{offer_id}/",
            json=body,
            retry_ambiguous=False,
            on_sent=on_sent,
            timeout=self._create_timeout_s,
        )
        if not isinstance(answer, dict):
            raise MarketError(f"create answered {str(answer)[:200]!r}")
        contract = answer.get("new_contract")
        if answer.get("success") is False or not is_number(contract):  # some answers omit `success`
            raise CreateFailed(
                f"create answered an error: {message(answer)}", int(contract) if is_number(contract) else None
            )
        return int(contract)

    async def get(self, instance_id: int) -> Instance | None:
        try:
            answer = await self._request("show", "GET", f"/api/v0/instances/{instance_id}/", params={"owner": "me"})
        except NotFound:
            return None
        if not isinstance(answer, dict) or "instances" not in answer:
            raise MarketError(f"show instance {instance_id}: malformed answer")
        row = answer["instances"]
        if row is None or (isinstance(row, dict) and reads_gone(row)):
            return None  # destroyed: null, 404, or a row that says so
        return instance_from_row(row)

    async def _listing(self, select_filters: dict[str, Any]) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            params = {
                "select_filters": json.dumps(select_filters),
                "order_by": json.dumps([{"col": "id", "dir": "asc"}]),
                "limit": str(PAGE),
            }
            if token:
                params["after_token"] = token
            answer = await self._request("list", "GET", "/api/v1/instances/", params=params)
            page = answer.get("instances") if isinstance(answer, dict) else None
            if not isinstance(page, list) or not answer.get("success", True):
                raise MarketError("instance listing was malformed; refusing to read it as 'no instances'")
            rows.extend(r for r in page if isinstance(r, dict) and not reads_gone(r))
            token = answer.get("next_token")
            if not token:
                return rows

    async def list(self, label_prefix: str) -> list[Instance]:
        rows = await self._listing({})
        return [instance_from_row(r) for r in rows if str(r.get("label") or "").startswith(label_prefix)]

    async def instances(self, ids: list[int]) -> dict[int, Instance]:
        found: dict[int, Instance] = {}
        async for page in self.instance_pages(ids):
            found.update(page)
        return found

    async def instance_pages(self, ids: list[int]) -> AsyncIterator[dict[int, Instance]]:
        wanted = sorted(ids)
        for start in range(0, len(wanted), PAGE):
            rows = await self._listing({"id": {"in": wanted[start : start + PAGE]}})
            yield {instance.id: instance for instance in map(instance_from_row, rows)}

    async def ensure_ssh_key(self, public_key: str) -> None:
        """Register our public key on the account (vast.ai puts the account's keys on new instances only).
        An account without keys answers the listing with 404; a deleted key stays listed, with
        `deleted_at` set, and does not count."""
        try:
            answer = await self._request("ssh_keys", "GET", "/api/v0/ssh/")
        except NotFound:
            answer = []
        rows = answer if isinstance(answer, list) else answer.get("keys", []) if isinstance(answer, dict) else []
        wanted = public_key.split()[:2]
        for row in rows:
            if not isinstance(row, dict) or row.get("deleted_at"):
                continue
            if str(row.get("public_key") or row.get("key") or "").split()[:2] == wanted:
                return
        await self._request("ssh_key_create", "POST", "/api/v0/ssh/", json={"ssh_key": public_key})

    async def attach_ssh_key(self, instance_id: int, public_key: str) -> None:
        """Put our key on one instance (POST /instances/{id}/ssh/, which needs instance_write), for an API key
        that may not register one on the account (POST /ssh/ needs user_write)."""
        await self._request("ssh_attach", "POST", f"/api/v0/instances/{instance_id}/ssh/", json={"ssh_key": public_key})

    async def maintenances(self, machine_ids: list[int]) -> list[Maintenance] | None:
        """The maintenance windows announced for these machines that have not ended (vast.ai's `show maints`:
        GET /machines/maintenances). vast-cli labels it a host's command, and only its api_scopes hint that a
        renter may call it: a refusal or an answer that is not a list of windows is None, "unknown", never an
        error that stops a search or a sweep."""
        found: list[Maintenance] = []
        for i in range(0, len(machine_ids), PAGE * 4):
            ids = sorted(set(machine_ids[i : i + PAGE * 4]))
            params = {"owner": "me", "machine_ids": json.dumps(ids)}
            try:
                answer = await self._request("maintenances", "GET", "/api/v0/machines/maintenances", params=params)
                found += maintenances_from(answer)
            except (RateLimited, Transient):
                raise  # retried already as far as allowed: the caller's to handle
            except MarketError as e:
                log.warning("maintenance windows unknown: %s", e)
                return None
        return found

    async def account_env_names(self) -> list[str] | None:
        """GET /secrets/ answers {"secrets": {NAME: VALUE}} (vast-cli's `show env-vars`), the values in clear:
        the names alone are kept, each bounded, and the answer dropped at once."""
        try:
            answer = await self._request("user", "GET", "/api/v0/secrets/")
        except (AuthError, NotFound):
            return None
        found = answer.get("secrets") if isinstance(answer, dict) else None
        if not isinstance(found, dict):
            return None
        return sorted(name[:64] for name in list(found)[:200] if isinstance(name, str) and name.isprintable())

    async def destroy(self, instance_id: int) -> bool:
        """Destroy; an instance already gone is destroyed (False). An answer of `success: false` (HTTP 200) is a
        refusal unless its error says there is no such instance (dstack reads it so): the instance may still
        bill."""
        try:
            answer = await self._request("destroy", "DELETE", f"/api/v0/instances/{instance_id}/", json={})
        except NotFound:
            return False
        if isinstance(answer, dict) and answer.get("success") is False:
            if answer.get("error") in ("no_such_instance", "not_found"):
                return False
            raise MarketError(f"instance {instance_id}: destroy refused: {message(answer)}")
        return True

    async def stop(self, instance_id: int) -> None:
        await self._set_state(instance_id, "stopped")

    async def start(self, instance_id: int) -> None:
        await self._set_state(instance_id, "running")

    async def _set_state(self, instance_id: int, state: str) -> None:
        # the vastai CLI's stop/start instance: PUT with the state wanted
        answer = await self._request("manage", "PUT", f"/api/v0/instances/{instance_id}/", json={"state": state})
        if isinstance(answer, dict) and answer.get("success") is False:
            raise MarketError(f"instance {instance_id}: {state} refused: {answer.get('msg') or answer.get('error')}")
