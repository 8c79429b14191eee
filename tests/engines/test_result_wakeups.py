"""fleet's patch 0006 to llama.cpp (images/llama-server/patches): a result wakes only the HTTP thread waiting for
it. Unpatched, every result the server's thread sends wakes every waiting HTTP thread, which takes the result
mutex, finds nothing of its own and sleeps again: at N streams each token costs about N wakeups, and a step N^2,
on the mutex the server's thread needs to send the next result. Counted here as the voluntary context switches
of all the server's threads for each token generated, with 32 streams at once on a tiny model; and every
stream's tokens reach it and no other, a stream its client leaves goes, the rest go on."""

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest

from fleet.localcloud import tinymodels
from fleet.localcloud.llamaproc import serving

STREAMS = 32
TOKENS = 64
# Patched, a token wakes its own stream's thread once or twice (the result, the socket); unpatched it woke about
# every stream's waiting thread, so the ratio grew with the streams (measured on this CPU in the patch's note).
WAKEUPS_A_TOKEN = 4


@pytest.fixture(scope="module")
def server(llama_server: Path, tmp_path_factory):
    # Gemma's vocabulary makes a step long enough for every stream's request to arrive before the first ends
    model = tinymodels.generate(tinymodels.LARGE_VOCAB, tmp_path_factory.mktemp("wakeups") / "gemma-vocab.gguf")
    flags = ("-np", str(STREAMS + 1), "-c", str((STREAMS + 1) * 256), "-t", "2", "--no-cache-prompt", "--metrics")
    with serving(llama_server, model, *flags, timeout_s=120) as served:
        yield served


def voluntary_switches(pid: int) -> int:
    """The voluntary context switches of every thread of the process so far (each a wait that slept)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except FileNotFoundError:  # a thread that ended between the listing and the read
            continue
        total += int(text.split("voluntary_ctxt_switches:", 1)[1].split()[0])
    return total


async def stream(client: httpx.AsyncClient, url: str, k: int, tokens: int, seen: list[int], leave_after: int = 0):
    """One streaming completion: its chunks' token counts; `seen` records each chunk's stream in arrival order.
    With `leave_after`, the client closes the stream after that many chunks."""
    body = {"prompt": f"caller {k} asks when the order ships", "n_predict": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_tokens": True}  # fmt: skip
    chunks: list[int] = []
    async with client.stream("POST", f"{url}/completion", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: ") :])
            chunks.append(len(chunk.get("tokens", [])))
            seen.append(k)
            if leave_after and len(chunks) >= leave_after:
                break
            if chunk.get("stop"):
                assert chunk["tokens_predicted"] == tokens
                break
    return chunks


def client() -> httpx.AsyncClient:
    # connections kept open between runs: a run's requests then leave at once, and its streams run together
    limits = httpx.Limits(max_connections=STREAMS + 1, max_keepalive_connections=STREAMS + 1)
    return httpx.AsyncClient(timeout=300, limits=limits)


async def many(http: httpx.AsyncClient, url: str, leaving: int = 0) -> list[list[int]]:
    seen: list[int] = []
    runs = [stream(http, url, k, TOKENS, seen) for k in range(STREAMS)]
    if leaving:
        runs.append(stream(http, url, STREAMS, 200, seen, leave_after=leaving))
    return await asyncio.gather(*runs)


async def metrics(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await http.get(f"{url}/metrics")).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^llamacpp:(\w+) (\S+)$", text, re.M)}


async def counted(server) -> tuple[list[list[int]], int, float]:
    """A warm-up run, then a run of STREAMS streams at once: their chunks, the voluntary context switches of the
    server's threads during it, and the tokens it generated for each llama_decode call (the streams a step)."""
    async with client() as http:
        await many(http, server.url)  # the slots, the connections, the HTTP threads and the graphs exist
        before, switches = await metrics(http, server.url), voluntary_switches(server.pid)
        replies = await many(http, server.url)
        switches = voluntary_switches(server.pid) - switches
        after = await metrics(http, server.url)
    decodes = after["n_decode_total"] - before["n_decode_total"]
    return replies, switches, (after["tokens_predicted_total"] - before["tokens_predicted_total"]) / decodes


def test_a_token_wakes_its_own_stream_not_every_stream(server):
    replies, switches, together = asyncio.run(counted(server))
    tokens = sum(sum(chunks) for chunks in replies)
    assert tokens == STREAMS * TOKENS  # every stream got its own tokens: none lost, none another stream's
    # the streams ran together (unpatched, each token then woke every other stream's waiting thread)
    assert together >= STREAMS / 4, together
    assert switches / tokens <= WAKEUPS_A_TOKEN, f"{switches} voluntary switches for {tokens} tokens"


def test_a_stream_its_client_leaves_ends_and_the_others_go_on(server):
    async def run() -> list[list[int]]:
        async with client() as http:
            return await many(http, server.url, leaving=4)

    replies = asyncio.run(run())
    *whole, left = replies
    assert len(left) == 4
    assert [sum(chunks) for chunks in whole] == [TOKENS] * STREAMS
    # the left stream's slot is free again and the server answers: a waiter left behind would hang here
    after = httpx.post(f"{server.url}/completion", json={"prompt": "again", "n_predict": 4}, timeout=60)
    assert after.status_code == 200 and after.json()["tokens_predicted"] == 4
