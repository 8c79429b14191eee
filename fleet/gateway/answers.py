"""What the gateway answers itself, never a host: OpenAI's error shape for every refusal, with a `type` and a
`code` a client can act on and `Retry-After` where trying again can succeed; and the models it serves."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    status: int
    kind: str  # OpenAI's error `type`
    code: str  # what a client's code can branch on
    message: str  # never holds a quote or a backslash: it goes into HAProxy's configuration as is
    retry: bool = False  # a retry can succeed: the answer carries Retry-After

    def body(self) -> str:
        error = {"message": self.message, "type": self.kind, "param": None, "code": self.code}
        return json.dumps({"error": error}, separators=(",", ":"))

    def rule(self, retry_after_s: int) -> str:
        """HAProxy's `return` (or `http-error`) arguments that answer it."""
        after = f" hdr Retry-After {retry_after_s}" if self.retry else ""
        return f"status {self.status} content-type application/json string '{self.body()}'{after}"


NOT_FOUND = Refusal(404, "invalid_request_error", "not_found", "only /v1/chat/completions and /v1/models are served")
BAD_KEY = Refusal(401, "invalid_request_error", "invalid_api_key", "no valid agent key")
NOT_ALLOWED = Refusal(405, "invalid_request_error", "method_not_allowed", "GET /v1/models, POST /v1/chat/completions")
NO_LENGTH = Refusal(411, "invalid_request_error", "length_required", "the request needs a Content-Length")
NOT_AGENTS = Refusal(
    404, "invalid_request_error", "not_found", "this port answers the ACME CA alone: agents use the gateway https URL"
)
HEADERS_TOO_LARGE = Refusal(431, "invalid_request_error", "headers_too_large", "the request headers are over 16 KB")
CALL_ID_TOO_LONG = Refusal(
    400, "invalid_request_error", "invalid_call_id", "a call id (X-Session-Id, user, prompt_cache_key) over 63 bytes"
)


def too_large(limit_kb: int) -> Refusal:
    return Refusal(413, "invalid_request_error", "request_too_large", f"the request body is over {limit_kb} KB")


NOT_CHAT = Refusal(400, "invalid_request_error", "invalid_body", "the body is not a chat request in JSON")
NOT_OURS = Refusal(400, "invalid_request_error", "invalid_body", "id_slot is not for agents: the gateway places calls")
ONE_COMPLETION = Refusal(400, "invalid_request_error", "invalid_body", "one completion a request: n must be 1")
TOO_MANY_NEW_CALLS = Refusal(
    429, "rate_limit_exceeded", "too_many_new_calls", "this agent starts new calls too fast: retry", retry=True
)
FULL = Refusal(503, "overloaded", "full", "every host of this target is full: retry", retry=True)
NO_HOST = Refusal(503, "service_unavailable", "no_host", "no host serves this target now: retry", retry=True)
# what HAProxy itself answers when a host fails under a request (before its first byte), or none is there
HOST_FAILED = Refusal(502, "server_error", "host_failed", "the host failed this request: retry", retry=True)
HOST_GONE = Refusal(503, "service_unavailable", "no_host", "no host could take this request: retry", retry=True)
HOST_TIMEOUT = Refusal(504, "server_error", "host_timeout", "the host did not answer in time: retry", retry=True)


def not_served(alias: str) -> Refusal:
    """A model this URL does not serve (the alias is a profile's name: letters, digits, _ . -)."""
    return Refusal(404, "invalid_request_error", "model_not_found", f"this URL serves the model {alias} alone")


def model(alias: str) -> dict[str, object]:
    return {"id": alias, "object": "model", "created": 0, "owned_by": "fleet"}


def models(alias: str) -> dict[str, object]:
    return {"object": "list", "data": [model(alias)]}
