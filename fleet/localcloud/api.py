"""The HTTP face of the local cloud: vast.ai's REST paths, bodies and errors, plus the hub and admin.

Bodies are sent with `Content-Type: application/json` exactly (the vastai CLI rejects anything
else). Search and gpu names are public, as on vast.ai; the rest needs `Authorization: Bearer`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from fleet.localcloud.cloud import ApiError, Cloud
from fleet.localcloud.hub import Hub
from fleet.localcloud.logs import DEFAULT_TAIL

log = logging.getLogger("fleet.localcloud.api")

PUBLIC_PATHS = ("/api/v0/bundles", "/api/v0/gpu_names/unique", "/api/v0/gpu_types")
WRONG_KEY_404 = ("/api/v0/bundles", "/api/v0/invoices", "/api/v0/charges")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(data).encode(),
        headers={"Content-Type": "application/json"},
    )


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ApiError(400, "invalid_args", f"error 400/1782: Invalid args: invalid json: {e}") from None


def _int_param(request: web.Request, name: str) -> int:
    try:
        return int(request.match_info[name])
    except ValueError:
        raise ApiError(400, "invalid_args", f"invalid {name}") from None


def build_app(cloud: Cloud, hub: Hub) -> web.Application:
    @web.middleware
    async def vast_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        # the hub's API (/api/models/, Hugging Face's, another host on the real internet) is not vast.ai's
        vast = path.startswith("/api/") and not path.startswith("/api/models/")
        api = vast or path.startswith("/admin/")
        try:
            if vast:
                await cloud.retire_expired()  # what vast.ai deletes in its own time, gone before any answer
                await cloud.delete_unpaid()
                if cloud.dice.fire(cloud.faults.rate_limit, path, request.method):
                    after = cloud.faults.rate_limit.retry_after if cloud.faults.rate_limit else None
                    return web.Response(
                        status=429,
                        text="API requests too frequent endpoint threshold=4.5",
                        content_type="text/plain",
                        headers={"Retry-After": after} if after is not None else None,
                    )
                if cloud.dice.fire(cloud.faults.server_error, path, request.method):
                    status = cloud.faults.server_error.status if cloud.faults.server_error else 503
                    return web.Response(
                        status=status, text="Service Temporarily Unavailable", content_type="text/plain"
                    )
                refusal = cloud.limiter.check(request.method, _route(request), _identity(request), request.remote or "")
                if refusal is not None:
                    if isinstance(refusal.body, str):
                        return web.Response(
                            status=refusal.status, text=refusal.body, content_type="text/plain", headers=refusal.headers
                        )
                    response = json_response(refusal.body, refusal.status)
                    response.headers.update(refusal.headers)
                    return response
            # a public path takes a request with no key; one that names a key is held to that key's permissions
            # (a scoped key without `misc` may not search offers)
            named = "Authorization" in request.headers or "api_key" in request.query
            if api and (named or not path.startswith(PUBLIC_PATHS)):
                _check_auth(request, cloud.api_key, cloud.faults.scoped_keys)
            late = vast and cloud.dice.fire(cloud.faults.slow, path)
            response = await handler(request)
            if late and cloud.faults.slow is not None:
                await asyncio.sleep(cloud.faults.slow.delay_s)
            return response
        except ApiError as e:
            if isinstance(e.body, str):
                return web.Response(status=e.status, text=e.body, content_type="text/plain")
            return json_response(e.body, e.status)
        except web.HTTPException as e:
            if not api:
                raise
            return json_response(
                {"success": False, "error": "not_found" if e.status == 404 else "invalid_args", "msg": e.reason},
                e.status,
            )
        except Exception:  # an emulator bug must still answer in vast.ai's shape, and be logged
            log.exception("unhandled error on %s %s", request.method, path)
            if not api:
                raise
            return json_response({"success": False, "error": "server_error", "msg": "internal error"}, 500)

    @web.middleware
    async def saved_before_answer(request: web.Request, handler: Handler) -> web.StreamResponse:
        """What an answer shows, or a call changed, is on disk before the answer is sent (state.py)."""
        try:
            return await handler(request)
        finally:
            cloud.writer.flush()

    app = web.Application(middlewares=[saved_before_answer, vast_errors])
    r = app.router

    async def search(request: web.Request) -> web.Response:
        return json_response({"offers": cloud.search(await read_json(request))})

    async def create(request: web.Request) -> web.Response:
        offer_id = _int_param(request, "id")
        new_id = cloud.create(offer_id, await read_json(request))
        return json_response({"success": True, "new_contract": new_id})

    async def list_v1(request: web.Request) -> web.Response:
        return json_response(cloud.list_rows(dict(request.query)))

    async def show(request: web.Request) -> web.Response:
        return json_response({"instances": cloud.get(_int_param(request, "id"))})

    async def manage(request: web.Request) -> web.Response:
        return json_response(cloud.manage(_int_param(request, "id"), await read_json(request)))

    async def destroy(request: web.Request) -> web.Response:
        instance_id = _int_param(request, "id")
        await request.read()
        if cloud.faults.destroy_refused > 0 and instance_id in cloud.state.instances:
            cloud.faults.destroy_refused -= 1
            return json_response(
                {"success": False, "error": "destroy_failed", "msg": f"Instance {instance_id} could not be destroyed."}
            )
        await cloud.destroy(instance_id)
        return json_response({"success": True, "msg": f"Instance {instance_id} destroyed."})

    async def legacy_list(request: web.Request) -> web.Response:
        return json_response(
            {
                "success": False,
                "error": "deprecated_endpoint",
                "msg": "/api/v0/instances/ is deprecated. Use /api/v1/instances/ instead.",
            },
            410,
        )

    async def request_logs(request: web.Request) -> web.Response:
        instance_id = _int_param(request, "id")
        body = await read_json(request)
        # vast-cli sends the tail as a string
        tail = str(body.get("tail", DEFAULT_TAIL) if isinstance(body, dict) else DEFAULT_TAIL)
        token = cloud.request_logs(instance_id, int(tail) if tail.isdigit() else DEFAULT_TAIL)
        return json_response({"success": True, "result_url": f"{request.url.origin()}/logs/{token}"})

    async def log_text(request: web.Request) -> web.Response:
        # another server's URL on vast.ai (a bucket's), read without the API key
        text = cloud.logs.text(request.match_info["token"])
        if text is None:
            return web.Response(status=404, text="NoSuchKey", content_type="text/plain")
        return web.Response(text=text, content_type="text/plain")

    async def user(request: web.Request) -> web.Response:
        return json_response(cloud.user())

    async def env_list(request: web.Request) -> web.Response:
        return json_response({"secrets": dict(cloud.state.account_env)})

    async def env_set(request: web.Request) -> web.Response:
        # vast.ai: "Environment variable key name (will be converted to uppercase)"; POST adds, PUT updates
        body = await request.json()
        key, value = (
            body.get("key") if isinstance(body, dict) else None,
            body.get("value") if isinstance(body, dict) else None,
        )
        if not isinstance(key, str) or not key or not isinstance(value, str):
            raise ApiError(400, "invalid_args", "key and value are required")
        cloud.state.account_env[key.upper()] = value
        cloud.save()
        return json_response({"success": True, "msg": "Environment variable added successfully"})

    async def env_delete(request: web.Request) -> web.Response:
        body = await request.json()
        key = body.get("key") if isinstance(body, dict) else None
        if not isinstance(key, str) or cloud.state.account_env.pop(key.upper(), None) is None:
            raise ApiError(404, "not_found", "Environment variable not found")
        cloud.save()
        return json_response({"success": True, "msg": "Operation completed successfully"})

    async def charges(request: web.Request) -> web.Response:
        try:
            filters = json.loads(request.query.get("select_filters", "{}"))
        except ValueError:
            raise ApiError(400, "invalid_args", "Invalid args: select_filters is not JSON") from None
        return json_response(cloud.charges(filters))

    async def ssh_list(request: web.Request) -> web.Response:
        return json_response(cloud.ssh_keys())

    async def ssh_add(request: web.Request) -> web.Response:
        return json_response({"success": True, "key": cloud.add_ssh_key(await read_json(request))})

    async def ssh_attach(request: web.Request) -> web.Response:
        cloud.attach_ssh_key(_int_param(request, "id"), await read_json(request))
        return json_response({"success": True, "msg": "SSH key attached successfully"})

    async def ssh_delete(request: web.Request) -> web.Response:
        cloud.delete_ssh_key(_int_param(request, "id"))
        return json_response({"success": True})

    async def gpu_names(request: web.Request) -> web.Response:
        return json_response({"gpu_names": cloud.gpu_names()})

    async def admin_faults_get(request: web.Request) -> web.Response:
        return json_response(cloud.faults.to_dict())

    async def admin_faults_put(request: web.Request) -> web.Response:
        try:
            cloud.set_faults(await read_json(request))
        except (TypeError, ValueError) as e:
            raise ApiError(400, "invalid_args", f"Invalid args: {e}") from None
        return json_response(cloud.faults.to_dict())

    async def admin_offer_put(request: web.Request) -> web.Response:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "invalid_args", "Invalid args: expected an object of offer fields")
        return json_response(cloud.override_offer(_int_param(request, "id"), body))

    async def health(request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def admin_hub_stats(request: web.Request) -> web.Response:
        return json_response(
            {
                "bytes_served": hub.bytes_served,
                "token_requests": hub.token_requests,
                "host_token_requests": hub.host_token_requests,
                "refused_urls": hub.refused_urls,
            }
        )

    async def maintenances(request: web.Request) -> web.Response:
        if not cloud.faults.renter_reads_maintenances:
            raise ApiError(403, "forbidden", "only the host of these machines may read their maintenances")
        try:
            ids = json.loads(request.query.get("machine_ids", "[]"))
        except ValueError:
            ids = None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ApiError(400, "invalid_args", "machine_ids: a JSON list of machine ids")
        return json_response(cloud.maintenances(ids))

    async def admin_extend(request: web.Request) -> web.Response:
        body = await read_json(request)
        end = body.get("end_date") if isinstance(body, dict) else None
        if not isinstance(end, int | float):
            raise ApiError(400, "invalid_args", "end_date: epoch seconds")
        return json_response(cloud.extend_contract(_int_param(request, "id"), float(end)))

    async def admin_stats(request: web.Request) -> web.Response:
        return json_response({"rate_limited": cloud.limiter.refused})

    def both(method: str, path: str, handler: Handler) -> None:
        r.add_route(method, path, handler)
        r.add_route(method, path.rstrip("/") if path.endswith("/") else path + "/", handler)

    both("POST", "/api/v0/bundles/", search)
    both("PUT", "/api/v0/asks/{id}/", create)
    both("GET", "/api/v1/instances/", list_v1)
    both("GET", "/api/v0/instances/", legacy_list)
    both("GET", "/api/v0/instances/{id}/", show)
    both("PUT", "/api/v0/instances/{id}/", manage)
    both("DELETE", "/api/v0/instances/{id}/", destroy)
    both("GET", "/api/v0/users/current", user)
    both("GET", "/api/v0/charges/", charges)
    both("GET", "/api/v0/secrets/", env_list)
    both("POST", "/api/v0/secrets/", env_set)
    both("PUT", "/api/v0/secrets/", env_set)
    both("DELETE", "/api/v0/secrets/", env_delete)
    both("GET", "/api/v0/ssh/", ssh_list)
    both("POST", "/api/v0/ssh/", ssh_add)
    both("DELETE", "/api/v0/ssh/{id}/", ssh_delete)
    both("POST", "/api/v0/instances/{id}/ssh/", ssh_attach)
    both("PUT", "/api/v0/instances/request_logs/{id}/", request_logs)
    r.add_route("GET", "/logs/{token}", log_text)
    both("GET", "/api/v0/gpu_names/unique/", gpu_names)
    r.add_get("/health", health)  # the local cloud's own liveness, outside the faulted API
    both("GET", "/admin/faults", admin_faults_get)
    both("PUT", "/admin/faults", admin_faults_put)
    both("GET", "/api/v0/machines/maintenances", maintenances)
    both("PUT", "/admin/offers/{id}", admin_offer_put)
    both("PUT", "/admin/instances/{id}/contract", admin_extend)
    both("GET", "/admin/hub-stats", admin_hub_stats)
    both("GET", "/admin/stats", admin_stats)
    for route in hub.routes():
        r.add_route(route.method, route.path, route.handler)
    return app


def _route(request: web.Request) -> str:
    """The route template a request matched (`/api/v0/instances/{id}/`), or its path."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


