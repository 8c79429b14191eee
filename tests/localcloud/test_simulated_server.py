"""The simulated host's llama-server (issue 48): fleet's own probes pass on it unchanged, it keeps each cache salt
apart, its decode follows the card model, and it refuses what llama-server refuses."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from fleet.localcloud.cardmodel import CardModel, from_results
from fleet.localcloud.network import free_port
from fleet.localcloud.simserver import SALT_HEADER, SimulatedServer
from fleet.probes.runner import run_probes
from fleet.probes.server import Server
from fleet.probes.stream import Connection
from tests.fleetkit import settings_for

# a card that decodes 2,000 tokens a second for one stream and 1,000 a stream at four at once
CARD = CardModel("test", ((1, 2000.0), (4, 4000.0)))


@asynccontextmanager
async def serving(sim: SimulatedServer) -> AsyncIterator[Server]:
    runner = web.AppRunner(sim.app(), keepalive_timeout=60)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield Server(f"http://127.0.0.1:{port}", api_key=sim.api_key)
    finally:
        await runner.cleanup()


def simulated(**kw: object) -> SimulatedServer:
    return SimulatedServer(card=kw.pop("card", CARD), api_key=secrets.token_hex(16), **kw)  # type: ignore[arg-type]


async def test_every_probe_of_fleet_passes_on_a_simulated_host_of_each_users_model(tmp_path):
    settings = settings_for(tmp_path)
    tiny = settings.profile("tiny")
    # thermal's samples shorter than tiny's: 1,000 tokens at the cards' 55-99 tok/s a stream at 4 streams would
    # take 10-18 s a sample
    probes = tiny.probes.model_copy(update={"thermal_tokens": 100, "thermal_seconds": 2})
    profile = tiny.model_copy(update={"slots": 4, "probes": probes})
    for name in ("a4b", "phonellm", "nemo"):
        async with serving(simulated(card=from_results(name), slots=4)) as server:
            results = await run_probes(["smoke", "cache", "keepalive", "thermal"], server, profile, settings, None)
        assert [(r.name, r.passed) for r in results] == [
            (n, True) for n in ("smoke", "cache", "keepalive", "thermal")
        ], [(r.name, r.diagnosis) for r in results]
        cache = results[1].metrics
        assert all(n > 0 for n in cache["cache_n"]) and cache["rewrite"]["cache_n"] > 0, cache


async def test_a_salt_never_reuses_another_salts_prompt_and_pays_its_whole_prefill():
    body = {"messages": [{"role": "user", "content": "My account number is 4417."}], "max_tokens": 4}
    async with serving(simulated(slots=1)) as server, server.client(timeout=10) as client:

        async def ask(salt: str | None) -> tuple[int, int, int]:
            headers = {SALT_HEADER: salt} if salt is not None else {}
            answer = (await client.post("/v1/chat/completions", json=body, headers=headers)).json()
            return answer["usage"]["prompt_tokens"], answer["timings"]["cache_n"], answer["timings"]["prompt_n"]

        first, again, other, unsalted = (
            await ask("agent-a"),
            await ask("agent-a"),
            await ask("agent-b"),
            await ask(None),
        )
    prompt = first[0]
    assert first == (prompt, 0, prompt)
    assert again == (prompt, prompt - 1, 1)  # all but the prompt's last token, as llama-server
    assert other == unsalted == (prompt, 0, prompt)


async def test_a_stream_decodes_at_the_cards_rate_for_the_streams_decoding_beside_it():
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 1000, "ignore_eos": True}

    async def rates(server: Server, streams: int) -> list[float]:
        conns = [Connection(server) for _ in range(streams)]
        try:
            replies = await asyncio.gather(*(c.chat(body) for c in conns))
        finally:
            await asyncio.gather(*(c.close() for c in conns))
        assert all(r.served.predicted_n == 1000 and r.finish_reason == "length" for r in replies)
        return [r.served.predicted_per_second for r in replies]

    async with serving(simulated(slots=4)) as server:
        alone, together = await rates(server, 1), await rates(server, 4)
    # never faster than the card; a late event loop only delays the last tick (under a second in all here)
    assert 2000 / 2 < alone[0] <= 2000 * 1.02, alone
    assert all(1000 / 2 < r <= 1000 * 1.02 for r in together), together


async def test_it_refuses_what_llama_server_refuses_in_llama_servers_words():
    chat = "/v1/chat/completions"
    hello = [{"role": "user", "content": "hi"}]
    async with serving(simulated(slots=1, ctx_per_slot=64)) as server:
        wrong_key = Server(server.url, api_key="0" * 32)
        async with (
            server.client(timeout=10) as client,
            server.without_key().client(timeout=10) as stranger,
            wrong_key.client(timeout=10) as impostor,
        ):
            assert (await stranger.get("/health")).status_code == 200
            for path in ("/props", "/metrics", "/tokenize", "/apply-template", chat):
                for who in (stranger, impostor):
                    refused = await who.request("POST" if path != "/props" and path != "/metrics" else "GET", path)
                    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
            assert (await client.post(chat, content=b"{not json")).status_code == 400
            assert (await client.post(chat, json={"messages": []})).status_code == 400
            assert (await client.post(chat, json={"messages": hello, "max_tokens": 0})).status_code == 400
            refused = await client.post(chat, json={"messages": [{"role": "user", "content": "x" * 100}]})
            assert refused.status_code == 400 and "context size" in refused.json()["error"]["message"]
            plain = (await client.post(chat, json={"messages": hello, "max_tokens": 3})).json()
            assert plain["choices"][0]["message"]["content"] == "Sur" and plain["timings"]["predicted_n"] == 3
            # a reply longer than the context holds stops where it is full, as llama-server's without context shift
            full = (await client.post(chat, json={"messages": hello, "max_tokens": 500, "ignore_eos": True})).json()
            assert full["usage"]["completion_tokens"] == 64 - 1 - full["usage"]["prompt_tokens"] > 0
            assert full["choices"][0]["finish_reason"] == "length"
