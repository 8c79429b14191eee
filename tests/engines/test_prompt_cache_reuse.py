"""fleet's patches 0007 and 0008 to llama.cpp (images/llama-server/patches): the RAM prompt cache (--cache-ram)
saves a slot's state into the memory of entries it dropped (0007), and a hybrid model's context checkpoints, made
while a prompt is processed and copied into each save, take the memory of dropped checkpoints and entries too
(0008). Unpatched, every save sized a fresh buffer to the state and to each checkpoint, and every prompt's
processing a fresh one to its checkpoint; a real model's state and a hybrid's checkpoint (tens of MiB each) are
above glibc's largest mmap threshold, so each mapped new memory and faulted in every page of it, on the server's
one thread, while every other slot waited.

A tiny model's state (0.4 MiB here; the tiny hybrid's checkpoint 144 KiB) is below glibc's dynamic threshold,
which hides the cost; MALLOC_MMAP_THRESHOLD_ puts it where a real model's always is. Counted here as the
server's page faults for each request once the cache is in its steady state. Without 0007, a request faulted
in about its whole state (102-111 faults for 102 pages on this CPU). With 0007 and without 0008, a hybrid's
request faulted in its checkpoints too (149-227 faults one slot at a time, 289-342 with four slots starting
together); 0008's first version, which kept a slot's dropped checkpoints only in the cache's spare memory, still
72-73 with four slots together (a full cache had no room for them). Patched: a few. And the cache still does
its job: a restored prompt's reply is the reply of a server without the cache."""

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from fleet.localcloud import tinymodels
from fleet.localcloud.llamaproc import serving

