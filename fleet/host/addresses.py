"""Addresses the marketplace gives for a host, taken only when they are somewhere fleet may connect.

A listing that named 10.0.0.5 or 169.254.169.254 would have fleet connect into its own network, or a
cloud's metadata service, with a host's key in hand. A host's address must be a global IP (loopback
only for the local cloud, which runs its hosts on this machine); the SSH gateway may be a name, vast.ai's own
(`sshN.vast.ai`) and no other (`localhost`, `2130706433`, `127.1` or full-width digits would lead anywhere), and
the addresses it resolves to are held to the same rule before fleet connects.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket

from fleet.host.phase import PhaseFailed

SSH_GATEWAY_NAME = re.compile(r"ssh[0-9]{1,4}\.vast\.ai", re.ASCII)

# Global by Python's reckoning, yet each leads elsewhere: an IPv6 address that carries an IPv4 one (NAT64's
# well-known and local prefixes, 6to4, the old IPv4-compatible form, IPv4-mapped) reaches whatever IPv4
# address it embeds, a private one included, through a translator; 192.0.0.0/24 is the IETF's protocol
# assignments (DS-Lite's B4 and AFTR among them), never a rented machine.
# (and SIIT's IPv4-translated ::ffff:0:0:0/96); 192.0.0.0/24 is the IETF's protocol assignments, fec0::/10 the
# deprecated site-local range: neither a rented machine
EMBEDDING = [
    ipaddress.ip_network(n)
    for n in ("64:ff9b::/96", "64:ff9b:1::/48", "2002::/16", "::/96", "::ffff:0:0/96", "::ffff:0:0:0/96")
]
NOT_A_HOST = [ipaddress.ip_network("192.0.0.0/24"), ipaddress.ip_network("fec0::/10")]


def refusal(address: str, *, loopback_ok: bool, names_ok: bool = False) -> str | None:
    """Why `address` is no place to connect to; None when it is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        if names_ok and SSH_GATEWAY_NAME.fullmatch(address):
            return None
        what = "vast.ai's SSH gateway (sshN.vast.ai)" if names_ok else "an IP address"
        return f"the marketplace gave {address[:60]!r} where {what} belongs"
    if ip.is_loopback and loopback_ok:
        return None
    if any(ip in n for n in EMBEDDING if n.version == ip.version):
        return f"the marketplace gave {ip}, which carries an IPv4 address through a translator"
    if not ip.is_global or ip.is_multicast or any(ip in n for n in NOT_A_HOST if n.version == ip.version):
        return f"the marketplace gave {ip}, which is not a global address"
    return None


def require(address: str, *, loopback_ok: bool, names_ok: bool = False) -> None:
    """PhaseFailed("boot") when `address` is no place to connect to: the machine's listing is to blame."""
    why = refusal(address, loopback_ok=loopback_ok, names_ok=names_ok)
    if why:
        raise PhaseFailed("boot", why)


async def require_resolved(address: str, port: int, *, loopback_ok: bool) -> None:
    """As `require` for an SSH endpoint, a name allowed; a name's every address held to the same rule."""
    require(address, loopback_ok=loopback_ok, names_ok=True)
    try:
        ipaddress.ip_address(address)
        return
    except ValueError:
        pass
    try:
        found = await asyncio.get_running_loop().getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise PhaseFailed("boot", f"the marketplace's SSH gateway {address} does not resolve: {e}") from None
    for *_, sockaddr in found:
        why = refusal(str(sockaddr[0]), loopback_ok=loopback_ok)
        if why:
            raise PhaseFailed("boot", f"its SSH gateway {address} resolves to {sockaddr[0]}: {why}")
