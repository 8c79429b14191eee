"""The gateway (issue 22) on real parts: HAProxy started by fleet in front of real llama-server hosts of the
local cloud, TLS at both ends, agents' keys, per-call affinity, admission with and without an overflow
provider (a second llama-server acting as the hosted API), failures before and during a stream, HAProxy
killed and brought back, and nothing left running."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import hmac
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509

from fleet.app import Fleet
from fleet.context import tls_dir
from fleet.control import gateway, thermal
from fleet.control.daemon import gateway_metrics
from fleet.control.up import UpRequest
from fleet.core import config, tls
from fleet.core.apikeys import access_log_key
from fleet.core.config import Serve
from fleet.core.gatewayrecord import add_agent_key, revoke_agent_key
from fleet.core.models import BenchRun, HostState
from fleet.core.tls import ensure_ca, sign_server
from fleet.gateway import process
from fleet.gateway.files import endpoint_names, files_for
from fleet.gateway.runtime import Runtime, checked, parse_table
from fleet.host.endpoints import publish
from fleet.localcloud import procs
from tests.fleetkit import fleet_for, settings_for, write_config
from tests.helpers import kill_llama_server, processes_mentioning

CHAT = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def running(pid: int) -> bool:
    """The process lives (a zombie nobody reaped yet does not: it holds no port and runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway")


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
async def two_hosts(module_cloud_env, module_dir: Path) -> AsyncIterator[list[str]]:
    """Two READY tiny hosts (one slot each: the target carries two concurrent streams)."""
    async with fleet_for(settings_for(module_dir)) as fleet:
        result = await fleet.up(UpRequest(model="tiny", region="eu", count=2))
        names = [h.name for h in result.ready]
        assert len(names) == 2, result
        try:
            yield names
        finally:
            await fleet.destroy(None)


@asynccontextmanager
async def running_gateway(settings: config.Settings) -> AsyncIterator[Fleet]:
    """A fleet of these settings with its gateway started, stopped afterwards whatever happened."""
    async with fleet_for(settings) as fleet:
        try:
            await gateway.start(fleet)
            yield fleet
        finally:
            await gateway.stop(fleet)
    assert process.running_pid(files_for(settings)) is None


def gateway_of_test(module_dir: Path, request: pytest.FixtureRequest) -> AbstractAsyncContextManager[Fleet]:
    """The gateway of one test: its own folder and port, with the settings a parametrized test names."""
    return running_gateway(gateway_settings(module_dir, request.node.name[:40], **getattr(request, "param", {})))


@pytest.fixture
async def gw(two_hosts, module_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    """A gateway of this test's own (its folder, its port), stopped afterwards whatever happened."""
    async with gateway_of_test(module_dir, request) as fleet:
        yield fleet


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
    # the gateway timed the streamed answer's first content (not its role-only first delta): one answer, new
    felt = [h for h in (await gateway.status(gw))["targets"][0]["hosts"] if h["first_content"]]
    assert [(h["first_content"]["count"], h["warm_turns"]) for h in felt] == [(1, 0)]
    assert felt[0]["first_content_p50_ms"] > 0
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
    assert table["bob/call-a"]["server_id"] != table["bob/call-b"]["server_id"]  # one host each: the most free first
    after = await served_by_host(gw)
    assert sorted(after[h] - before.get(h, 0) for h in after) == [20, 20]  # every turn on its call's host
    # what a host took from its cache is fleet's to read, never the agent's (a slot may hold another call's
    # prompt): the agent sees 0, the gateway's own counts and its access log the host's numbers
    assert all(n == 0 for hits in cached.values() for n in hits), cached
    logged = [
        dict(f.split("=", 1) for f in line.split())
        for line in await logged_lines(files_for(gw.settings).access_log, 40, agent="bob")
    ]
    turns = [line for line in logged if line.get("agent") == "bob" and line.get("admit") == "turn"]
    assert len(turns) == 38 and all(int(line["cached_tokens"]) > 0 for line in turns), turns
    # what the agents felt, per host: 20 answers timed, 19 warm turns, each of them a cache hit, and the
    # daemon's metrics say the same
    # admission saw each call's first turn as new and the other 19 as turns of a call whose host lives
    assert (await gateway.status(gw))["targets"][0]["calls"] == {"new": 2, "turn": 38}
    hosts = [h for h in (await gateway.status(gw))["targets"][0]["hosts"] if h["host"]]
    assert sorted((h["first_content"]["count"], h["warm_turns"], h["warm_turns_cached"]) for h in hosts) == [
        (20, 19, 19),
        (20, 19, 19),
    ]
    assert all(0 < h["first_content_p50_ms"] <= h["first_content_p95_ms"] for h in hosts)
    assert all(h["cached_tokens"] > h["processed_tokens"] > 0 for h in hosts)
    families = {f.name: f for f in await asyncio.to_thread(lambda: list(gateway_metrics(gw.settings)))}
    counts = {
        s.labels["host"]: s.value
        for s in families["fleet_gateway_first_content_seconds"].samples
        if s.name.endswith("_count")
    }
    warm = families["fleet_gateway_warm_turns"].samples
    hits = {s.labels["host"]: s.value for s in warm if s.labels["cache"] == "hit"}
    assert sorted(counts.values()) == [20, 20] and sorted(hits.values()) == [19, 19]


async def chunks(count: int) -> AsyncIterator[bytes]:
    for _ in range(count):
        yield b"x" * 65536


async def refused_early(request: Any, status: int = 413) -> int:
    """A body refused while it is still being sent: the `status`, or (HAProxy answers and closes at once, and a
    busy client may still be writing) the connection closed under the upload; `status` either way."""
    try:
        return (await request).status_code
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
        return status


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
            "huge": await refused_early(c.post(CHAT, content=b"x" * (limit + 1))),
            "chunked": await refused_early(c.post(CHAT, content=chunks(1)), 411),
            "huge, chunked": await refused_early(c.post(CHAT, content=chunks(limit // 65536 + 2)), 411),
            "other path": (await c.get("/slots")).status_code,
            "props": (await c.get("/props")).status_code,
            "models by POST": (await c.post("/v1/models", json={})).status_code,
            # a call id past what the stick table keys (a 9,000-byte one reached the host, which said 400 with no
            # body), and headers past 16 KB: refused here, in OpenAI's shape
            "long call id": (await c.post(CHAT, json=turn("hi"), headers={"X-Session-Id": "c" * 9000})).status_code,
            "long user": (await c.post(CHAT, json=turn("hi", user="u" * 64))).status_code,
            "huge headers": (await c.post(CHAT, json=turn("hi"), headers={"X-Pad": "p" * 20_000})).status_code,
        }
        said = (await c.post(CHAT, json=turn("hi", pad="x" * limit))).json()["error"]
        assert f"over {gw.settings.gateway.max_body_kb} KB" in said["message"]  # a 413 says the limit
        long_id = (await c.post(CHAT, json=turn("hi"), headers={"X-Session-Id": "c" * 9000})).json()["error"]
        assert long_id["code"] == "invalid_call_id" and "63 bytes" in long_id["message"]
    assert cases == {
        "no key": 401, "wrong key": 401, "not json": 400, "no messages": 400, "huge": 413, "chunked": 411,
        "huge, chunked": 411, "other path": 404, "props": 404, "models by POST": 405, "long call id": 400,
        "long user": 400, "huge headers": 431,
    }  # fmt: skip
    # A chunked body behind 80 KB of headers, sent as a client streams it: HAProxy judged such a body by the part
    # its buffer held, which the headers kept under the limit, and 1 MiB went on to a host.
    said = await asyncio.to_thread(padded_chunked_upload, gw, key, 1 << 20)
    assert said in ("411", "431", "closed"), said
    assert await served_by_host(gw) == before


def padded_chunked_upload(fleet: Fleet, key: str, size: int) -> str:
    """A chat request of `size` bytes in 64 KiB chunks behind 80 KB of padding headers, over a raw TLS socket
    (headers first, then the chunks, as an uploading client sends them): the status the gateway answered, or
    "closed" when it closed the connection before its answer could be read."""
    port = fleet.settings.serve[0].port or fleet.settings.gateway.port
    head = b'{"messages":[{"role":"user","content":"hi"}],"pad":"'
    body = head + b"a" * (size - len(head) - 2) + b'"}'
    padding = "".join(f"x-pad-{i}: {'a' * 4000}\r\n" for i in range(20))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=30) as tcp,
        fleet.tls.wrap_socket(tcp, server_hostname="localhost") as tls,
    ):
        try:
            tls.sendall(
                f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n{padding}\r\n".encode()
            )
            for i in range(0, len(body), 65536):
                part = body[i : i + 65536]
                tls.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
            tls.sendall(b"0\r\n\r\n")
            answer = tls.recv(4096)
        except (OSError, ssl.SSLError):
            return "closed"
    return answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"


def handshake(fleet: Fleet, version: ssl.TLSVersion, ciphers: str | None = None) -> str | None:
    """The TLS version the agents' door agrees to with a client offering only `version` (and `ciphers`, for
    TLS 1.2), or None when it refuses."""
    port = fleet.settings.serve[0].port or fleet.settings.gateway.port
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(str(fleet.ca.certificate_path))
    context.minimum_version = context.maximum_version = version
    if ciphers:
        context.set_ciphers(f"{ciphers}:@SECLEVEL=0")
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as tcp,
            context.wrap_socket(tcp, server_hostname="localhost") as tls,
        ):
            return tls.version()
    except (ssl.SSLError, ConnectionError):
        return None


async def test_the_agents_door_speaks_modern_tls_alone_and_logs_each_request_without_its_content(gw):
    key = await gateway.add_key(gw, "logan")
    await wait_hosts_up(gw)
    agreed = {
        "TLS 1.3": handshake(gw, ssl.TLSVersion.TLSv1_3),
        "TLS 1.2, ECDHE and AES-GCM": handshake(gw, ssl.TLSVersion.TLSv1_2, "ECDHE-ECDSA-AES128-GCM-SHA256"),
        "TLS 1.2, CBC and SHA-1": handshake(gw, ssl.TLSVersion.TLSv1_2, "ECDHE-ECDSA-AES128-SHA"),
        "TLS 1.2, CBC and SHA-256": handshake(gw, ssl.TLSVersion.TLSv1_2, "ECDHE-ECDSA-AES128-SHA256"),
    }
    assert agreed == {
        "TLS 1.3": "TLSv1.3", "TLS 1.2, ECDHE and AES-GCM": "TLSv1.2", "TLS 1.2, CBC and SHA-1": None,
        "TLS 1.2, CBC and SHA-256": None,
    }  # fmt: skip
    # one line a request: the agent, the call's key hashed, the host by its name, the status and times; no
    # content, no key, not the call's own id
    async with client(gw, key) as c:
        reply = await c.post(CHAT, json=turn("the patient's date of birth"), headers={"X-Session-Id": "call-log-1"})
        assert reply.status_code == 200
    async with client(gw, "fa-not-a-key") as c:
        assert (await c.post(CHAT, json=turn("hi"))).status_code == 401
    log = files_for(gw.settings).access_log
    # the call's name keyed by the install's secret (security round four: an unkeyed SHA-256 of "agent/call id"
    # let anyone with the log try phone numbers and emails against it)
    call = hmac.new(access_log_key(gw.key_secret), b"logan/call-log-1", hashlib.sha256).digest()[:8].hex()
    unkeyed = hashlib.sha256(b"logan/call-log-1").digest()[:8].hex()
    for _ in range(200):  # HAProxy writes a request's line once its answer has gone
        lines = [dict(f.split("=", 1) for f in line.split()) for line in log.read_text().splitlines()]
        lines = [line for line in lines if line["status"] != "-"]  # the refused handshakes' lines
        if any(line["status"] == "401" for line in lines):
            break
        await asyncio.sleep(0.05)
    served = [line for line in lines if line["call"] == call]
    assert len(served) == 1, lines
    hosts = {tls.host_tls_name(h["host"]) for h in (await gateway.status(gw))["targets"][0]["hosts"] if h["host"]}
    assert served[0]["agent"] == "logan" and served[0]["status"] == "200" and served[0]["host"] in hosts
    assert served[0]["admit"] == "new" and int(served[0]["total_ms"]) >= 0 and int(served[0]["first_content_ms"]) >= 0
    assert [(line["agent"], line["host"]) for line in lines if line["status"] == "401"] == [("-", "-")]
    text = log.read_text()
    assert "date of birth" not in text and "call-log-1" not in text and key not in text and unkeyed not in text
    assert log.stat().st_mode & 0o777 == 0o600


async def logged_lines(log: Path, count: int, agent: str | None = None) -> list[str]:
    """The access log's lines (of `agent`'s requests, if named) once it holds `count` of them: HAProxy writes a
    request's line once its answer has gone, through a pipe."""
    for _ in range(200):
        lines = log.read_bytes().decode(errors="replace").splitlines()
        if agent is not None:
            lines = [line for line in lines if f" agent={agent} " in line]
        if len(lines) >= count:
            return lines
        await asyncio.sleep(0.05)
    raise AssertionError(f"the access log holds {len(lines)} lines, not {count}: {lines}")


async def test_the_access_log_appends_across_restarts_and_survives_a_copytruncate_rotation(gw):
    """Round two of the clients' review: HAProxy's descriptor lost O_APPEND, so a restart wrote from offset 0
    over the old lines and a copytruncate rotation left the file full of NULs."""
    key = await gateway.add_key(gw, "logrotate")
    await wait_hosts_up(gw)
    log = files_for(gw.settings).access_log

    async def one_turn(call: str) -> None:
        async with client(gw, key) as c:
            assert (await c.post(CHAT, json=turn("hi"), headers={"X-Session-Id": call})).status_code == 200

    await one_turn("before-restart")
    first = await logged_lines(log, 1)
    await gateway.stop(gw)
    await gateway.start(gw)
    await wait_hosts_up(gw)
    await one_turn("after-restart")
    lines = await logged_lines(log, len(first) + 1)
    assert lines[: len(first)] == first  # the lines before the restart are still there, in order
    # logrotate's copytruncate: the file is copied away and cut to nothing while HAProxy holds it open
    rotated = log.with_name("access.log.1")
    rotated.write_bytes(log.read_bytes())
    with log.open("r+b") as f:
        f.truncate(0)
    await one_turn("after-rotation")
    after = await logged_lines(log, 1)
    assert b"\0" not in log.read_bytes() and len(after) == 1 and "agent=logrotate" in after[0]
    # a kept connection's second request: its `at` is when the first ended, `idle_ms` how long it then waited
    async with client(gw, key) as c:
        for _ in range(2):
            assert (await c.post(CHAT, json=turn("hi"), headers={"X-Session-Id": "kept"})).status_code == 200
            await asyncio.sleep(0.5)
    kept = [dict(f.split("=", 1) for f in line.split()) for line in (await logged_lines(log, 3))[1:]]
    assert float(kept[1]["at"]) >= float(kept[0]["at"]) and int(kept[1]["idle_ms"]) >= 500 > int(kept[0]["idle_ms"])


async def test_the_status_prints_a_trust_check_that_passes_with_its_ca_and_names_the_error_without(gw, tmp_path):
    """pipecat says only "Connection error." when TLS fails: `fleet gateway status` prints the command that
    shows whether a client trusts the gateway, and why not."""
    shown = await gateway.status(gw)
    assert shown["signed_by"] == "fleet" and shown["ca_file"].endswith("ca.pem")
    check = shown["tls_check"]
    trusted = subprocess.run(["bash", "-c", check], capture_output=True, text=True, timeout=60)
    assert (trusted.returncode, trusted.stdout.strip()) == (0, "ok"), trusted.stderr
    other = tls.ensure_ca(tmp_path / "other", "another CA")
    untrusted = subprocess.run(
        ["bash", "-c", check.replace(shown["ca_file"], str(other.certificate_path))],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert untrusted.returncode != 0 and "certificate verify failed" in untrusted.stderr


async def test_the_endpoints_file_holds_no_host_key_while_the_gateway_serves_and_is_written_through_no_link(gw):
    path = gw.settings.rotation.endpoints_path
    hosts = {h.name: gw.api_key(h) for h in gw.record.hosts(states=(HostState.READY,))}
    served = json.loads(path.read_text())
    assert {e["name"] for e in served} == set(hosts) and all("api_key" not in e for e in served)
    assert not any(key in path.read_text() for key in hosts.values())
    assert {e["name"]: e["api_key"] for e in gw.endpoints()} == hosts  # fleet endpoints --show-keys still can
    # whoever can write the file's folder plants links where a writer might put its temporary file: the file
    # is replaced whole, and nothing a link names is touched
    victim = path.parent / "victim"
    victim.write_text("untouched")
    for pid in (os.getpid(), *range(os.getpid() - 5, os.getpid() + 50)):
        with contextlib.suppress(FileExistsError):
            (path.parent / f".{path.name}.{pid}.tmp").symlink_to(victim)
    try:
        await gateway.stop(gw)  # the agents go to the hosts again: their keys come back
        direct = json.loads(path.read_text())
        assert {e["name"]: e["api_key"] for e in direct} == hosts
        assert victim.read_text() == "untouched" and not path.is_symlink()
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        for link in path.parent.glob(f".{path.name}.*.tmp"):
            link.unlink()
        await gateway.start(gw)


def served_certificate(fleet: Fleet) -> x509.Certificate:
    port = fleet.settings.serve[0].port or fleet.settings.gateway.port
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as tcp,
        fleet.tls.wrap_socket(tcp, server_hostname="localhost") as tls,
    ):
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))


