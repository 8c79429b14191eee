"""Two gateway instances on one PostgreSQL record (issue 22, item 9): every call's host agrees, whichever
instance a turn reaches. The record gives each host the same slot in both; HAProxy's peers carry the stick
tables between the instances, over TLS with fleet's certificates."""

from __future__ import annotations

import asyncio

import httpx

from fleet.control import gateway
from fleet.control.up import UpRequest
from fleet.core.config import Serve
from fleet.gateway.files import files_for
from fleet.gateway.runtime import Runtime
from tests.fleetkit import fleet_for, settings_for
from tests.test_gateway import free_port, served_by_host, wait_hosts_up

CHAT = "/v1/chat/completions"


def instance(base, postgres_url: str, name: str, ports: dict[str, int], peer_ports: dict[str, int]):
    settings = settings_for(base)
    peers = [f"{n}=127.0.0.1:{p}" for n, p in sorted(peer_ports.items())]
    return settings.model_copy(
        update={
            "database": settings.database.model_copy(update={"url": postgres_url}),
            "serve": [Serve(model="tiny", region="eu")],
            "gateway": settings.gateway.model_copy(
                update={
                    "directory": str(base / f"gw-{name}"),
                    "port": ports[name],
                    "metrics_port": 0,
                    "peers": peers,
                    "peer_name": name,
                }
            ),
        }
    )


async def test_two_gateways_on_one_record_agree_on_every_calls_host(cloud, local_cloud_env, postgres_url, tmp_path):
    ports = {"a": free_port(), "b": free_port()}
    peer_ports = {"a": free_port(), "b": free_port()}
    settings_a = instance(tmp_path, postgres_url, "a", ports, peer_ports)
    settings_b = instance(tmp_path, postgres_url, "b", ports, peer_ports)
    async with fleet_for(settings_a) as a, fleet_for(settings_b) as b:
        try:
            assert len((await a.up(UpRequest(model="tiny", region="eu", count=2))).ready) == 2
            await gateway.start(a)
            await gateway.start(b)
            key = await gateway.add_key(a, "agent")
            await gateway.apply(b)  # what b's daemon does on its next beat
            await wait_hosts_up(a)
            await wait_hosts_up(b)
            table_a = Runtime(files_for(settings_a).socket)
            table_b = Runtime(files_for(settings_b).socket)
            calls = [f"call-{i}" for i in range(6)]
            keys = {c: f"agent/{c}" for c in calls}  # the stick table's key: the call is its agent's
            clients = {
                n: httpx.AsyncClient(
                    base_url=f"https://localhost:{ports[n]}", verify=a.tls, headers={"Authorization": f"Bearer {key}"}
                )
                for n in ("a", "b")
            }
            try:
                for call in calls:  # each call's first turn reaches a, three of them at once
                    reply = await clients["a"].post(CHAT, json=first_turn(call), headers={"X-Session-Id": call})
                    assert reply.status_code == 200
                placed = await table_a.table("calls_t0")
                assert {placed[keys[c]]["server_key"] for c in calls} == {"s0", "s1"}
                for _ in range(200):  # the peers carry a's table to b
                    seen = await table_b.table("calls_t0")
                    if all(keys[c] in seen for c in calls):
                        break
                    await asyncio.sleep(0.05)
                assert {c: seen[keys[c]]["server_key"] for c in calls} == {
                    c: placed[keys[c]]["server_key"] for c in calls
                }
                before = await served_by_host(b)
                for call in calls:  # every later turn reaches b: the same host
                    reply = await clients["b"].post(CHAT, json=first_turn(call), headers={"X-Session-Id": call})
                    assert reply.status_code == 200
                after_b = await table_b.table("calls_t0")
                assert {c: after_b[keys[c]]["server_key"] for c in calls} == {
                    c: placed[keys[c]]["server_key"] for c in calls
                }
                moved = await served_by_host(b)
                per_slot = {h["slot"]: h["served"] for h in (await gateway.status(b))["targets"][0]["hosts"]}
                expected = {
                    int(s[1:]): sum(1 for c in calls if placed[keys[c]]["server_key"] == s) for s in ("s0", "s1")
                }
                assert sum(moved.values()) - sum(before.values()) == len(calls)
                assert {slot: per_slot[slot] for slot in expected} == expected
            finally:
                for c in clients.values():
                    await c.aclose()
        finally:
            await gateway.stop(a)
            await gateway.stop(b)
            await a.destroy(None)


def first_turn(call: str) -> dict:
    return {"messages": [{"role": "user", "content": f"{call}: hello"}], "max_tokens": 4}
