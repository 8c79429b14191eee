"""certbot's manual hooks for fleet's ACME issuance (acme.py): `add` puts an HTTP-01 challenge's answer into the
running HAProxy's challenge map over its admin socket (0600: fleet's user alone), `del` takes it out. HAProxy
then answers the CA itself, for as long as the issuance asks and no longer.

certbot runs each hook with the challenge in CERTBOT_TOKEN and CERTBOT_VALIDATION, and fleet's issuance names
the socket and the map in the environment it gives certbot. What certbot hands over is checked to be what an
ACME challenge is (base64url words) before any of it reaches the socket.

    python -m fleet.gateway.acmehook add|del
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

from fleet.gateway.runtime import Runtime, RuntimeApiError, checked

SOCKET_ENV = "FLEET_ACME_SOCKET"
MAP_ENV = "FLEET_ACME_MAP"
TOKEN = re.compile(r"[A-Za-z0-9_-]{1,256}")  # RFC 8555 8.3: base64url, no padding
ANSWER = re.compile(r"[A-Za-z0-9_-]{1,256}\.[A-Za-z0-9_-]{1,256}")  # the token, a dot, the key's thumbprint


def command(action: str, env: dict[str, str]) -> str:
    """The admin socket's command for this hook; ValueError when anything in it is not what ACME sends."""
    token, answer, table = env.get("CERTBOT_TOKEN", ""), env.get("CERTBOT_VALIDATION", ""), env.get(MAP_ENV, "")
    if not TOKEN.fullmatch(token):
        raise ValueError(f"CERTBOT_TOKEN {token[:40]!r} is not an ACME token")
    if action == "add":
        if not ANSWER.fullmatch(answer) or not answer.startswith(token + "."):
            raise ValueError(f"CERTBOT_VALIDATION {answer[:40]!r} is not this token's key authorization")
        return checked("add", "map", table, token, answer)
    if action == "del":
        return checked("del", "map", table, token)
    raise ValueError(f"{action!r}: add or del")


def main(argv: list[str]) -> int:
    env = dict(os.environ)
    try:
        line = command(argv[1] if len(argv) == 2 else "", env)
        asyncio.run(Runtime(Path(env[SOCKET_ENV])).must(line))
    except (ValueError, KeyError, RuntimeApiError) as e:
        print(f"fleet acme hook: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