async def test_the_agents_certificate_is_renewed_in_place_before_it_ends_and_no_call_drops(gw):
    key = await gateway.add_key(gw, "mona")
    await wait_hosts_up(gw)
    files = files_for(gw.settings)
    pid = process.running_pid(files)
    # the certificate HAProxy serves, as it will be ten days before its end (80 days after it started)
    key_pem, certificate_pem = sign_server(gw.ca, endpoint_names(gw.settings), 10)
    files.pem.write_bytes(certificate_pem + key_pem)
    await Runtime(files.socket).replace_certificate(files.pem, files.pem.read_bytes())
    assert served_certificate(gw).not_valid_after_utc < dt.datetime.now(dt.UTC) + dt.timedelta(days=11)
    async with client(gw, key) as c:
        assert (await c.post(CHAT, json=turn("before"), headers={"X-Session-Id": "renewed"})).status_code == 200
        renewed = await gateway.renew(gw)  # the daemon's beat does this
        assert renewed == [str(files.pem)]
        fresh = served_certificate(gw)
        assert fresh.not_valid_after_utc > dt.datetime.now(dt.UTC) + dt.timedelta(days=80)
        # the same HAProxy, and the connection opened before goes on
        assert process.running_pid(files) == pid
        assert (await c.post(CHAT, json=turn("after"), headers={"X-Session-Id": "renewed"})).status_code == 200
    assert await gateway.renew(gw) == []  # nothing to do now


