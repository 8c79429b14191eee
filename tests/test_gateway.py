"""The gateway (issue 22) on real parts: HAProxy started by fleet in front of real llama-server hosts of the
local cloud, TLS at both ends, agents' keys, per-call affinity, admission with and without an overflow
provider (a second llama-server acting as the hosted API), failures before and during a stream, HAProxy
killed and brought back, and nothing left running."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet.app import Fleet
from fleet.control import gateway
from fleet.control.up import UpRequest
from fleet.core import config
from fleet.core.config import Serve
from fleet.core.models import HostState
from fleet.gateway import process
from fleet.gateway.files import files_for
from fleet.gateway.runtime import Runtime
from tests.fleetkit import fleet_for, settings_for, write_config

CHAT = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="module")
def _cloud_env(cloud) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEET_LOCALCLOUD_DIR", str(cloud.info.state_dir))
        cloud.set_faults({})
        yield
        cloud.set_faults({})


def gateway_settings(base: Path, name: str, **gateway_keys: Any) -> config.Settings:
    """The module's record (its two hosts), a tiny target in the EU, and a gateway of its own: folder, ports."""
    settings = settings_for(base)
    values = {"directory": str(base / name), "port": free_port(), "metrics_port": 0, **gateway_keys}
    return settings.model_copy(
        update={
            "serve": [Serve(model="tiny", region="eu")],
            "gateway": settings.gateway.model_copy(update=values),
        }
    )


@pytest.fixture(scope="module")
async def two_hosts(_cloud_env, module_dir: Path) -> AsyncIterator[list[str]]:
    """Two READY tiny hosts (one slot each: the target carries two concurrent streams)."""
    async with fleet_for(settings_for(module_dir)) as fleet:
        result = await fleet.up(UpRequest(model="tiny", region="eu", count=2))
        names = [h.name for h in result.ready]
        assert len(names) == 2, result
        try:
            yield names
        finally:
            await fleet.destroy(None)


