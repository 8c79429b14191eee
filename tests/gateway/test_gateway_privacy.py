"""What one agent can learn of another's calls through the gateway: nothing, not even how much of a prompt a
host had cached. The round-four review read another agent's date of birth a guess at a time from what the
host's cache took of its guesses (`usage.prompt_tokens - timings.prompt_n`); the gateway now salts each
agent's requests (its cache group's, where the operator shares one), and a host reuses a cached prompt for
the same salt alone (llama-server patch 0005). Real hosts of the local cloud, real HAProxy, TLS at both ends."""

from __future__ import annotations

import contextlib
import http.server
import json
import ssl
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.app import Fleet
from fleet.context import tls_dir
from fleet.control import gateway
from fleet.control.up import UpRequest
from fleet.core import tls
from fleet.gateway.files import files_for
from fleet.gateway.runtime import Runtime
from tests.fleetkit import fleet_for, settings_for
from tests.gateway.test_gateway import (
    CHAT,
    client,
    gateway_of_test,
    gateway_settings,
    served_by_host,
    turn,
    wait_hosts_up,
)


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-privacy")


@pytest.fixture(scope="module")
async def one_host(module_cloud_env, module_dir: Path) -> AsyncIterator[str]:
    """One READY tiny host of one slot: every call, the victim's and the guesser's, is its."""
    async with fleet_for(settings_for(module_dir)) as fleet:
        try:
            [host] = (await fleet.up(UpRequest(model="tiny", region="eu", count=1))).ready
            yield host.name
        finally:
            await fleet.destroy(None)


@pytest.fixture
async def gw(one_host, module_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    async with gateway_of_test(module_dir, request) as fleet:
        yield fleet


# the victim's prompt; the attacker's guesses are the same text, word for word: the strongest guess there is
CLINIC = "You are the front desk of a clinic. The patient on this call was born on 14 March 1961. " * 5


async def host_of(fleet, agent: str, call: str) -> str:
    """The host (its slot's server) a call is pinned to: the gateway's stick table."""
    table = await Runtime(files_for(fleet.settings).socket).table("calls_t0")
    return table[f"{agent}/{call}"]["server_id"]


async def guesses_on_the_victims_host(fleet, victim: tuple[str, str], guessers: list[tuple[str, str]]) -> list[dict]:
    """The victim speaks on its call, then a guesser sends the victim's prompt word for word as a new call, a
    round for each guesser: each guess reaches the host's one slot while it holds the victim's prompt (a
    guesser of its own each round: a second guess would find the first, its own, in the host's prompt cache).
    The replies to the guesses."""
    victim_name, victim_key = victim
    guesses: list[dict[str, Any]] = []
    async with client(fleet, victim_key) as v:
        for i, (guesser_name, guesser_key) in enumerate(guessers):
            spoke = await v.post(CHAT, json=turn(CLINIC, 2), headers={"X-Session-Id": "patient"})
            assert spoke.status_code == 200, spoke.text
            async with client(fleet, guesser_key) as g:
                guess = await g.post(CHAT, json=turn(CLINIC, 2), headers={"X-Session-Id": f"guess-{i}"})
            assert guess.status_code == 200, guess.text
            assert await host_of(fleet, guesser_name, f"guess-{i}") == await host_of(fleet, victim_name, "patient")
            guesses.append(guess.json())
    return guesses


def cached(reply: dict[str, Any]) -> int:
    """The prompt tokens a reply says its host took from a cache, as the reviewer read them."""
    return reply["usage"]["prompt_tokens"] - reply["timings"]["prompt_n"]


async def test_an_agent_learns_nothing_of_another_agents_prompt_from_the_hosts_cache(gw):
    alice = await gateway.add_key(gw, "alice")
    guessers = [(name, await gateway.add_key(gw, name)) for name in ("mallory", "trudy", "eve")]
    await wait_hosts_up(gw, 1)
    async with client(gw, alice) as c:
        await c.post(CHAT, json=turn(CLINIC, 2), headers={"X-Session-Id": "patient"})
        own = (await c.post(CHAT, json=turn(CLINIC, 2), headers={"X-Session-Id": "patient"})).json()
    assert cached(own) > 100  # the agent's own call stays warm: the cache works for it
    for guess in await guesses_on_the_victims_host(gw, ("alice", alice), guessers):
        assert cached(guess) == 0, guess["timings"]  # every token of the guess processed: no hit to read
        assert guess["timings"]["cache_n"] == 0


@pytest.mark.parametrize("gw", [{"cache_groups": {"clinic": ["ada", "carol"]}}], indirect=True)
async def test_agents_of_one_cache_group_share_what_their_hosts_cached(gw):
    # the operator's choice: one team's agents share a long system prompt's cache (and so may read each other's)
    ada, carol = await gateway.add_key(gw, "ada"), await gateway.add_key(gw, "carol")
    await wait_hosts_up(gw, 1)
    for guess in await guesses_on_the_victims_host(gw, ("ada", ada), [("carol", carol)]):
        assert cached(guess) > 100, guess["timings"]


async def test_no_agent_chooses_a_slot_or_takes_several_completions(gw):
    key = await gateway.add_key(gw, "oscar")
    await wait_hosts_up(gw, 1)
    before = await served_by_host(gw)
    async with client(gw, key) as c:
        for extra in ({"id_slot": 0}, {"n": 4}, {"n_cmpl": 2}, {"n": "4"}):
            refused = await c.post(CHAT, json=turn("hello", 2, **extra))
            assert refused.status_code == 400, (extra, refused.text)
            assert refused.json()["error"]["code"] == "invalid_body"
        assert (await c.post(CHAT, json=turn("hello", 2, n=1))).status_code == 200
    after = await served_by_host(gw)
    assert sum(after.values()) - sum(before.values()) == 1  # the refused never reached a host


@contextlib.contextmanager
def echo_api(certificate: bytes, key: bytes, folder: Path) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """An HTTPS server standing for a hosted API the gateway overflows to (not one of fleet's parts): it answers
    a chat completion and keeps the headers each request brought. (port, the headers seen); stopped after."""
    (folder / "api.pem").write_bytes(certificate + key)
    seen: list[dict[str, str]] = []

    class Api(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            seen.append({k.lower(): v for k, v in self.headers.items()})
            body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "hi"}}], "usage": {}}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "api.pem")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


