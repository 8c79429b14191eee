"""Each agent's prefix cache apart: a request's cache salt is the one fleet's gateway sets in a header.

vLLM reuses cached blocks only for requests of the same `cache_salt` (a body field). fleet's gateway puts each
agent's salt (an HMAC of its name, or of its cache group's) in the X-Fleet-Cache-Salt header of every
request it sends, replacing any an agent sent. fleet-serve loads this ASGI middleware (`--middleware
fleet_vllm_salt.CacheSaltFromHeader`), which writes that header's value into the JSON body's `cache_salt`
and drops any salt the body named, so no agent reuses, or learns of, a prompt another agent's request
cached: a request without the header (fleet's own probes) has no salt. The header's name is fleet's
CACHE_SALT_HEADER (fleet/engines/__init__.py), which a test holds equal.
"""

import json

HEADER = b"x-fleet-cache-salt"


class CacheSaltFromHeader:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        salt = None
        for name, value in scope.get("headers") or []:
            if name.lower() == HEADER:
                salt = value.decode("latin-1")
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: vLLM hears it
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            data = json.loads(body)
        except ValueError:
            data = None  # not JSON: vLLM answers it as it does
        if isinstance(data, dict):
            data.pop("cache_salt", None)
            if salt:
                data["cache_salt"] = salt
            body = json.dumps(data).encode()
        headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        message = {"type": "http.request", "body": body, "more_body": False}
        return await self.app({**scope, "headers": headers}, _replay([message], receive), send)


def _replay(messages, receive):
    """A receive that hands out these messages first, then the client's own."""
    pending = list(messages)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