async def test_publishes_side_by_side_apply_each_change_once(gw):
    """Bring-ups and destroys side by side each publish (`fleet destroy` ends its hosts several at once): two
    gateway syncs interleaved used to read the same difference and each apply it, an agent's key added to
    HAProxy's map as many times as there were publishes."""
    files = files_for(gw.settings)
    add_agent_key(gw.record, "erin")  # in the record, not yet in the gateway
    try:
        await asyncio.gather(*(publish(gw) for _ in range(3)))
        (shown,) = await Runtime(files.socket).run(f"show map {files.agent_map}")
        assert [line.split()[-1] for line in shown.splitlines() if line.strip()].count("erin") == 1, shown
    finally:
        revoke_agent_key(gw.record, "erin")
        await publish(gw)


async def test_a_revoked_key_is_refused_at_once(cloud, gw, module_dir):
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
    # a stream already running when its key is revoked ends then, not when its reply is done; the hosts slowed,
    # so that the reply outlasts the revoke however fast the tiny model decodes (it once ran whole before it)
    key = await gateway.add_key(gw, "dave-2")
    try:
        slow_down(cloud, gw, share=0.8)
        async with client(gw, key) as c:
            events: list[str] = []
            ended = "done"
            long_reply = turn("tell me a long story", max_tokens=4000, stream=True, ignore_eos=True)
            try:
                async with c.stream("POST", CHAT, json=long_reply) as reply:
                    assert reply.status_code == 200
                    async for line in reply.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 5:
                                await gateway.revoke_key(gw, "dave-2")
            except (httpx.RemoteProtocolError, httpx.ReadError):
                ended = "cut"
            assert (ended == "cut" or events[-1] != "[DONE]") and 5 <= len(events) < 4000 // 2, (ended, len(events))
            again = subprocess.run(
                [".venv/bin/fleet", "gateway", "key", "revoke", "dave", "--json"],
                env=env,
                capture_output=True,
                text=True,
            )
            assert again.returncode == 2 and "no live key" in json.loads(again.stdout)["error"]
    finally:
        cloud.set_faults({})


