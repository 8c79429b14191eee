"""Where a host downloads a model file from, found on this machine so that no host needs the hub's token.

The hub answers a file's resolve URL with its sha256 and size and a 302 to a signed, short-lived CDN URL.
fleet asks without the Hugging Face token first and shows it only when the hub asks for it (a gated
repo); the host gets the signed URL alone. A host's owner is root on the machine: whatever it is given,
they read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpx

from fleet.host.phase import PhaseFailed

_REDIRECTS = (301, 302, 303, 307, 308)
# Where Hugging Face's resolve URLs send a download: its own hosts and its CDNs (LFS and Xet), by domain.
HUB_CDN_DOMAINS = ("huggingface.co", "hf.co")


@dataclass(frozen=True)
class HubFile:
    url: str  # the hub's resolve URL
    sha256: str
    size: int
    download_url: str  # what a host is given: the signed CDN URL (or `url` for a public file served in place)


async def resolve(url: str, hf_token: str, timeout_s: float = 30.0, pinned_sha256: str | None = None) -> HubFile:
    """The file at `url`: its sha256 and size as the hub states them, and the URL a host may fetch it from.
    `pinned_sha256` (the profile's): a hub that states another sha256 is refused before any host pulls."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            r = await client.head(url, follow_redirects=False)
            gated = r.status_code in (401, 403)
            if gated and hf_token:
                r = await client.head(url, headers={"Authorization": f"Bearer {hf_token}"}, follow_redirects=False)
    except httpx.HTTPError as e:
        raise PhaseFailed("pull", f"the hub did not answer for {url}: {type(e).__name__}", blacklist=False) from None
    code = r.headers.get("X-Error-Code", "")[:40]
    if r.status_code in (401, 403):
        why = "$HF_TOKEN does not open it" if hf_token else "gated or private, and $HF_TOKEN is not set"
        raise PhaseFailed(
            "pull", f"the hub refuses {url} (HTTP {r.status_code} {code}): {why}", blacklist=False, retry=False
        )
    if r.status_code == 404:
        raise PhaseFailed("pull", f"the hub has no {url} (HTTP 404 {code})", blacklist=False, retry=False)
    sha256 = (r.headers.get("X-Linked-Etag") or "").strip('"')
    size = r.headers.get("X-Linked-Size") or ""
    if r.status_code >= 400 or not re.fullmatch(r"[0-9a-f]{64}", sha256) or not size.isdigit():
        raise PhaseFailed("pull", f"the hub gave no sha256 for {url} (HTTP {r.status_code})", blacklist=False)
    if pinned_sha256 is not None and sha256 != pinned_sha256:
        raise PhaseFailed(
            "pull",
            f"the hub serves {url} with sha256 {sha256}, not the {pinned_sha256} fleet.toml pins",
            blacklist=False,
            retry=False,
        )
    if r.status_code in _REDIRECTS and r.headers.get("Location"):
        download_url = urljoin(url, r.headers["Location"])
        why = redirect_refusal(url, download_url)
        if why:
            raise PhaseFailed("pull", f"the hub sent {url} {why}", blacklist=False, retry=False)
    elif gated:
        raise PhaseFailed(
            "pull",
            f"the hub serves the gated {url} without a signed redirect: fleet will not hand a host your token",
            blacklist=False,
            retry=False,
        )
    else:
        download_url = url
    return HubFile(url, sha256, int(size), download_url)


def redirect_refusal(url: str, target: str) -> str | None:
    """Why a host must not be sent to `target`, where the hub's `url` redirected; None when it may. A host pulls
    over https from the hub itself or its CDN alone: another place could be anything the answer names (a
    metadata service, another host), and plain http any network in the middle. The hub's own origin, as it was
    reached, stays allowed (the local cloud's hub serves its CDN itself, over loopback)."""
    hub, to = urlsplit(url), urlsplit(target)
    host = (to.hostname or "").lower()
    if (to.scheme, to.netloc) == (hub.scheme, hub.netloc):
        return None
    if to.scheme != "https":
        return f"to a {to.scheme or 'relative'}:// URL: a download goes over https alone"
    if host != (hub.hostname or "").lower() and not any(host == d or host.endswith("." + d) for d in HUB_CDN_DOMAINS):
        return f"to {host[:80]!r}, which is neither the hub nor its CDN"
    return None
