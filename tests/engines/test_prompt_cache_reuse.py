"""fleet's patch 0007 to llama.cpp (images/llama-server/patches): the RAM prompt cache (--cache-ram) saves a
slot's state into the memory of entries it dropped. Unpatched, every save sized a fresh buffer to the state; a
real model's state (tens of MiB) is above glibc's largest mmap threshold, so each save mapped new memory and
faulted in every page of it, on the server's one thread, while every other slot waited.

A tiny model's state (0.4 MiB here) is below glibc's dynamic threshold, which hides the cost; MALLOC_MMAP_THRESHOLD_
puts it where a real model's state always is. Counted here as the server's page faults for each request once
the cache is in its steady state: unpatched, a request faulted in about its whole state (102-111 faults for 102
pages on this CPU), in both cases below. And the cache still does its job: a restored prompt's reply is the
reply of a server without the cache."""

import re
from pathlib import Path

import httpx
import pytest

from fleet.localcloud import tinymodels
from fleet.localcloud.llamaproc import serving

# glibc maps every allocation of this size or more afresh, as it does a real model's state
MMAP_THRESHOLD = 64 << 10
PAGE = 4096
# The prompts cycled through the one slot this many times. The first cycle and the next request fill the cache:
# the first save after a restore is the first to find a dropped entry's memory.
CYCLES = 4
# A save into reused memory faults in none of it: the few faults left are the request's other allocations.
FAULTS_A_STATE_PAGE = 0.25
CASES = {
    # 1 MiB holds two states: every request's save evicts the oldest entry, and its prompt is not in the cache
    "evicting": {"cache_mib": 1, "prompts": 4},
    # 4 MiB holds them all: every request's save is followed by its own prompt's restore from the cache
    "restoring": {"cache_mib": 4, "prompts": 3},
}


def prompt(k: int) -> str:
    """About 1,550 tokens sharing nothing past the chat template with another k's, and as many as theirs: a
    dropped entry's memory is reused by a state it can hold."""
    return f"Caller {k} says: " + " ".join(f"w{(k * 7919 + j * 104729) % 9000 + 1000}" for j in range(260))


def ask(url: str, text: str) -> dict[str, object]:
    payload = {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=120)
    assert reply.status_code == 200, reply.text
    found = reply.json()
    return {"cached": found["timings"]["cache_n"], "prompt": found["usage"]["prompt_tokens"],
            "reply": found["choices"][0]["message"]["content"]}  # fmt: skip


def minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    tiny = tinymodels.MODELS["tiny"]
    return tinymodels.generate(tiny, tmp_path_factory.mktemp("prompt-cache") / tiny.filename)


@pytest.fixture(scope="module")
def fresh_replies(llama_server: Path, model: Path) -> dict[int, str]:
    """Each prompt's greedy reply from a server with no prompt cache: every token processed."""
    flags = ("-np", "1", "-c", "4096", "-t", "1", "--cache-ram", "0")
    with serving(llama_server, model, *flags, timeout_s=120) as served:
        return {k: ask(served.url, prompt(k))["reply"] for k in range(max(c["prompts"] for c in CASES.values()))}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_save_takes_the_memory_of_what_the_cache_dropped(case, llama_server, model, fresh_replies, tmp_path):
    cache_mib, prompts = CASES[case]["cache_mib"], CASES[case]["prompts"]
    log = tmp_path / "server.log"
    flags = ("-np", "1", "-c", "4096", "-t", "1", "--cache-ram", str(cache_mib), "-lv", "4")
    env = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    faults, turns = [], []
    with serving(llama_server, model, *flags, timeout_s=120, log=log, env=env) as served:
        for turn in range(CYCLES * prompts):
            before = minor_faults(served.pid)
            turns.append(ask(served.url, prompt(turn % prompts)))
            if turn > prompts:
                faults.append(minor_faults(served.pid) - before)
    said = log.read_text(errors="replace")
    state_mib = [float(m) for m in re.findall(r"total state size = ([0-9.]+) MiB", said)]
    assert len(state_mib) >= len(turns) - 1 and min(state_mib) * (1 << 20) > MMAP_THRESHOLD, state_mib
    state_pages = min(state_mib) * (1 << 20) / PAGE
    steady = turns[prompts:]
    if case == "evicting":
        assert said.count("removing oldest entry") >= len(steady), "every save made room"
        assert all(t["cached"] < 100 for t in steady), steady  # its prompt had been evicted
    else:
        assert all(t["cached"] >= t["prompt"] - 2 for t in steady), steady  # restored from the cache
    for turn, found in enumerate(turns):
        assert found["reply"] == fresh_replies[turn % prompts], (case, turn)
    assert sum(faults) < FAULTS_A_STATE_PAGE * state_pages * len(faults), (case, state_pages, faults)
