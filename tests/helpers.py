"""Small async helpers shared by the integration tests."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx

from fleet.localcloud import procs

TINY_REPO = "fleet-local/tiny-models"


async def rent(api: httpx.AsyncClient, offer_id: int, **body: Any) -> int:
    payload = {
        "client_id": "me",
        "image": "fleet/llama-server:test",
        "disk": 20,
        "env": {"-p 70000:70000": "1"},
        "label": "fleet:test",
        **body,
    }
    r = await api.put(f"/api/v0/asks/{offer_id}/", json=payload)
    assert r.status_code == 200, r.text
    return r.json()["new_contract"]


async def cheapest_offer(api: httpx.AsyncClient, **filters: Any) -> dict[str, Any]:
    body = {"rentable": {"eq": True}, "rented": {"eq": False}, "order": [["dph_total", "asc"]], **filters}
    r = await api.post("/api/v0/bundles/", json=body)
    r.raise_for_status()
    offers = r.json()["offers"]
    assert offers, "no offer left to rent"
    return offers[0]


async def wait_status(
    api: httpx.AsyncClient, instance_id: int, wanted: str | None, timeout_s: float = 20.0
) -> dict[str, Any] | None:
    """Poll show-instance until actual_status == wanted (None: until the instance is gone)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        r = await api.get(f"/api/v0/instances/{instance_id}/")
        r.raise_for_status()
        last = r.json()["instances"]
        if wanted is None and last is None:
            return None
        if last is not None and last["actual_status"] == wanted:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"instance {instance_id} never reached {wanted!r}; last: {last and last['actual_status']}")


async def destroy(api: httpx.AsyncClient, instance_id: int) -> None:
    r = await api.delete(f"/api/v0/instances/{instance_id}/")
    assert r.status_code in (200, 404), r.text


def processes_mentioning(path: Path) -> list[int]:
    """PIDs whose command line names `path` (a host's sshd names its config file in the state dir)."""
    needle = str(path).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def host_processes(state_dir: Path, instance_id: int | str, token: str) -> list[int]:
    """Every process of a local host still running: by its marker, or naming its directory (sshd)."""
    directory = Path(state_dir) / "hosts" / str(instance_id)
    return sorted(set(procs.pids_with_marker(token)) | set(processes_mentioning(Path(str(directory) + "/"))))


async def wait_health(client: httpx.AsyncClient, timeout_s: float = 10.0) -> None:
    """Poll llama-server's /health (on the client's base URL) until it answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{client.base_url} never became healthy")


async def kill_llama_server(ssh_host: str, ssh_port: int, key: Path) -> None:
    """Stop a fleet host's llama-server over SSH, with the host's own script (a dead server, for rotation)."""
    import shlex

    import asyncssh

    async with asyncssh.connect(
        ssh_host, port=ssh_port, username="root", known_hosts=None, client_keys=[str(key)]
    ) as ssh:
        await ssh.run(shlex.join(["fleet-stop-server", "fleet-run"]), check=True)
