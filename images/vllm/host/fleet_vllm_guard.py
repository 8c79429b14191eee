"""The host's key on every path of vLLM's server but /health.

vLLM checks its key only under /v1, /v2, /inference and /cohere: /invocations (the same inference),
/tokenize, /pause, /abort_requests and more would answer anyone who finds the host's public port. fleet-serve
loads this ASGI middleware (`--middleware fleet_vllm_guard.KeyOnEveryPath`), which reads the key from the
server's environment as vLLM does and refuses a request without it before vLLM sees it.
"""

import hashlib
import os
import secrets

OPEN_PATHS = ("/health",)  # a health check carries no key (the gateway's, fleet's own wait for start)
REFUSAL = b'{"error": "Unauthorized"}'


class KeyOnEveryPath:
    def __init__(self, app):
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:
            raise RuntimeError("fleet_vllm_guard: VLLM_API_KEY is not set")
        self.app = app
        self.digest = hashlib.sha256(key.encode()).digest()

    def _holds_key(self, scope):
        for name, value in scope.get("headers") or []:
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                given = hashlib.sha256(token.encode("latin-1")).digest()
                return scheme.lower() == "bearer" and secrets.compare_digest(given, self.digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN_PATHS or self._holds_key(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(REFUSAL)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": REFUSAL})
