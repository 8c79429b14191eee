"""What a voice agent needs from each READY host, and the file that set is published to on every change
(rotation.endpoints_file: written whole, private). Every URL is https://, its certificate signed by fleet's CA:
`ca_file` is what an agent verifies it with. The file carries a host's key only while no gateway of this
machine is the agents' door to it: an agent of a gateway holds its own key, never a host's."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any

from fleet.context import Context
from fleet.core.models import HostState


def endpoints(ctx: Context) -> list[dict[str, Any]]:
    return [
        {
            "name": h.name,
            "url": h.api_url,
            "base_url": f"{h.api_url}/v1",  # what the OpenAI SDK takes as base_url
            "model": h.model,
            "slots": h.slots,
            "region": h.region,
            "api_key": ctx.api_key(h),
            "ca_file": str(ctx.ca.certificate_path),  # the only CA a host's certificate verifies against
        }
        for h in ctx.record.hosts(states=(HostState.READY,))
    ]


def published(ctx: Context) -> list[dict[str, Any]]:
    """What the endpoints file holds: every READY host, its key only where no gateway here serves it."""
    served = {h.name for h in ctx.record.hosts(states=(HostState.READY,)) if ctx.gateway_serves(h)}
    return [{k: v for k, v in e.items() if k != "api_key" or e["name"] not in served} for e in endpoints(ctx)]


def publish_endpoints(ctx: Context) -> None:
    """Write the READY set to rotation.endpoints_file (whole, private), when it changed: through a temporary
    file of a name no one can guess, made by this call alone (never a file or link someone put there first)."""
    path = ctx.settings.rotation.endpoints_path
    text = json.dumps(published(ctx), indent=1, sort_keys=True) + "\n"
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # O_EXCL, mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


async def publish(ctx: Context) -> None:
    """The hosts a process serves changed: the endpoints file written, then each of the Context's listeners
    told (the gateway of this machine). A listener that fails is recorded, never raised: the change is made.
    One publish at a time in a Context: bring-ups and destroys side by side each publish, and two gateway syncs
    interleaved would each apply a difference read before the other's writes."""
    async with ctx.publishing:
        publish_endpoints(ctx)
        for listener in ctx.on_hosts_changed:
            try:
                await listener(ctx)
            except Exception as e:  # a gateway down must not undo a host's bring-up or destroy
                ctx.record.event("error", "publish", json.dumps({"error": f"{type(e).__name__}: {str(e)[:300]}"}))
