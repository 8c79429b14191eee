"""Addresses the marketplace gives for a host, taken only when they are somewhere fleet may connect.

A listing that named 10.0.0.5 or 169.254.169.254 would have fleet connect into its own network, or a
cloud's metadata service, with a host's key in hand. A host's address must be a global IP (loopback
only for the local cloud, which runs its hosts on this machine); the SSH gateway may be a name (vast.ai's
`sshN.vast.ai`), which the pinned host key answers for.
"""

from __future__ import annotations

import ipaddress

from fleet.host.phase import PhaseFailed


def refusal(address: str, *, loopback_ok: bool, names_ok: bool = False) -> str | None:
    """Why `address` is no place to connect to; None when it is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        if names_ok and address and len(address) <= 253 and all(p.isalnum() or p in "-." for p in address):
            return None
        return f"the marketplace gave {address[:60]!r} where an IP address belongs"
    if ip.is_loopback and loopback_ok:
        return None
    if not ip.is_global:
        return f"the marketplace gave {ip}, which is not a global address"
    return None


def require(address: str, *, loopback_ok: bool, names_ok: bool = False) -> None:
    """PhaseFailed("boot") when `address` is no place to connect to: the machine's listing is to blame."""
    why = refusal(address, loopback_ok=loopback_ok, names_ok=names_ok)
    if why:
        raise PhaseFailed("boot", why)
