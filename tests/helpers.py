"""Small async helpers shared by the integration tests."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from fleet.localcloud import procs

TINY_REPO = "fleet-local/tiny-models"


@asynccontextmanager
async def http_server(routes: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]) -> AsyncIterator[str]:
    """A real HTTP server on a free loopback port answering GET `routes` (path -> handler); yields its base URL."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


SERVICE_PORT = 18080


async def polite(api: httpx.AsyncClient, method: str, path: str, **kw: Any) -> httpx.Response:
    """A request that waits out vast.ai's rate limits like a good client: after a 429, its Retry-After, else
    the endpoint's interval (create: its 12 s penalty, which a retry inside it would only renew)."""
    for _ in range(20):
        r = await api.request(method, path, **kw)
        if r.status_code != 429:
            return r
        after = r.headers.get("Retry-After")
        await asyncio.sleep(float(after) + 0.05 if after else 12.2 if "/asks/" in path else 3.2)
    raise AssertionError(f"{method} {path}: still rate limited")


async def rent(api: httpx.AsyncClient, offer_id: int, **body: Any) -> int:
    payload = {
        "client_id": "me",
        "image": "fleet/llama-server:test",
        "disk": 20,
        "env": {f"-p {SERVICE_PORT}:{SERVICE_PORT}": "1"},
        "label": "fleet:test",
        "runtype": "ssh_direc ssh_proxy",
        **body,
    }
    r = await polite(api, "PUT", f"/api/v0/asks/{offer_id}/", json=payload)
    assert r.status_code == 200, r.text
    return r.json()["new_contract"]


def mapped(row: dict[str, Any], container_port: int) -> tuple[str, int]:
    """Where the outside reaches a container port: the public IP and the external port `ports` lists."""
    return row["public_ipaddr"], int(row["ports"][f"{container_port}/tcp"][0]["HostPort"])


async def listed_instances(api: httpx.AsyncClient) -> list[dict[str, Any]]:
    r = await polite(api, "GET", "/api/v1/instances/")
    r.raise_for_status()
    return r.json()["instances"]


async def cheapest_offer(api: httpx.AsyncClient, **filters: Any) -> dict[str, Any]:
    # an amd64 machine, as fleet asks: the images the tests rent are amd64 (an arm64 one could not start them)
    body = {
        "rentable": {"eq": True},
        "rented": {"eq": False},
        "cpu_arch": {"eq": "amd64"},
        "order": [["dph_total", "asc"]],
    }
    body |= filters
    r = await polite(api, "POST", "/api/v0/bundles/", json=body)
    r.raise_for_status()
    offers = r.json()["offers"]
    assert offers, "no offer left to rent"
    return offers[0]


async def offer_of_machine(cloud: Any, machine: int) -> dict[str, Any]:
    async with cloud.client() as api:
        return await cheapest_offer(api, machine_id={"eq": machine})


async def set_offer(cloud: Any, offer_id: int, **fields: Any) -> None:
    """Change an offer's fields (its end, its link, its price) as its machine's host would."""
    async with cloud.client() as api:
        r = await api.put(f"/admin/offers/{offer_id}", json=fields)
        r.raise_for_status()


async def wait_status(
    api: httpx.AsyncClient, instance_id: int, wanted: str | None, timeout_s: float = 20.0
) -> dict[str, Any] | None:
    """Poll show-instance until actual_status == wanted (None: until the instance is gone, in any of the forms
    vast.ai says it: `shown`)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = await shown(api, instance_id)
        if wanted is None and last is None:
            return None
        if last is not None and last["actual_status"] == wanted:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"instance {instance_id} never reached {wanted!r}; last: {last and last['actual_status']}")


async def destroy(api: httpx.AsyncClient, instance_id: int) -> None:
    """Destroy; a 404 is asked again for the seconds a new instance's writes lag its create (the local cloud's
    3 s), and then means gone."""
    deadline = time.monotonic() + 5.0
    while (r := await polite(api, "DELETE", f"/api/v0/instances/{instance_id}/")).status_code == 404:
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.25)
    assert r.status_code == 200, r.text


async def shown(api: httpx.AsyncClient, instance_id: int) -> dict[str, Any] | None:
    """Show one instance; None when vast.ai says it is not there: null, a 404, or (after a destroy) a row that
    says so, as it answers each."""
    r = await polite(api, "GET", f"/api/v0/instances/{instance_id}/")
    if r.status_code == 404:
        assert r.json()["error"] == "no_such_instance", r.text
        return None
    r.raise_for_status()
    row = r.json()["instances"]
    if row is not None and row.get("actual_status") == "destroyed":
        assert row["intended_status"] == "destroyed" and row["cur_state"] == "unloaded" and row["ports"] is None
        return None
    return row


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


def host_processes(state_dir: Path, instance_id: int | str, token: str) -> list[str]:
    """Every process of a local host still running, by its marker or naming its directory (sshd): each as
    its PID, state and command line, so that a failing test says what was left."""
    directory = Path(state_dir) / "hosts" / str(instance_id)
    pids = sorted(set(procs.pids_with_marker(token)) | set(processes_mentioning(Path(str(directory) + "/"))))
    return [d for d in map(_described, pids) if d is not None]


def _described(pid: int) -> str | None:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None  # it exited meanwhile
    return f"{pid} {state} {cmdline.strip()}"


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


def sag_soon(cloud: Any, instance_id: int, delay_s: float = 1.5, ramp_s: float = 2.0, share: float = 0.8) -> None:
    """Make a running host's decode sag (as a hot card) from `delay_s` from now, whatever its age."""
    row = cloud.state()["instances"][str(instance_id)]
    started = time.time() - row["running_at"] + delay_s
    machine = str(row["offer"]["machine_id"])
    cloud.set_faults({"decode_sag": {machine: {"start_after_s": started, "ramp_s": ramp_s, "max_stop_share": share}}})


async def sag_after_first_reply(cloud: Any, fleet: Any, host: Any, *, ramp_s: float = 0.5, share: float = 0.8) -> None:
    """Make a host's decode sag (as a hot card) once it has finished a reply after this call: a probe started
    beside this has its cold sample in, however slowly a busy machine took it. Run it as a task beside the
    probe and hand it to `sag_was_set` once the probe is done; it returns once the sag is set."""
    import re

    async with fleet.server(host).client(timeout=30) as client:

        async def predicted() -> float:
            # a busy host may keep /metrics waiting past a deadline: ask again, never give up silently
            while True:
                try:
                    text = (await client.get("/metrics")).raise_for_status().text
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
            found = re.search(r"^llamacpp:tokens_predicted_total (\S+)$", text, re.M)
            assert found, "llama-server's /metrics has no tokens_predicted_total"
            return float(found.group(1))

        before = await predicted()
        while await predicted() <= before:
            await asyncio.sleep(0.05)
    sag_soon(cloud, host.instance_id, delay_s=0.0, ramp_s=ramp_s, share=share)


def sag_was_set(task: asyncio.Task) -> None:
    """The task of `sag_after_first_reply`, once the probe beside it is done: the sag must have been set while
    the probe ran (a probe that never met the sag says nothing about one; in CI a task that died on a timeout
    once let a hot card's probe pass unseen)."""
    if not task.done():
        task.cancel()
        raise AssertionError("the probe ended before its host finished a reply: the sag was never set")
    task.result()  # its own error, if it failed