def cli_env(fleet: Fleet, module_dir: Path) -> dict[str, str]:
    return cli_env_for(fleet.settings, module_dir)


def cli_env_for(settings: config.Settings, module_dir: Path) -> dict[str, str]:
    """The environment a `fleet` command runs with against this test's record and gateway."""
    g = settings.gateway
    gateway = {"directory": g.directory, "port": g.port, "metrics_port": 0}
    path = write_config(module_dir, file=f"fleet-{Path(g.directory).name}.toml", gateway=gateway)
    return {**os.environ, "FLEET_CONFIG": str(path)}


def slow_down(cloud, fleet: Fleet, share: float = 0.95) -> None:
    """Every host of the record decodes slowly from now (stopped `share` of each 100 ms): a stream lasts.
    Returns once each host's llama-server (where one runs: a test may have stopped it) has been seen stopped:
    a stream begun after it is slow from its first token, not run whole at the tiny model's pace before the
    sag took hold."""
    rows = cloud.state()["instances"]
    sag, tokens = {}, []
    for host in fleet.record.hosts(states=(HostState.READY,)):
        row = rows[str(host.instance_id)]
        started = time.time() - row["running_at"]
        sag[str(row["offer"]["machine_id"])] = {"start_after_s": started, "ramp_s": 0.01, "max_stop_share": share}
        tokens.append(row["token"])
    cloud.set_faults({"decode_sag": sag})
    for token in tokens:
        servers = _llama_servers(token)
        assert not servers or _seen_stopped(servers), f"the decode sag never stopped host {token[:8]}'s llama-server"


def _llama_servers(token: str) -> list[int]:
    found = []
    for pid in procs.pids_with_marker(token):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == "llama-server":
                found.append(pid)
    return found


def _seen_stopped(pids: list[int], samples: int = 2000) -> bool:
    """Whether one of these processes is seen stopped (SIGSTOP: state T) within `samples` looks."""
    for _ in range(samples):
        for pid in pids:
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                    return True
        time.sleep(0.005)
    return False


class Stream:
    """A streamed call held open: its first content in, the rest read in the background."""

    def __init__(self, c: httpx.AsyncClient, call: str, max_tokens: int = 1200) -> None:
        self.c, self.call, self.max_tokens = c, call, max_tokens
        self.first = asyncio.Event()
        self.done = False
        self.finished_with_done = False
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        body = turn(f"{self.call}: a long answer please", self.max_tokens, stream=True)
        try:
            async with self.c.stream("POST", CHAT, json=body, headers={"X-Session-Id": self.call}) as reply:
                assert reply.status_code == 200, await reply.aread()
                async for line in reply.aiter_lines():
                    if line.startswith("data: "):
                        self.first.set()
                        self.finished_with_done = line == "data: [DONE]"
        finally:
            self.done = True
            self.first.set()


