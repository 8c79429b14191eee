"""The hosts' llama-server keys, derived rather than stored: HMAC-SHA256 of a secret kept beside fleet's SSH
key (a private file, never in the database) over the host's name and a nonce made at each start. The
database keeps the nonce alone, so a copy of it, a backup or a PostgreSQL reader holds no key that opens a
host; the endpoints file (private) carries the keys the agents need."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from pathlib import Path

from fleet.core.errors import FleetError
from fleet.core.files import write_private

SECRET_BYTES = 32


class KeySecretError(FleetError):
    """The secret file is there but is not one fleet made (wrong size): no key could be derived."""


def ensure_secret(path: Path) -> bytes:
    """The secret the hosts' keys derive from, made on first use (0600 from its first byte); two processes
    making it at once agree on one. Every machine that runs fleet against one database needs the same file."""
    if not path.exists():
        write_private(path, secrets.token_bytes(SECRET_BYTES))
    secret = path.read_bytes()
    if len(secret) != SECRET_BYTES:
        raise KeySecretError(f"{path}: {len(secret)} bytes, not the {SECRET_BYTES} fleet writes")
    return secret


def new_nonce() -> str:
    return secrets.token_hex(16)


def access_log_key(secret: bytes) -> bytes:
    """The key the gateway's access log hashes each call's name with (agent and call id: often a phone number
    or an email, which an unkeyed hash would let anyone with the log try guesses against)."""
    return hmac.new(secret, b"fleet gateway access log: call", hashlib.sha256).digest()


def cache_salt_key(secret: bytes) -> bytes:
    """The key the gateway makes each agent's cache salt with (a host reuses a cached prompt only for the same
    salt): the same on every gateway of the install, and no agent can compute another's."""
    return hmac.new(secret, b"fleet gateway cache salt", hashlib.sha256).digest()


def host_api_key(secret: bytes, host_name: str, nonce: str) -> str:
    """The key llama-server on `host_name` was started with (as long as `token_urlsafe(32)`)."""
    digest = hmac.new(secret, f"fleet host api key\n{host_name}\n{nonce}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
