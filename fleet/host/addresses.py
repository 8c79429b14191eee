"""Addresses the marketplace gives for a host, taken only when they are somewhere fleet may connect.

A listing that named 10.0.0.5 or 169.254.169.254 would have fleet connect into its own network, or a
cloud's metadata service, with a host's key in hand. A host's address must be a global IP (loopback
only for the local cloud, which runs its hosts on this machine); the SSH gateway may be a name (vast.ai's
`sshN.vast.ai`), which the pinned host key answers for.
"""

from __future__ import annotations

import ipaddress

from fleet.host.phase import PhaseFailed

# Global by Python's reckoning, yet each leads elsewhere: an IPv6 address that carries an IPv4 one (NAT64's
# well-known and local prefixes, 6to4, the old IPv4-compatible form, IPv4-mapped) reaches whatever IPv4
# address it embeds, a private one included, through a translator; 192.0.0.0/24 is the IETF's protocol
# assignments (DS-Lite's B4 and AFTR among them), never a rented machine.
EMBEDDING = [ipaddress.ip_network(n) for n in ("64:ff9b::/96", "64:ff9b:1::/48", "2002::/16", "::/96", "::ffff:0:0/96")]
NOT_A_HOST = [ipaddress.ip_network("192.0.0.0/24")]


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
    if any(ip in n for n in EMBEDDING if n.version == ip.version):
        return f"the marketplace gave {ip}, which carries an IPv4 address through a translator"
    if not ip.is_global or any(ip in n for n in NOT_A_HOST if n.version == ip.version):
        return f"the marketplace gave {ip}, which is not a global address"
    return None


def require(address: str, *, loopback_ok: bool, names_ok: bool = False) -> None:
    """PhaseFailed("boot") when `address` is no place to connect to: the machine's listing is to blame."""
    why = refusal(address, loopback_ok=loopback_ok, names_ok=names_ok)
    if why:
        raise PhaseFailed("boot", why)