# glibc maps every allocation of this size or more afresh, as it does a real model's state and a real hybrid's
# checkpoint
MMAP_THRESHOLD = 64 << 10
PAGE = 4096
# The prompts cycled through the one slot this many times. The first cycle and the next request fill the cache:
# the first save after a restore is the first to find a dropped entry's memory.
CYCLES = 4
# A save into reused memory faults in none of it: the few faults left are the request's other allocations.
FAULTS_A_STATE_PAGE = 0.25
CASES = {
    # 1 MiB holds two states: every request's save evicts the oldest entry, and its prompt is not in the cache
    "evicting": {"model": "tiny", "cache_mib": 1, "prompts": 4},
    # 4 MiB holds them all: every request's save is followed by its own prompt's restore from the cache
    "restoring": {"model": "tiny", "cache_mib": 4, "prompts": 3},
    # the hybrid's checkpoints (0008): made in each prompt's processing, invalidated by the next prompt, copied
    # into each save. An entry is 0.8 MiB (its state and three checkpoints): 2 MiB holds two and the spare memory
    # of one, and every save evicts
    "hybrid-evicting": {"model": "tiny-hybrid", "cache_mib": 2, "prompts": 4},
    "hybrid-restoring": {"model": "tiny-hybrid", "cache_mib": 4, "prompts": 3},
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
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("prompt-cache")
    return {name: tinymodels.generate(tinymodels.MODELS[name], folder / tinymodels.MODELS[name].filename)
            for name in {c["model"] for c in CASES.values()}}  # fmt: skip


@pytest.fixture(scope="module")
def fresh_replies(llama_server: Path, models: dict[str, Path]) -> dict[tuple[str, int], str]:
    """Each model's reply to each prompt, greedy, from a server with no prompt cache: every token processed."""
    flags = ("-np", "1", "-c", "4096", "-t", "1", "--cache-ram", "0")
    replies = {}
    for name, model in models.items():
        with serving(llama_server, model, *flags, timeout_s=120) as served:
            for k in range(max(c["prompts"] for c in CASES.values())):
                replies[name, k] = ask(served.url, prompt(k))["reply"]
    return replies


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_save_takes_the_memory_of_what_the_cache_dropped(case, llama_server, models, fresh_replies, tmp_path):
    name, cache_mib, prompts = (CASES[case][k] for k in ("model", "cache_mib", "prompts"))
    log = tmp_path / "server.log"
    flags = ("-np", "1", "-c", "4096", "-t", "1", "--cache-ram", str(cache_mib), "-lv", "4")
    env = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    faults, turns = [], []
    with serving(llama_server, models[name], *flags, timeout_s=120, log=log, env=env) as served:
        for turn in range(CYCLES * prompts):
            before = minor_faults(served.pid)
            turns.append(ask(served.url, prompt(turn % prompts)))
            if turn > prompts:
                faults.append(minor_faults(served.pid) - before)
    said = log.read_text(errors="replace")
    state_mib = [float(m) for m in re.findall(r"total state size = ([0-9.]+) MiB", said)]
    assert len(state_mib) >= len(turns) - 1 and min(state_mib) * (1 << 20) > MMAP_THRESHOLD, state_mib
    # what a request would fault in afresh: its state, and each checkpoint its prompt made (a hybrid's)
    made = [float(m) for m in re.findall(r"created context checkpoint .* size = ([0-9.]+) MiB", said)]
    assert (len(made) >= len(turns) and min(made) * (1 << 20) > MMAP_THRESHOLD) == name.startswith("tiny-hybrid"), made
    fresh_pages = (min(state_mib) * len(turns) + sum(made)) * (1 << 20) / PAGE / len(turns)
    steady = turns[prompts:]
    if case.endswith("evicting"):
        assert said.count("removing oldest entry") >= len(steady), "every save made room"
        assert all(t["cached"] < 100 for t in steady), " ".join(str(t["cached"]) for t in steady)  # evicted
    else:
        # restored from the cache: all of it (a hybrid from its last checkpoint, made a few tokens before the end,
        # where the template's last turn begins)
        assert all(t["cached"] >= t["prompt"] - 8 for t in steady), " ".join(str(t["cached"]) for t in steady)
    for turn, found in enumerate(turns):
        assert found["reply"] == fresh_replies[name, turn % prompts], (case, turn)
    assert sum(faults) < FAULTS_A_STATE_PAGE * fresh_pages * len(faults), (case, fresh_pages, faults)


TOGETHER_SLOTS = 4
# four rounds fill the slots and the cache and settle how many checkpoints each slot holds; the last three count
TOGETHER_ROUNDS = 7
TOGETHER_SETTLED = 4


def test_slots_starting_together_take_the_checkpoints_they_dropped(llama_server, models, tmp_path):
    """Four requests at once, each taking a slot that holds another prompt, with the cache full (as 64 streams
    start on a card): every slot's old checkpoints are invalidated as its new prompt starts, and a full cache has
    no room to keep them, so the slot keeps them for its own new checkpoints (0008)."""
    log = tmp_path / "server.log"
    flags = ("-np", str(TOGETHER_SLOTS), "-c", str(4096 * TOGETHER_SLOTS), "-t", "1", "--cache-ram", "2", "-lv", "4")
    env = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    faults, replies = [], {}
    with (
        serving(llama_server, models["tiny-hybrid"], *flags, timeout_s=120, log=log, env=env) as served,
        ThreadPoolExecutor(TOGETHER_SLOTS) as pool,
    ):
        for r in range(TOGETHER_ROUNDS):
            before = minor_faults(served.pid)
            ks = [TOGETHER_SLOTS * r + i for i in range(TOGETHER_SLOTS)]
            for k, found in zip(ks, pool.map(lambda k: ask(served.url, prompt(k)), ks), strict=True):
                replies[k] = found
            if r >= TOGETHER_SETTLED:
                faults.append((minor_faults(served.pid) - before) / TOGETHER_SLOTS)
    said = log.read_text(errors="replace")
    state_mib = [float(m) for m in re.findall(r"total state size = ([0-9.]+) MiB", said)]
    made = [float(m) for m in re.findall(r"created context checkpoint .* size = ([0-9.]+) MiB", said)]
    assert said.count("removing oldest entry") >= TOGETHER_SLOTS * 2 and len(made) >= len(replies), "a full cache"
    assert all(t["cached"] < 100 for t in replies.values())  # a new prompt on a slot that held another
    fresh_pages = (min(state_mib) * len(replies) + sum(made)) * (1 << 20) / PAGE / len(replies)
    flags = ("-np", "1", "-c", "4096", "-t", "1", "--cache-ram", "0")
    with serving(llama_server, models["tiny-hybrid"], *flags, timeout_s=120) as served:
        assert all(ask(served.url, prompt(k))["reply"] == found["reply"] for k, found in replies.items())
    assert sum(faults) < FAULTS_A_STATE_PAGE * fresh_pages * len(faults), (fresh_pages, faults)