@pytest.fixture
def overflow_server(cloud, module_dir: Path, llama_server: Path, two_hosts) -> Iterator[tuple[str, str]]:
    """A second llama-server, alone, standing for the hosted API a full target overflows to: HTTPS with a
    certificate fleet's CA signed for localhost, its own key. (URL, key); ended by its PID."""
    # the module's fleet made its CA already (the name is not used then): the gateway checks the overflow with it
    ca = ensure_ca(tls_dir(settings_for(module_dir)), "fleet CA")
    key_pem, cert_pem = sign_server(ca, ["localhost"], 1)
    folder = module_dir / "overflow"
    folder.mkdir(exist_ok=True)
    (folder / "key.pem").write_bytes(key_pem)
    (folder / "cert.pem").write_bytes(cert_pem)
    (folder / "keys").write_text("overflow-secret-key\n")
    model = next(Path(cloud.info.state_dir).rglob("tiny-llama-bytes.gguf"))
    port = free_port()
    proc = subprocess.Popen(
        [str(llama_server), "-m", str(model), "-c", "4096", "-np", "4", "-t", "1", "--host", "127.0.0.1",
         "--port", str(port), "--api-key-file", str(folder / "keys"),
         "--ssl-key-file", str(folder / "key.pem"), "--ssl-cert-file", str(folder / "cert.pem")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not port_open(port):
            assert proc.poll() is None and time.monotonic() < deadline, "the overflow llama-server did not start"
            time.sleep(0.1)
        yield f"https://localhost:{port}/v1", "overflow-secret-key"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def test_a_full_target_overflows_new_calls_and_refuses_them_at_once_without_overflow(
    cloud, two_hosts, module_dir, overflow_server, monkeypatch
):
    url, overflow_key = overflow_server
    monkeypatch.setenv("FLEET_TEST_OVERFLOW_KEY", overflow_key)
    base = gateway_settings(module_dir, "admission")
    ca = tls_dir(base) / "ca.pem"
    with_overflow = base.model_copy(
        update={
            "gateway": base.gateway.model_copy(
                update={
                    "queue_timeout_s": 60,
                    "overflow": base.gateway.overflow.model_copy(
                        update={"url": url, "key_env": "FLEET_TEST_OVERFLOW_KEY", "ca_file": str(ca)}
                    ),
                }
            )
        }
    )
    async with full_target(cloud, with_overflow, "erin") as (fleet, c, held):
        # two one-slot hosts, each streaming a call: a third call is new and the target is full
        third = await c.post(CHAT, json=turn("a new call", 4), headers={"X-Session-Id": "third"})
        assert third.status_code == 200, third.text
        # ... and it went to the overflow, not to a host: the host's calls are still streaming
        assert not any(s.done for s in held)
        # the overflow's cache serves every agent of the account alike: what it took from it, and the prompt
        # tokens it processed besides, are not the agent's to read
        again = await c.post(CHAT, json=turn("a new call", 4), headers={"X-Session-Id": "third-again"})
        assert again.status_code == 200, again.text
        assert again.json()["timings"]["cache_n"] == 0 and again.json()["timings"]["prompt_n"] == 0, again.text
        assert not any(s.done for s in held)  # the hosts were busy: the overflow answered it
        trust = ssl.create_default_context(cafile=str(ca))
        async with httpx.AsyncClient(verify=trust, headers={"Authorization": f"Bearer {overflow_key}"}) as direct:
            seen = (await direct.post(f"{url}/chat/completions", json=turn("a new call", 4), timeout=60)).json()
        assert seen["timings"]["cache_n"] > 0, seen  # the overflow had cached it: there was something to hide
        status = await gateway.status(fleet)
        assert status["targets"][0]["calls"].get("overflowed") == 2
        assert status["targets"][0]["calls"].get("full") == 2
        # a turn of a call in progress is never refused: it waits for its own host
        turn_two = await c.post(CHAT, json=turn("held-1 again", 4), headers={"X-Session-Id": "held-1"})
        assert turn_two.status_code == 200
        assert (await gateway.status(fleet))["targets"][0]["calls"].get("overflowed") == 2

    # the same target with no overflow: a new call on a full target gets 503 and Retry-After, not a queue
    async with full_target(cloud, base, "frank") as (fleet, c, held):
        refused = await c.post(CHAT, json=turn("a new call", 4), headers={"X-Session-Id": "fourth"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "overloaded"
        assert not any(s.done for s in held)  # answered while the hosts were still busy: no queue
    assert all(s.finished_with_done for s in held)


@asynccontextmanager
async def full_target(cloud, settings: config.Settings, agent: str) -> AsyncIterator[tuple]:
    """A gateway of these settings whose two one-slot hosts each stream a long call (held-1, held-2): the
    target is full. Yields (fleet, client, held streams); the streams run to their end afterwards."""
    async with fleet_for(settings) as fleet:
        try:
            await gateway.start(fleet)
            key = await gateway.add_key(fleet, agent)
            await wait_hosts_up(fleet)
            slow_down(cloud, fleet)
            async with client(fleet, key, timeout=120) as c:
                held = [Stream(c, "held-1"), Stream(c, "held-2")]
                await asyncio.gather(*(s.first.wait() for s in held))
                assert not any(s.done for s in held)
                yield fleet, c, held
                cloud.set_faults({})
                await asyncio.gather(*(s.task for s in held))
        finally:
            cloud.set_faults({})
            await gateway.stop(fleet)


async def test_haproxy_killed_is_started_again_by_fleet_with_its_keys_and_hosts(gw):
    key = await gateway.add_key(gw, "grace")
    await wait_hosts_up(gw)
    files = files_for(gw.settings)
    first = process.running_pid(files)
    assert first is not None
    os.kill(first, signal.SIGKILL)
    for _ in range(100):
        if process.running_pid(files) is None:
            break
        await asyncio.sleep(0.05)
    assert process.running_pid(files) is None
    async with client(gw, key) as c:
        with pytest.raises(httpx.ConnectError):
            await c.post(CHAT, json=turn("hi"))
    report = await gateway.keep(gw)  # what fleet daemon does on its beat
    second = process.running_pid(files)
    assert second is not None and second != first and report is not None and len(report.added) == 2
    await wait_hosts_up(gw)
    async with client(gw, key) as c:  # the same key, from the record: nothing was lost
        assert (await c.post(CHAT, json=turn("hi again"))).status_code == 200


async def busy_requests(fleet: Fleet) -> dict[str, float]:
    """Each READY host's requests in progress, by its llama-server's /metrics."""
    found = {}
    for host in fleet.record.hosts(states=(HostState.READY,)):
        async with fleet.server(host).client(timeout=30) as c:
            text = (await c.get("/metrics")).raise_for_status().text
        line = next(x for x in text.splitlines() if x.startswith("llamacpp:requests_processing "))
        found[host.name] = float(line.split()[1])
    return found


async def test_haproxy_killed_mid_reply_ends_the_stream_with_an_error_frees_the_slot_and_the_next_turn_is_served(
    cloud, gw
):
    """issue 38: HAProxy killed with SIGKILL while a reply streams. The agent's stream ends with an error, never
    as a whole reply; the host's server drops the orphaned reply (its slot decodes nothing more); fleet starts
    HAProxy again, and the call's next turn is answered on its first try."""
    key = await gateway.add_key(gw, "kate")
    await wait_hosts_up(gw)
    files = files_for(gw.settings)
    slow_down(cloud, gw)
    try:
        async with client(gw, key, timeout=60) as c:
            stream = Stream(c, "cut")
            await stream.first.wait()
            assert not stream.done and sum((await busy_requests(gw)).values()) == 1
            os.kill(process.running_pid(files), signal.SIGKILL)
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                await stream.task
            assert not stream.finished_with_done
    finally:
        cloud.set_faults({})
    for _ in range(600):  # the server sees its client gone at its next token and ends the reply
        if sum((await busy_requests(gw)).values()) == 0:
            break
        await asyncio.sleep(0.05)
    assert sum((await busy_requests(gw)).values()) == 0
    assert (await gateway.keep(gw)) is not None and process.running_pid(files) is not None
    await wait_hosts_up(gw)
    async with client(gw, key) as c:
        reply = await c.post(CHAT, json=turn("are you there?"), headers={"X-Session-Id": "cut"})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None


async def test_a_call_is_its_agents_another_agent_naming_its_id_makes_a_new_call(gw):
    """Agent B naming A's call (header, body's user or prompt_cache_key) is never taken for a turn of A's call:
    it is a new call of B's, admitted as one, pinned apart, and A's call goes on where it was."""
    keys = {name: await gateway.add_key(gw, name) for name in ("olga", "trudy")}
    await wait_hosts_up(gw)
    runtime = Runtime(files_for(gw.settings).socket)
    async with client(gw, keys["olga"]) as olga, client(gw, keys["trudy"]) as trudy:
        assert (await olga.post(CHAT, json=turn("hello"), headers={"X-Session-Id": "olgas-call"})).status_code == 200
        for how in ({"headers": {"X-Session-Id": "olgas-call"}}, {"body": {"user": "olgas-call"}}):
            body = {**turn("hello"), **how.get("body", {})}
            assert (await trudy.post(CHAT, json=body, headers=how.get("headers", {}))).status_code == 200
        assert (await olga.post(CHAT, json=turn("again"), headers={"X-Session-Id": "olgas-call"})).status_code == 200
    assert (await gateway.status(gw))["targets"][0]["calls"] == {"new": 2, "turn": 2}
    table = await runtime.table("calls_t0")
    assert {"olga/olgas-call", "trudy/olgas-call"} <= set(table)
    assert "olgas-call" not in table


async def test_a_draining_host_keeps_its_calls_and_takes_no_new_one(gw):
    key = await gateway.add_key(gw, "judy")
    await wait_hosts_up(gw)
    runtime = Runtime(files_for(gw.settings).socket)
    async with client(gw, key) as c:
        for call in ("stays-a", "stays-b"):
            assert (await c.post(CHAT, json=turn("hello"), headers={"X-Session-Id": call})).status_code == 200
        table = await runtime.table("calls_t0")
        assert table["judy/stays-a"]["server_key"] != table["judy/stays-b"]["server_key"]
        slot = int(table["judy/stays-a"]["server_key"][1:])
        draining = next(h for h in gw.record.hosts(states=(HostState.READY,)) if h.gateway_slot == slot)
        assert gw.record.transition(draining, HostState.DRAINING)
        try:
            await gateway.apply(gw)  # what publish does after the transition
            assert await gateway.calls_on(gw, draining) == 1  # stays-a, with a recent turn
            for i in range(6):
                reply = await c.post(CHAT, json=turn("new"), headers={"X-Session-Id": f"while-draining-{i}"})
                assert reply.status_code == 200
                again = await c.post(CHAT, json=turn("still here"), headers={"X-Session-Id": "stays-a"})
                assert again.status_code == 200
            table = await runtime.table("calls_t0")
            assert table["judy/stays-a"]["server_key"] == f"s{slot}"  # its own calls go on on the draining host
            assert all(table[f"judy/while-draining-{i}"]["server_key"] != f"s{slot}" for i in range(6))
            status = {h["slot"]: h["status"] for h in (await gateway.status(gw))["targets"][0]["hosts"]}
            assert status[slot].startswith("DRAIN")
        finally:
            gw.record.update(draining, state=HostState.READY)  # the next tests use both hosts again
            await gateway.apply(gw)


async def test_a_host_whose_certificate_names_another_host_is_refused(gw):
    """Each host's certificate is checked against fleet's CA and the name fleet signed it for: a host that
    answers at another host's address (its certificate valid, for another name) carries no call."""
    key = await gateway.add_key(gw, "kim")
    await wait_hosts_up(gw)
    files = files_for(gw.settings)
    runtime = Runtime(files.socket)
    names = await runtime.map_entries(files.name_map)
    assert len(names) == 2
    (a, name_a), (b, name_b) = sorted(names.items())
    await runtime.must(checked("set", "map", str(files.name_map), a, name_b))  # the addresses swapped
    await runtime.must(checked("set", "map", str(files.name_map), b, name_a))
    async with client(gw, key) as c:
        refused = await c.post(CHAT, json=turn("hello"), headers={"X-Session-Id": "swapped"})
        assert refused.status_code == 503
        await gateway.apply(gw)  # the record's names again
        assert (await c.post(CHAT, json=turn("hello"), headers={"X-Session-Id": "named"})).status_code == 200


def unix_listeners(pid: int) -> list[str]:
    """The Unix sockets the process listens on, as /proc/net/unix names them ('@name' for an abstract one)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if (link := os.readlink(fd)).startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        # Flags 00010000: accepting connections; the path is the 8th field when the socket has one
        if len(fields) >= 8 and fields[6] in inodes and int(fields[3], 16) & 0x10000:
            found.append(fields[7])
    return found


REACH_AS_ANOTHER_USER = """
import json, socket, sys
reached = {}
for name in sys.argv[1:]:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            # /proc/net/unix writes an abstract name's NUL bytes (its first, and any padding) as '@'
            s.connect(name.replace("@", "\\0") if name.startswith("@") else name)
            reached[name] = True
        except OSError:
            reached[name] = False
print(json.dumps(reached))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's attempt needs root to become that user")
async def test_a_second_install_on_the_same_port_fails_to_start_and_takes_no_call_of_the_first(gw, module_dir):
    """Two installs on one machine, both on the gateway's port (issue 37): Linux let the second HAProxy bind it
    beside the first (SO_REUSEPORT) and share out the first's connections. The second now fails in one line
    naming the address, leaves nothing running, and every call still reaches the first."""
    key = await gateway.add_key(gw, "uma")
    await wait_hosts_up(gw)
    second = gateway_settings(module_dir, "second-install", port=gw.settings.gateway.port)
    async with fleet_for(second) as other:
        with pytest.raises(process.GatewayError, match=r"^the gateway's address \S+:\d+ is taken by another process"):
            await gateway.start(other)
        assert process.running_pid(files_for(second)) is None
    async with client(gw, key) as c:
        for i in range(12):  # each a new connection: none lands on a second listener
            c.headers["Connection"] = "close"
            assert (await c.post(CHAT, json=turn(f"still mine {i}"))).status_code == 200


async def test_no_other_user_reaches_the_gateways_internal_doors(two_hosts, module_dir):
    """Every Unix socket HAProxy listens on (the admin socket, each slot's door to its host) refuses another
    uid, with every folder above the gateway's open to it: a door it reached would carry its requests to a
    host with the host's key, past the agent key check, the body limit and admission."""
    open_dir = Path(tempfile.mkdtemp(prefix="fleet-gw-"))
    try:
        open_dir.chmod(0o755)
        control = socket.socket(socket.AF_UNIX)
        control.bind(str(open_dir / "control.sock"))
        control.listen()
        (open_dir / "control.sock").chmod(0o777)
        settings = gateway_settings(module_dir, "doors", directory=str(open_dir / "gateway"))
        async with fleet_for(settings) as fleet:
            try:
                await gateway.start(fleet)
                await wait_hosts_up(fleet)
                pid = process.running_pid(files_for(settings))
                assert pid is not None
                doors = unix_listeners(pid)
                assert len(doors) == 1 + settings.gateway.slots  # the admin socket and a door per slot
                argv = ["/usr/bin/python3", "-c", REACH_AS_ANOTHER_USER, str(open_dir / "control.sock"), *doors]
                found = subprocess.run(argv, user="nobody", cwd="/", capture_output=True, text=True, timeout=30)
                reached = json.loads(found.stdout)
                assert reached.pop(str(open_dir / "control.sock")) is True  # that user reaches an open socket
                assert reached == dict.fromkeys(doors, False)
            finally:
                await gateway.stop(fleet)
        control.close()
    finally:
        shutil.rmtree(open_dir, ignore_errors=True)


async def test_a_capacity_measured_sets_the_hosts_limit_and_the_daemon_exports_it(gw):
    key = await gateway.add_key(gw, "lee")
    await wait_hosts_up(gw)
    host = gw.record.hosts(states=(HostState.READY,))[0]

    def measured(capacity: int) -> BenchRun:
        return BenchRun(
            host_id=host.id, first_content_p95_ms_target=500, decode_tok_s_target=20, capacity=capacity,
            capacity_at_least=False, usd_per_voice_minute=None, levels="[]",
        )  # fmt: skip

    gw.record.add(measured(0))  # a bench that found it holds no call at the voice target
    await publish(gw)  # what `fleet bench` does once it recorded the run
    doors = {h["host"]: h for h in (await gateway.status(gw))["targets"][0]["hosts"]}
    assert doors[host.name]["status"].startswith("DRAIN")  # it takes no new call
    gw.record.add(measured(1))
    await publish(gw)
    doors = {h["host"]: h for h in (await gateway.status(gw))["targets"][0]["hosts"]}
    assert doors[host.name]["status"].startswith("UP") and doors[host.name]["limit"] == 1
    async with client(gw, key) as c:
        for i in range(3):
            assert (await c.post(CHAT, json=turn("hi"), headers={"X-Session-Id": f"metered-{i}"})).status_code == 200
    families = {f.name: f for f in await asyncio.to_thread(lambda: list(gateway_metrics(gw.settings)))}
    new_calls = [s.value for s in families["fleet_gateway_requests"].samples if s.labels["kind"] == "new"]
    assert new_calls and new_calls[0] >= 3
    limits = {s.labels["host"]: s.value for s in families["fleet_gateway_limit"].samples}
    assert limits[host.name] == 1


async def test_a_host_benched_for_calls_takes_new_calls_while_its_pinned_calls_stay_under_its_capacity(gw):
    key = await gateway.add_key(gw, "mallory")
    await wait_hosts_up(gw)
    hosts = gw.record.hosts(states=(HostState.READY,))
    runtime, files = Runtime(files_for(gw.settings).socket), files_for(gw.settings)

    def benched(host, calls: int | None) -> BenchRun:
        return BenchRun(
            host_id=host.id, first_content_p95_ms_target=500, decode_tok_s_target=20, capacity=1,
            capacity_at_least=False, usd_per_voice_minute=None, levels="[]", calls_capacity=calls,
        )  # fmt: skip

    try:
        for host in hosts:  # each holds one call in conversation: its one slot keeps that call's cache
            gw.record.add(benched(host, 1))
        await publish(gw)
        assert set((await runtime.map_entries(files.calls_map)).values()) == {"1"}
        async with client(gw, key) as c:
            for call in ("talking-a", "talking-b"):
                assert (await c.post(CHAT, json=turn("hello"), headers={"X-Session-Id": call})).status_code == 200
            # no stream is in flight, but each host holds a call that spoke within the call idle time: full
            refused = await c.post(CHAT, json=turn("a new call"), headers={"X-Session-Id": "third"})
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "overloaded"
            # a turn of a call in conversation goes on
            again = await c.post(CHAT, json=turn("next turn"), headers={"X-Session-Id": "talking-a"})
            assert again.status_code == 200
            # benched for speakers alone: a free stream takes a new call again
            for host in hosts:
                gw.record.add(benched(host, None))
            await publish(gw)
            assert await runtime.map_entries(files.calls_map) == {}
            taken = await c.post(CHAT, json=turn("a new call"), headers={"X-Session-Id": "fourth"})
            assert taken.status_code == 200
    finally:
        for host in hosts:  # the next tests take new calls by free streams
            gw.record.add(benched(host, None))
        await publish(gw)


def fill_table(socket_path: Path, table: str, count: int) -> None:
    """`count` entries put in a stick table over HAProxy's admin socket, a thousand commands a connection."""
    for start in range(0, count, 1000):
        line = "; ".join(f"set table {table} key stale/call-{i}" for i in range(start, min(start + 1000, count)))
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(socket_path))
            s.sendall(line.encode() + b"\n")
            while s.recv(1 << 16):
                pass


async def test_admission_and_a_drain_count_a_hosts_calls_the_same_beside_150000_others(gw):
    """Security round four: admission dumped the whole call table on HAProxy's one thread for every new call
    (300 ms at 150,000 entries), and past 4 MiB of it the drain's count raised, so a retiring host stayed
    DRAINING. Each slot's door now counts its calls in a table whose size alone is read."""
    key = await gateway.add_key(gw, "crowd")
    await wait_hosts_up(gw)
    files = files_for(gw.settings)
    runtime = Runtime(files.socket)
    await asyncio.to_thread(fill_table, files.socket, "calls_t0", 150_000)  # others' calls, every one stale
    assert (await runtime.tables_used())["calls_t0"] >= 150_000
    async with client(gw, key) as c:
        for call in ("crowd-a", "crowd-b", "crowd-c"):
            assert (await c.post(CHAT, json=turn("hello"), headers={"X-Session-Id": call})).status_code == 200
    counts = {h.name: await gateway.calls_on(gw, h) for h in gw.record.hosts(states=(HostState.READY,))}
    pinned: Counter[str] = Counter()
    for c in "abc":  # the calls' own entries, read by key (the whole table is past what fleet reads at once)
        (text,) = await runtime.run(checked("show", "table", "calls_t0", "key", f"crowd/crowd-{c}"))
        pinned[parse_table(text)[f"crowd/crowd-{c}"]["server_key"]] += 1
    assert sorted(counts.values()) == sorted(pinned.values()) and sum(counts.values()) == 3, (counts, pinned)


async def test_a_thermal_sweep_never_runs_its_load_beside_a_live_call(gw):
    """A call talks without pause on one host while the daemon's thermal re-probe sweeps: the idle host is probed;
    the call's host is held from new calls (its door drains), and since its call goes on past the drain timeout it
    is left for a later sweep, never probed under the call, and let go (issue 38: live turns' first content rose
    from 23 ms to 244-398 ms under a re-probe)."""
    # The verdict is not what this test is about: at a share of 0.05 a busy CPU does not fail (and replace) the
    # idle host, as the suite's other workers made it do once in CI.
    gw.settings = gw.settings.model_copy(
        update={
            "rotation": gw.settings.rotation.model_copy(update={"drain_timeout_s": 3.0}),
            "probes": gw.settings.probes.model_copy(update={"thermal_min_share": 0.05}),
        }
    )
    key = await gateway.add_key(gw, "live-agent")
    await wait_hosts_up(gw)
    stop = asyncio.Event()
    turns: list[int] = []

    async def talk() -> None:
        async with client(gw, key) as c:
            while not stop.is_set():
                reply = await c.post(CHAT, json=turn("keep talking", max_tokens=4), headers={"X-Session-Id": "live"})
                turns.append(reply.status_code)

    talking = asyncio.create_task(talk())
    try:
        runtime = Runtime(files_for(gw.settings).socket)
        for _ in range(200):
            entry = (await runtime.table("calls_t0")).get("live-agent/live")
            if entry and turns:
                break
            await asyncio.sleep(0.05)
        slot = int(entry["server_key"][1:])
        live = next(h for h in gw.record.hosts(states=(HostState.READY,)) if h.gateway_slot == slot)
        idle = next(h for h in gw.record.hosts(states=(HostState.READY,)) if h.name != live.name)
        reports = {r.name: r for r in await thermal.thermal_sweep(gw)}
    finally:
        stop.set()
        await talking
    assert reports[live.name].reason.startswith(thermal.LEFT), reports[live.name]
    assert [r.name for r in gw.record.probe_runs(live.id) if r.name == "thermal"] == []  # never under the call
    assert [r.name for r in gw.record.probe_runs(idle.id) if r.name == "thermal"] == ["thermal"], reports[idle.name]
    assert reports[idle.name].healthy, reports[idle.name]
    assert all(h.held_until is None for h in gw.record.hosts(states=(HostState.READY,)))  # let go
    assert turns and set(turns) == {200}


async def test_a_host_that_fails_before_the_first_byte_is_retried_on_the_other_and_the_call_re_pinned(gw, module_dir):
    key = await gateway.add_key(gw, "heidi")
    await wait_hosts_up(gw)
    runtime = Runtime(files_for(gw.settings).socket)
    async with client(gw, key) as c:
        assert (await c.post(CHAT, json=turn("first turn"), headers={"X-Session-Id": "pinned"})).status_code == 200
        pinned = (await runtime.table("calls_t0"))["heidi/pinned"]["server_key"]
        slot = int(pinned[1:])
        host = next(h for h in gw.record.hosts(states=(HostState.READY,)) if h.gateway_slot == slot)
        await kill_llama_server(host.ssh_host, host.ssh_port, module_dir / "ssh" / "id_ed25519")
        # at once, before any health check could see it: the turn is retried on the other host
        second = await c.post(CHAT, json=turn("second turn"), headers={"X-Session-Id": "pinned"})
        assert second.status_code == 200, second.text
        assert (await runtime.table("calls_t0"))["heidi/pinned"]["server_key"] != pinned
        # and a new call is never placed on the dead host
        for i in range(5):
            assert (await c.post(CHAT, json=turn("new"), headers={"X-Session-Id": f"after-{i}"})).status_code == 200
        table = await runtime.table("calls_t0")
        assert all(table[f"heidi/after-{i}"]["server_key"] != pinned for i in range(5))


async def test_a_host_that_dies_mid_stream_ends_the_stream_with_an_error_the_client_sees(cloud, gw, module_dir):
    key = await gateway.add_key(gw, "ivan")
    live = [h for h in gw.record.hosts(states=(HostState.READY,))]
    await wait_hosts_up(gw, count=1)
    slow_down(cloud, gw)
    try:
        async with client(gw, key, timeout=60) as c:
            stream = Stream(c, "dying")
            await stream.first.wait()
            slot = int((await Runtime(files_for(gw.settings).socket).table("calls_t0"))["ivan/dying"]["server_key"][1:])
            host = next(h for h in live if h.gateway_slot == slot)
            await kill_llama_server(host.ssh_host, host.ssh_port, module_dir / "ssh" / "id_ed25519")
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                await stream.task
            assert not stream.finished_with_done  # ended with an error, never replayed as if whole
    finally:
        cloud.set_faults({})


def test_destroy_all_and_gateway_stop_leave_no_haproxy_and_no_open_port(cloud, two_hosts, module_dir):
    settings = gateway_settings(module_dir, "last")
    env = {**cli_env_for(settings, module_dir), "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir)}
    fleet_cli = [".venv/bin/fleet"]
    started = subprocess.run([*fleet_cli, "gateway", "start", "--json"], env=env, capture_output=True, text=True)
    assert started.returncode == 0, started.stdout
    pid = json.loads(started.stdout)["pid"]
    port = settings.gateway.port
    assert port_open(port)
    stopped = subprocess.run([*fleet_cli, "gateway", "stop", "--json"], env=env, capture_output=True, text=True)
    assert json.loads(stopped.stdout) == {"stopped": pid} and not port_open(port)
    assert not running(pid) and processes_mentioning(Path(settings.gateway.directory)) == []
    # started again, then every host destroyed: the gateway goes with them
    started = subprocess.run([*fleet_cli, "gateway", "start", "--json"], env=env, capture_output=True, text=True)
    pid = json.loads(started.stdout)["pid"]
    destroyed = subprocess.run(
        [*fleet_cli, "destroy", "--all", "--yes", "--json"], env=env, capture_output=True, text=True
    )
    assert destroyed.returncode == 0, destroyed.stderr
    assert not port_open(port) and not running(pid)
    assert processes_mentioning(Path(settings.gateway.directory)) == []
