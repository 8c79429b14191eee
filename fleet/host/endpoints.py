"""What a voice agent needs from each READY host, and the file that set is published to on every change
(rotation.endpoints_file: written atomically, private, API keys included). Every URL is https://, its
certificate signed by fleet's CA: `ca_file` is what an agent verifies it with."""

from __future__ import annotations

import json
import os
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


def publish_endpoints(ctx: Context) -> None:
    """Write the READY set to rotation.endpoints_file (atomically, private), when it changed."""
    path = ctx.settings.rotation.endpoints_path
    text = json.dumps(endpoints(ctx), indent=1, sort_keys=True) + "\n"
    if path.exists() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


async def publish(ctx: Context) -> None:
    """The hosts a process serves changed: the endpoints file written, then each of the Context's listeners
    told (the gateway of this machine). A listener that fails is recorded, never raised: the change is made."""
    publish_endpoints(ctx)
    for listener in ctx.on_hosts_changed:
        try:
            await listener(ctx)
        except Exception as e:  # a gateway down must not undo a host's bring-up or destroy
            ctx.record.event("error", "publish", json.dumps({"error": f"{type(e).__name__}: {str(e)[:300]}"}))
