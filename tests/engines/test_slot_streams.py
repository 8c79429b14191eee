"""A KV cache stream per slot, fleet's layout for a multi-slot host, on the real llama-server with fleet's patch
0003 (images/llama-server/patches): calls on any set of slots, with idle calls in every other slot, decode in
one forward pass a step, and each call's reply and top probabilities are bitwise what the same calls give on
neighbouring slots, on a plain-attention, a windowed (iSWA) and a hybrid (Mamba2 + attention) model, with flash
attention on and off. Unpatched, llama.cpp runs such a step in one pass per run of neighbouring slots, and the
replies' probabilities differ from the neighbours' in their last bits."""

import asyncio
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from fleet.localcloud import tinymodels
from fleet.localcloud.llamaproc import llama_server as run_llama_server

SETS = ((0, 2), (0, 2, 5), (1, 2, 6, 7), (3, 7))
SLOTS = 8
# A slot no set uses: its long prompt holds the server in one step while the speakers' requests arrive, so that
# the speakers start in one step (a call's numbers depend on which calls share its steps) and it is the last
# stream of any step it shares, on neighbouring slots and apart alike.
BLOCKER = SLOTS
TOKENS = 24
WORDS = "the caller asked about the delivery window and the agent read the order back "
LAUNCH = re.compile(rf"launch_slot_: id\s+{BLOCKER} \|")
REUSED = re.compile(r"graphs reused =\s+(\d+)")