@pytest.fixture
async def gw(two_hosts, module_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    """A gateway of this test's own (its folder, its port), stopped afterwards whatever happened."""
    settings = gateway_settings(module_dir, request.node.name[:40], **getattr(request, "param", {}))
    async with fleet_for(settings) as fleet:
        try:
            await gateway.start(fleet)
            yield fleet
        finally:
            await gateway.stop(fleet)
    assert process.running_pid(files_for(settings)) is None


def client(fleet: Fleet, key: str | None, timeout: float = 30) -> httpx.AsyncClient:
    port = fleet.settings.serve[0].port or fleet.settings.gateway.port
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(base_url=f"https://localhost:{port}", verify=fleet.tls, headers=headers, timeout=timeout)


def turn(content: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


async def served_by_host(fleet: Fleet) -> dict[str, int]:
    """Requests each host's server in the gateway has carried."""
    status = await gateway.status(fleet)
    return {h["host"]: h["served"] for h in status["targets"][0]["hosts"] if h["host"]}


async def wait_hosts_up(fleet: Fleet, count: int = 2) -> None:
    for _ in range(200):
        hosts = (await gateway.status(fleet))["targets"][0]["hosts"]
        if sum(1 for h in hosts if h["status"].startswith("UP")) >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the gateway's hosts did not come up: {hosts}")


async def test_one_url_streams_over_tls_with_an_agent_key_and_answers_models_itself(gw):
    key = await gateway.add_key(gw, "alice")
    assert key.startswith("fa-") and key not in json.dumps(gateway.list_keys(gw))
    await wait_hosts_up(gw)
    async with client(gw, key) as c:
        before = await served_by_host(gw)
        models = await c.get("/v1/models")
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["tiny"]
        assert await served_by_host(gw) == before  # answered by the gateway: no host saw it
        chunks = []
        async with c.stream("POST", CHAT, json=turn("hello", stream=True)) as reply:
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
        assert chunks[-1] == "[DONE]" and len(chunks) > 3
        assert sum((await served_by_host(gw)).values()) == sum(before.values()) + 1
    # the agent's key is not a host's key, and a host's key is not an agent's
    host = gw.record.hosts(states=(HostState.READY,))[0]
    async with client(gw, gw.api_key(host)) as c:
        assert (await c.post(CHAT, json=turn("hi"))).status_code == 401
    async with httpx.AsyncClient(verify=gw.tls, timeout=10) as direct:
        assert (
            await direct.post(f"{host.api_url}{CHAT}", json=turn("hi"), headers={"Authorization": f"Bearer {key}"})
        ).status_code == 401


async def test_each_call_stays_on_its_host_for_twenty_turns_and_its_turns_are_warm(gw):
    key = await gateway.add_key(gw, "bob")
    await wait_hosts_up(gw)
    before = await served_by_host(gw)
    cached: dict[str, list[int]] = {"call-a": [], "call-b": []}

    async def talk(call: str, how: dict[str, Any]) -> None:
        history: list[dict[str, str]] = []
        async with client(gw, key) as c:
            for i in range(20):
                history.append({"role": "user", "content": f"{call} turn {i}: tell me more"})
                reply = await c.post(
                    CHAT,
                    json={"messages": history, "max_tokens": 4, **how.get("body", {})},
                    headers=how.get("headers", {}),
                )
                assert reply.status_code == 200, reply.text
                body = reply.json()
                cached[call].append(body["timings"]["cache_n"])
                history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

    # one call named by its header, the other by the body's `user`, both at once
    await asyncio.gather(
        talk("call-a", {"headers": {"X-Session-Id": "call-a"}}), talk("call-b", {"body": {"user": "call-b"}})
    )
    table = await Runtime(files_for(gw.settings).socket).table("calls_t0")
    assert table["call-a"]["server_id"] != table["call-b"]["server_id"]  # one host each: the most free first
    after = await served_by_host(gw)
    assert sorted(after[h] - before.get(h, 0) for h in after) == [20, 20]  # every turn on its call's host
    for call, hits in cached.items():
        assert all(n > 0 for n in hits[1:]), f"{call}: a later turn found nothing cached: {hits}"


async def chunks(count: int) -> AsyncIterator[bytes]:
    for _ in range(count):
        yield b"x" * 65536


async def status_of(c: httpx.AsyncClient, path: str, body: dict[str, Any]) -> int:
    async with c:
        return (await c.post(path, json=body)).status_code


async def test_bad_requests_are_refused_without_touching_a_host(gw):
    key = await gateway.add_key(gw, "carol")
    await wait_hosts_up(gw)
    before = await served_by_host(gw)
    limit = gw.settings.gateway.max_body_kb * 1024
    async with client(gw, key) as c:
        cases = {
            "no key": await status_of(client(gw, None), CHAT, turn("hi")),
            "wrong key": await status_of(client(gw, "fa-not-a-key"), CHAT, turn("hi")),
            "not json": (
                await c.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
            ).status_code,
            "no messages": (await c.post(CHAT, json={"model": "tiny"})).status_code,
            "huge": (await c.post(CHAT, content=b"x" * (limit + 1))).status_code,
            "huge, chunked": (await c.post(CHAT, content=chunks(limit // 65536 + 2))).status_code,
            "other path": (await c.get("/slots")).status_code,
            "props": (await c.get("/props")).status_code,
            "models by POST": (await c.post("/v1/models", json={})).status_code,
        }
    assert cases == {
        "no key": 401, "wrong key": 401, "not json": 400, "no messages": 400, "huge": 413,
        "huge, chunked": 413, "other path": 404, "props": 404, "models by POST": 405,
    }  # fmt: skip
    assert await served_by_host(gw) == before


async def test_a_revoked_key_is_refused_at_once(gw, module_dir):
    key = await gateway.add_key(gw, "dave")
    await wait_hosts_up(gw)
    async with client(gw, key) as c:
        assert (await c.post(CHAT, json=turn("hi"))).status_code == 200
        env = cli_env(gw, module_dir)
        revoked = subprocess.run(
            [".venv/bin/fleet", "gateway", "key", "revoke", "dave", "--json"], env=env, capture_output=True, text=True
        )
        assert revoked.returncode == 0, revoked.stderr
        assert json.loads(revoked.stdout) == {"name": "dave", "revoked": 1}
        refused = await c.post(CHAT, json=turn("hi"))  # the next request, no wait
        assert refused.status_code == 401
        again = subprocess.run(
            [".venv/bin/fleet", "gateway", "key", "revoke", "dave", "--json"], env=env, capture_output=True, text=True
        )
        assert again.returncode == 2 and "no live key" in json.loads(again.stdout)["error"]


def cli_env(fleet: Fleet, module_dir: Path) -> dict[str, str]:
    """The environment a `fleet` command runs with against this test's record and gateway."""
    g = fleet.settings.gateway
    path = write_config(module_dir)
    text = path.read_text().replace("[gateway]\n", f'[gateway]\ndirectory = "{g.directory}"\n', 1)
    text = text.replace("\nport = 8443\n", f"\nport = {g.port}\n", 1).replace(
        "\nmetrics_port = 9465\n", "\nmetrics_port = 0\n", 1
    )
    assert g.directory in text and f"port = {g.port}" in text
    path = module_dir / f"fleet-{Path(g.directory).name}.toml"
    path.write_text(text)
    return {**os.environ, "FLEET_CONFIG": str(path)}
