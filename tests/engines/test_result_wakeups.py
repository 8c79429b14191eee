"""fleet's patch 0006 to llama.cpp (images/llama-server/patches): a result wakes only the HTTP thread waiting for
it. Unpatched, every result the server's thread sends wakes every waiting HTTP thread, which takes the result
mutex, finds nothing of its own and sleeps again: at N streams each token costs about N wakeups, and a step N^2,
on the mutex the server's thread needs to send the next result. Counted here as the voluntary context switches
of all the server's threads for each token generated, with 32 streams at once on the tiny model; and every
stream's tokens reach it and no other, a stream its client leaves goes, the rest go on."""

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from fleet.localcloud import tinymodels
from fleet.localcloud.llamaproc import serving

STREAMS = 32
TOKENS = 32
# Patched, a token wakes its own stream's thread once or twice (the result, the socket); unpatched it woke about
# every stream's waiting thread, so the ratio grew with the streams (measured on this CPU in the patch's note).
WAKEUPS_A_TOKEN = 4


@pytest.fixture(scope="module")
def server(llama_server: Path, tmp_path_factory):
    model = tinymodels.generate(tinymodels.MODELS["tiny"], tmp_path_factory.mktemp("wakeups") / "tiny.gguf")
    flags = ("-np", str(STREAMS + 1), "-c", str((STREAMS + 1) * 256), "-t", "2", "--no-cache-prompt")
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


async def many(url: str, leaving: int = 0) -> tuple[list[list[int]], list[int]]:
    limits = httpx.Limits(max_connections=STREAMS + 1, max_keepalive_connections=0)
    seen: list[int] = []
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        runs = [stream(client, url, k, TOKENS, seen) for k in range(STREAMS)]
        if leaving:
            runs.append(stream(client, url, STREAMS, TOKENS * 4, seen, leave_after=leaving))
        return await asyncio.gather(*runs), seen


def test_a_token_wakes_its_own_stream_not_every_stream(server):
    asyncio.run(many(server.url))  # warm: the slots, the HTTP threads and the graphs exist before counting
    before = voluntary_switches(server.pid)
    replies, seen = asyncio.run(many(server.url))
    switches = voluntary_switches(server.pid) - before
    tokens = sum(sum(chunks) for chunks in replies)
    assert tokens == STREAMS * TOKENS  # every stream got its own tokens: none lost, none another stream's
    # the streams ran together: when the first one ended, nearly every other had had tokens already
    first_done = next(i for i, k in enumerate(seen) if seen[: i + 1].count(k) == TOKENS + 1)
    assert len(set(seen[:first_done])) >= STREAMS * 3 // 4, seen[:first_done]
    assert switches / tokens <= WAKEUPS_A_TOKEN, f"{switches} voluntary switches for {tokens} tokens"


def test_a_stream_its_client_leaves_ends_and_the_others_go_on(server):
    replies, _ = asyncio.run(many(server.url, leaving=4))
    *whole, left = replies
    assert len(left) == 4
    assert [sum(chunks) for chunks in whole] == [TOKENS] * STREAMS
    # the left stream's slot is free again and the server answers: a waiter left behind would hang here
    after = httpx.post(f"{server.url}/completion", json={"prompt": "again", "n_predict": 4}, timeout=60)
    assert after.status_code == 200 and after.json()["tokens_predicted"] == 4