def text(tag: str, n: int) -> str:
    """About n tokens (one a character on the byte-level test models), its own from its first characters."""
    head = f"{tag}: "
    return head + (WORDS * (n // len(WORDS) + 1))[: n - len(head)]


async def complete(client: httpx.AsyncClient, url: str, slot: int, prompt: str, tokens: int, cache: bool = True):
    body = {"prompt": prompt, "n_predict": tokens, "id_slot": slot, "temperature": 0, "ignore_eos": True,
            "cache_prompt": cache, "n_probs": 3}  # fmt: skip
    reply = await client.post(f"{url}/completion", json=body)
    assert reply.status_code == 200, reply.text
    found = reply.json()
    return found["content"], json.dumps(found["completion_probabilities"])


async def speak(url: str, log: Path, slots: tuple[int, ...]) -> list[tuple[str, str]]:
    """The k-th speaker's call on slots[k], all started in one step: each slot erased first (its cells laid out
    afresh, as on any other slot), then the blocker sent, and the speakers once the server has taken it."""
    async with httpx.AsyncClient(timeout=300) as client:
        for slot in slots:
            (await client.post(f"{url}/slots/{slot}", params={"action": "erase"})).raise_for_status()
        start = len(log.read_text())
        blocker = asyncio.create_task(complete(client, url, BLOCKER, text("blocker", 3900), 1, cache=False))
        deadline = time.monotonic() + 30
        while not LAUNCH.search(log.read_text()[start:]):
            assert time.monotonic() < deadline, "the server never took the blocker"
            await asyncio.sleep(0.002)
        replies = await asyncio.gather(
            *(complete(client, url, slot, text(f"speaker {k}", 90), TOKENS) for k, slot in enumerate(slots))
        )
        await blocker
    return replies


def steps(log_text: str) -> list[tuple[str, int, tuple[int, ...]]]:
    """llama.cpp's batch log (LLAMA_BATCH_DEBUG): each input batch ("batch") and each micro-batch it was split
    into ("ubatch"), with its tokens and sequences."""
    found, kind, n_tokens = [], None, 0
    for line in log_text.splitlines():
        if "input batch info" in line:
            kind = "batch"
        elif "added ubatch to split" in line:
            kind = "ubatch"
        elif kind and "n_tokens     =" in line:
            n_tokens = int(line.rsplit("=", 1)[1])
        elif kind and "seq_id_unq" in line:
            found.append((kind, n_tokens, tuple(int(s) for s in re.findall(r"\d+", line.split("=", 1)[1]))))
            kind = None
    return found


def shape(found: list[tuple[str, int, tuple[int, ...]]], slots: tuple[int, ...]) -> list[tuple]:
    """The input batches that held a speaker: their tokens and sequences, slots named by speaker ("b" the
    blocker). Two runs whose shapes are equal took their steps alike, whatever the split did with them."""
    names = {slot: k for k, slot in enumerate(slots)} | {BLOCKER: "b"}
    return [(n, tuple(names.get(s, s) for s in seqs)) for kind, n, seqs in found
            if kind == "batch" and set(seqs) & set(slots)]  # fmt: skip


@dataclass
class Run:
    replies: list[tuple[str, str]]  # each speaker's reply and top probabilities, as the server wrote them
    found: list[tuple[str, int, tuple[int, ...]]]  # the batch log of the run
    shape: list[tuple]
    reused: int  # graphs reused in the run


def run(url: str, log: Path, slots: tuple[int, ...]) -> Run:
    start, before = len(log.read_text()), REUSED.findall(log.read_text())[-1]
    replies = asyncio.run(speak(url, log, slots))
    time.sleep(0.2)  # the last reply's lines reach the log
    written = log.read_text()[start:]
    found = steps(written)
    return Run(replies, found, shape(found, slots), int(REUSED.findall(written)[-1]) - int(before))


def side_by_side(url: str, log: Path, apart: tuple[int, ...]) -> tuple[Run, Run]:
    """The same calls on neighbouring slots and on `apart`, again until both runs took their steps alike with
    every speaker in each (a busy machine can delay a request past the blocker's step)."""
    for _ in range(5):
        neighbours, spread = run(url, log, tuple(range(len(apart)))), run(url, log, apart)
        together = [seqs for _, seqs in spread.shape if len(set(seqs) - {"b"}) == len(apart)]
        if neighbours.shape == spread.shape and len(together) >= TOKENS:
            return neighbours, spread
    pytest.fail(f"{apart}: the speakers never took their steps together: {spread.shape[:12]}")


@pytest.mark.parametrize("fa", ["on", "off"])
@pytest.mark.parametrize("name", ["tiny", "tiny-swa", "tiny-hybrid"])
def test_calls_on_any_slots_decode_in_one_pass_as_on_neighbouring_slots(llama_server, tmp_path, monkeypatch, name, fa):
    monkeypatch.setenv("LLAMA_BATCH_DEBUG", "1")  # each batch and micro-batch's sequences, in the log
    model = tinymodels.generate(name, tmp_path / f"{name}.gguf")
    log, saves = tmp_path / "server.log", tmp_path / "saves"
    saves.mkdir()  # a slot is erased through /slots, which wants a folder for saves it is never asked
    flags = ["-np", str(SLOTS + 1), "-c", str((SLOTS + 1) * 4096), "-b", "4096", "-t", "1", "-fa", fa, "-no-kvu"]
    flags += ["-v", "--slot-save-path", str(saves)]
    with run_llama_server(llama_server, model, *flags, timeout_s=120, log=log) as url:

        async def hold_idle_calls() -> None:
            async with httpx.AsyncClient(timeout=300) as client:
                for slot in range(SLOTS):
                    await complete(client, url, slot, text(f"idle call {slot}", 200), 1)

        asyncio.run(hold_idle_calls())
        for apart in SETS:
            neighbours, spread = side_by_side(url, log, apart)
            # every step that held all the speakers ran them in one micro-batch: one forward pass for all
            batches = [seqs for kind, _, seqs in spread.found if kind == "batch" and set(apart) <= set(seqs)]
            passes = [set(seqs) for kind, _, seqs in spread.found if kind == "ubatch" and set(seqs) & set(apart)]
            assert len(batches) >= TOKENS and len(passes) >= len(batches), (apart, passes[:6])
            assert all(set(apart) <= seqs for seqs in passes), (apart, passes[:6])
            assert spread.reused >= TOKENS - 4, (apart, spread.reused)  # the same set again: its graph reused
            # and each call said, to the last bit of its top probabilities, what it says on neighbouring slots
            assert [r[0] for r in spread.replies] == [r[0] for r in neighbours.replies], apart
            assert spread.replies == neighbours.replies, f"{apart}: probabilities differ from the neighbours'"


def test_a_server_that_does_not_come_up_says_why(llama_server, tmp_path):
    # a bench on a borrowed machine brings back its error and not the server's log (bench/gpu/run slots on
    # 2026-12-06): the error carries the log's last lines
    model = tinymodels.generate("tiny", tmp_path / "tiny.gguf")
    flags = ["-md", str(model), "--spec-type", "draft-mtp"]  # the tiny model has no MTP layers
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError) as refused, run_llama_server(llama_server, model, *flags, timeout_s=60, log=log):
        pass
    said = str(refused.value).splitlines()
    assert said[0].startswith("llama-server did not come up on http://127.0.0.1:")
    assert any("failed to create MTP context" in line for line in said[1:]), said
