"""A host's TLS certificate: its key made on the host, the request read over the pinned SSH session, the
certificate signed here by fleet's CA for the address the marketplace gives, and put back on the host."""

from __future__ import annotations

import datetime as dt
import ipaddress
from urllib.parse import urlsplit

import asyncssh

from fleet.context import Context
from fleet.core import tls
from fleet.core.models import Host, HostState
from fleet.engines import RUN_DIR
from fleet.host.phase import PhaseFailed
from fleet.host.remote import RemoteError, run

# A host whose contract fleet does not know gets a certificate for this long. The health sweep replaces a
# host, make-before-break, before its certificate ends (llama-server reads it only at start: renewing it in
# place would restart the server under the calls it carries).
UNBOUNDED_HOST_DAYS = 30


def https_url(address: str, port: int) -> str:
    """The URL of a host's server; the address must be an IP (the certificate names it, not a name)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise PhaseFailed("start", f"the marketplace gave {address[:60]!r}, not an IP address") from None
    return f"https://[{ip}]:{port}" if ip.version == 6 else f"https://{ip}:{port}"


def refuse_held(ctx: Context, host: Host, api_url: str) -> None:
    """A host's server must be at an address and port of its own: one another open host serves at (a listing
    that names another host's place), or the gateway's own door, gets no certificate from fleet's CA."""
    live = tuple(s for s in HostState if s not in (HostState.FAILED, HostState.DESTROYING, HostState.DESTROYED))
    for other in ctx.record.hosts(states=live):
        if other.id != host.id and other.api_url == api_url:
            raise PhaseFailed("start", f"the marketplace gave {api_url}, where host {other.name} serves")
    parts = urlsplit(api_url)
    gateway = ctx.settings.gateway
    gateway_addresses = {gateway.listen, *gateway.names}
    gateway_ports = {t.port or gateway.port + i for i, t in enumerate(ctx.settings.serve)}
    if parts.hostname in gateway_addresses and parts.port in gateway_ports:
        raise PhaseFailed("start", f"the marketplace gave {api_url}, the gateway's own door")
    # a certificate names an address, never a port: one for the gateway's address would pass at its door
    # whatever port the listing gave (loopback is the local cloud's alone: its hosts run on this machine)
    if (ip := _ip(parts.hostname)) is not None and not ip.is_loopback and ip in gateway_ips(ctx):
        raise PhaseFailed("start", f"the marketplace gave {api_url}, an address of the gateway's")


def gateway_ips(ctx: Context) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP addresses agents reach the gateway by: its listen address (unless every interface) and the IPs
    among its names."""
    gateway = ctx.settings.gateway
    found = {_ip(a) for a in (gateway.listen, *gateway.names)}
    return {ip for ip in found if ip is not None and not ip.is_unspecified}


def _ip(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address((text or "").strip("[]"))
    except ValueError:
        return None


def lifetime_end(contract_end: dt.datetime | None, now: dt.datetime | None = None) -> dt.datetime:
    """When a host's certificate ends: with its contract, and never more than UNBOUNDED_HOST_DAYS away."""
    now = now or dt.datetime.now(dt.UTC)
    longest = now + dt.timedelta(days=UNBOUNDED_HOST_DAYS)
    if contract_end is None:
        return longest
    if contract_end.tzinfo is None:
        contract_end = contract_end.replace(tzinfo=dt.UTC)
    return min(contract_end, longest)


async def install(
    conn: asyncssh.SSHClientConnection,
    ca: tls.CertificateAuthority,
    address: str,
    name: str,
    not_after: dt.datetime,
) -> None:
    """The host makes its key (or keeps the one it has) and asks; fleet signs for `address`; the host
    installs the certificate. PhaseFailed blames the machine: a healthy host does not fail this."""
    try:
        request = await run(conn, ["fleet-tls", "request", RUN_DIR], timeout_s=60)
        pem = str(request.stdout or "").encode()
        certificate = tls.sign_host(ca, pem, address, name, not_after)
        await run(conn, ["fleet-tls", "install", RUN_DIR], stdin=certificate.decode(), timeout_s=60)
    except (RemoteError, tls.CertificateRequestRefused) as e:
        raise PhaseFailed("start", f"TLS: {e}") from None