async def test_a_host_or_the_overflow_is_sent_only_the_headers_it_needs(tmp_path, monkeypatch, module_cloud_env):
    """Round two of the clients' review: the gateway passed every header of an agent's request to the rented
    host (cookies, user agent, its call id). A target with no host overflows here, to an API that shows what
    it got: the request's framing and type, fleet's own key for the provider, and nothing of the agent's."""
    settings = gateway_settings(tmp_path, "gw")
    ca = tls.ensure_ca(tls_dir(settings), "fleet CA")  # the CA the gateway checks the overflow with
    key_pem, cert_pem = tls.sign_server(ca, ["localhost"], 1)
    with echo_api(cert_pem, key_pem, tmp_path) as (port, seen):
        monkeypatch.setenv("FLEET_TEST_OVERFLOW_KEY", "provider-key")
        overflow = settings.gateway.overflow.model_copy(
            update={"url": f"https://localhost:{port}/v1", "key_env": "FLEET_TEST_OVERFLOW_KEY"}
            | {"ca_file": str(ca.certificate_path)}
        )
        settings = settings.model_copy(update={"gateway": settings.gateway.model_copy(update={"overflow": overflow})})
        async with fleet_for(settings) as fleet:
            try:
                await gateway.start(fleet)
                key = await gateway.add_key(fleet, "nosy")
                agent_headers = {"X-Session-Id": "call-7", "Cookie": "session=secret", "User-Agent": "agent/1.0",
                                 "X-Customer": "acme-clinic"}  # fmt: skip
                async with client(fleet, key) as c:
                    reply = await c.post(CHAT, json=turn("hi"), headers=agent_headers)
                assert reply.status_code == 200, reply.text
            finally:
                await gateway.stop(fleet)
    [got] = seen
    assert got["authorization"] == "Bearer provider-key" and got["content-type"] == "application/json"
    assert not {"x-session-id", "cookie", "user-agent", "x-customer", "x-fleet-cache-salt"} & set(got), got
    assert set(got) <= {"authorization", "content-type", "content-length", "accept", "host"}, got


@pytest.mark.parametrize("gw", [{"new_calls_per_agent_s": 1}], indirect=True)
async def test_an_agents_flood_of_new_calls_is_refused_while_its_turns_and_other_agents_go_on(gw):
    """Security round four: one agent's refused new calls stalled another agent's stream. New calls are limited
    per agent (here 1 a second over 10 s: 10); a turn of a call in progress never is, nor is another agent."""
    flood, calm = await gateway.add_key(gw, "flood"), await gateway.add_key(gw, "calm")
    await wait_hosts_up(gw, 1)
    async with client(gw, flood) as c:
        answered = [
            (await c.post(CHAT, json=turn("hi", 2), headers={"X-Session-Id": f"flood-{i}"})).status_code
            for i in range(12)
        ]
        refused = await c.post(CHAT, json=turn("hi", 2), headers={"X-Session-Id": "flood-12"})
        turn_goes_on = await c.post(CHAT, json=turn("hi again", 2), headers={"X-Session-Id": "flood-0"})
    assert answered == [200] * 10 + [429] * 2, answered
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "too_many_new_calls"
    assert turn_goes_on.status_code == 200
    async with client(gw, calm) as c:
        assert (await c.post(CHAT, json=turn("hi", 2), headers={"X-Session-Id": "calm-1"})).status_code == 200
