"""The SSH host key of a host fleet rents: the host makes it and announces its public half on its console,
which the marketplace's instance logs carry; fleet reads it there and pins it before its first connection.

The key is never made here and sent: whatever goes in a create call vast.ai shows back in every read of the
instance (`onstart`), to any API key that may read it and in the web console. A reader of the logs learns a
public key alone, and cannot write them: only the container's own processes print on its console, and
fleet reads the announcement before it starts anything there.

The platform's own init makes host keys and starts sshd before onstart runs: until fleet-host-key has
swapped its own key in, the host presents the platform's. A connection during that moment is tried again
(remote.connect, `settling`), never accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import asyncssh

from fleet.core.errors import FleetError
from fleet.market import Market, MarketError

ANNOUNCED = re.compile(r"(?:^|\s)fleet-host-key: (ssh-ed25519 [A-Za-z0-9+/]{40,100}={0,2})\s*$")
LOG_LINES = 1000  # the tail of the logs read: the announcement is among the container's first lines
POLL_S = 1.0


class HostKeyUnknown(FleetError):
    """The instance's logs never announced a host key, or announced more than one."""

    prefix = "host key"

    def __init__(self, message: str, *, conflicting: bool) -> None:
        super().__init__(message)
        self.conflicting = conflicting


def onstart() -> str:
    """The create call's onstart: no tmux around SSH sessions (vast.ai's SSH runtype wraps each login in tmux
    unless ~/.no_auto_tmux exists, as SkyPilot's onstart also says), then fleet-host-key. It holds no secret."""
    return "touch ~/.no_auto_tmux\nfleet-host-key\n"


def announced(text: str) -> list[str]:
    """The distinct host keys a log announces, in the order it announces them; each a well-formed ed25519
    public key ("ssh-ed25519 BASE64")."""
    keys: list[str] = []
    for line in text.splitlines():
        match = ANNOUNCED.search(line)
        if match is None or match.group(1) in keys:
            continue
        try:
            asyncssh.import_public_key(match.group(1))
        except (asyncssh.KeyImportError, ValueError):
            continue
        keys.append(match.group(1))
    return keys


async def learn(market: Market, instance_id: int, timeout_s: float) -> str:
    """The host key the instance announced in its logs, read until `timeout_s`. HostKeyUnknown when none
    came, or when they announce two: one is someone else's, and fleet cannot tell which."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        text = None
        with contextlib.suppress(MarketError):  # the logs refused for now: read again until the deadline
            text = await market.logs(instance_id, tail=LOG_LINES, wait_s=max(min(left, 30.0), 1.0))
        keys = announced(text or "")
        if len(keys) > 1:
            raise HostKeyUnknown(
                f"the instance's logs announce {len(keys)} different SSH host keys: fleet pins none of them",
                conflicting=True,
            )
        if keys:
            return keys[0]
        if time.monotonic() >= deadline:
            seen = "no logs answered" if text is None else f"{len(text.splitlines())} lines without one"
            raise HostKeyUnknown(
                f"the instance's logs announced no SSH host key within {timeout_s:g}s ({seen}; "
                f"timeouts.host_key): fleet connects to no key it has not read there",
                conflicting=False,
            )
        await asyncio.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
