"""The SSH host key a host is rented with: fleet makes it, the create call's onstart installs it, and the
first connection is pinned to it: no connection to a host is ever trusted on first use.

The platform's own init makes host keys and starts sshd before onstart runs: until fleet-host-key has
swapped the key in, the host presents the platform's. A connection during that moment is tried again
(remote.connect, `settling`), never accepted.
"""

from __future__ import annotations

from fleet.core.keys import HostKey

DELIMITER = "FLEET_HOST_KEY_END"


def onstart(key: HostKey) -> str:
    """The create call's onstart: no tmux around SSH sessions (vast.ai's SSH runtype wraps each login in tmux
    unless ~/.no_auto_tmux exists, as SkyPilot's onstart also says), then the private key to fleet-host-key on
    its stdin (a here-document: on no command line), which installs it and has sshd read it again."""
    body = key.private.strip()
    if DELIMITER in body:  # an OpenSSH key is base64 between two markers: this cannot be one
        raise ValueError("not an OpenSSH private key")
    return f"touch ~/.no_auto_tmux\nfleet-host-key <<'{DELIMITER}'\n{body}\n{DELIMITER}\n"