def _identity(request: web.Request) -> tuple[str, str]:
    return request.headers.get("Authorization", ""), request.query.get("api_key", "")


# The permission each endpoint needs of a scoped key (vast-cli's scripts/data/api_scopes.json; the docs'
# permissions page). The account's own key has them all.
PERMISSIONS = {
    ("POST", "/api/v0/bundles/"): "misc",
    ("GET", "/api/v0/bundles/"): "misc",
    ("PUT", "/api/v0/asks/{id}/"): "instance_write",
    ("GET", "/api/v1/instances/"): "instance_read",
    ("GET", "/api/v0/instances/{id}/"): "instance_read",
    ("PUT", "/api/v0/instances/{id}/"): "instance_write",
    ("DELETE", "/api/v0/instances/{id}/"): "instance_write",
    ("POST", "/api/v0/instances/{id}/ssh/"): "instance_write",
    ("PUT", "/api/v0/instances/request_logs/{id}/"): "instance_read",
    ("GET", "/api/v0/users/current"): "user_read",
    ("GET", "/api/v0/ssh/"): "user_read",
    ("GET", "/api/v0/secrets/"): "user_read",
    ("POST", "/api/v0/secrets/"): "user_write",
    ("PUT", "/api/v0/secrets/"): "user_write",
    ("DELETE", "/api/v0/secrets/"): "user_write",
    ("POST", "/api/v0/ssh/"): "user_write",
    ("DELETE", "/api/v0/ssh/{id}/"): "user_write",
    ("GET", "/api/v0/charges/"): "billing_read",
    ("GET", "/api/v0/machines/maintenances"): "instance_read",
}


def _check_auth(request: web.Request, api_key: str, scoped: dict[str, list[str]]) -> None:
    header = request.headers.get("Authorization")
    key = request.query.get("api_key")
    if header:
        key = header[7:] if header.startswith("Bearer ") else header
    if key is None:
        raise ApiError(403, "auth_error", "This action requires login.")
    if secrets.compare_digest(key.encode(), api_key.encode()):
        return
    granted = next((perms for k, perms in scoped.items() if secrets.compare_digest(key.encode(), k.encode())), None)
    route = _route(request)
    if granted is None:
        # the search, invoices and charges say so with a 404 (DOCS search_offers.yaml, show_invoices.yaml,
        # show_charges.yaml), the rest with a 401 (show_instance.yaml)
        raise ApiError(404 if route.startswith(WRONG_KEY_404) else 401, "auth_error", "Invalid user key")
    needed = PERMISSIONS.get((request.method, route)) or PERMISSIONS.get((request.method, route.rstrip("/") + "/"))
    if needed is not None and needed not in granted:
        raise ApiError(401, "permission_denied", f"This API key lacks the {needed} permission")
