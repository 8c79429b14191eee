"""llama-server's cache salt (fleet's patch 0005, images/llama-server/patches): a prompt's cached state (the
slot's, the prompt cache's with --cache-ram) is reused only by a request of the same salt, which fleet's hosts
take from the header the gateway sets per agent (--cache-salt-header). Without it, an agent that sent a guess
of another agent's prompt read from `timings` (or its first token's time) how much of the guess was cached.

Each server here has the flags fleet gives a host; the salts are the header's. The same server shows the
oracle the patch closes: requests of one salt (as every request was before) take the cached prefix."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleet.engines import CACHE_SALT_HEADER
from fleet.localcloud import tinymodels
from fleet.localcloud.llamaproc import llama_server as run_llama_server

# a clinic's prompt, long enough that a cached prefix is most of it
PROMPT = "You are the front desk of a clinic. The patient on this call was born on 14 March 1961. " * 6
SERVERS = {
    "one slot": ["-np", "1", "--cache-ram", "0"],
    "two slots by similarity": ["-np", "2", "--cache-ram", "0", "--slot-prompt-similarity", "0.1"],
    "the prompt cache": ["-np", "1", "--cache-ram", "64"],
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    tiny = tinymodels.MODELS["tiny"]
    return tinymodels.generate(tiny, tmp_path_factory.mktemp("salt") / tiny.filename)


@pytest.fixture(scope="module", params=sorted(SERVERS))
def server(request, llama_server: Path, model: Path) -> Iterator[tuple[str, str]]:
    flags = SERVERS[request.param]
    with run_llama_server(
        llama_server, model, *flags, "-c", "4096", "-t", "1", "--cache-salt-header", CACHE_SALT_HEADER, timeout_s=120
    ) as url:
        yield request.param, url


def ask(url: str, salt: str | None, **body: object) -> dict[str, object]:
    """One greedy turn: the prompt tokens it took from a cache, those it processed, and its reply."""
    headers = {CACHE_SALT_HEADER: salt} if salt is not None else {}
    payload = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0, **body}
    reply = httpx.post(f"{url}/v1/chat/completions", json=payload, headers=headers, timeout=120)
    assert reply.status_code == 200, reply.text
    found = reply.json()
    timings = found["timings"]
    assert timings["cache_n"] + timings["prompt_n"] == found["usage"]["prompt_tokens"], found
    reply = found["choices"][0]["message"]["content"]
    return {"cached": timings["cache_n"], "processed": timings["prompt_n"], "prompt": found["usage"]["prompt_tokens"],
            "reply": reply}  # fmt: skip


def test_a_prompt_cached_under_one_salt_is_never_reused_under_another(server):
    name, url = server
    first = ask(url, "alice")
    assert first["prompt"] > 100 and first["cached"] == 0
    again = ask(url, "alice")  # the oracle the salt keeps within one agent: its own prompt is cached
    assert again["cached"] >= first["prompt"] - 2, (name, again)
    # another agent sending the same prompt, word for word, learns nothing: every token processed; and the
    # salt changes what is reused, never what is said: the same greedy reply as the first, processed whole
    bob = ask(url, "bob")
    assert bob["cached"] == 0 and bob["reply"] == first["reply"], (name, bob, first)
    # a body's cache_salt is not the client's to choose on a server that takes it from the header
    assert ask(url, "mallory", cache_salt="bob")["cached"] == 0, name
    unsalted = ask(url, None, cache_salt="mallory")  # no header: the empty salt, as a request before the patch
    assert unsalted["cached"] == 0 and unsalted["reply"] == first["reply"], name
    if name == "the prompt cache":
        # the state alice's turns left was saved when the slot went to another salt, and comes back for her alone
        assert ask(url, "alice")["cached"] >= first["prompt"] - 2, name


def test_one_salt_reuses_its_cache_as_every_request_did_before(server):
    name, url = server
    ask(url, "team")
    # the same salt on every request (or none at all) is the server without the patch: the prefix is reused
    assert ask(url, "team")["cached"] > 100, name
    ask(url, None)
    assert ask(url, None)["cached"] > 100, name
