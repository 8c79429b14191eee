"""The KV cache fleet gives a multi-slot host, on the real llama-server: calls on any slots decode in one
forward pass a step (with a stream per slot, calls on slots apart take one pass each: half the decode on a
card, bench/slots.py)."""

import asyncio
import re

import httpx

from fleet.core.config import Profile
from fleet.engines.llama_server import KV_LAYOUT, profile_args
from fleet.localcloud import tinymodels
from fleet.localcloud.llamaproc import llama_server as run_llama_server

SECOND_TOKENS = 48
PROFILE = Profile(
    name="three",
    gpu_ram_gb=0,
    disk_gb=10,
    slots=3,
    ctx_per_slot=4096,
    files=[{"key": "main", "repo": "fleet-local/tiny-models", "file": "tiny.gguf"}],
    args=["-c", "12288", "-np", "3", "-t", "1"],
)


async def overlapping_calls(url: str) -> None:
    """A long call on slot 0, and while it decodes (its first token seen) a short one on slot 2; the long one
    is ended when the short one is done. The two share every step of the short one, however busy the machine."""
    async with httpx.AsyncClient(timeout=300) as client:
        decoding = asyncio.Event()

        async def long_call() -> None:
            body = {"prompt": "call 0: hello", "n_predict": 3000, "id_slot": 0, "ignore_eos": True, "stream": True}
            async with client.stream("POST", f"{url}/completion", json=body) as stream:
                assert stream.status_code == 200
                async for line in stream.aiter_lines():  # read on: a client gone would end the call
                    if line.startswith("data: "):
                        decoding.set()

        long = asyncio.create_task(long_call())
        await asyncio.wait_for(decoding.wait(), 120)
        short = {"prompt": "call 2: hello", "n_predict": SECOND_TOKENS, "id_slot": 2, "ignore_eos": True}
        reply = await client.post(f"{url}/completion", json=short)
        assert not long.done()  # still decoding when the short call ended
        long.cancel()
        assert reply.status_code == 200, reply.text
        assert reply.json()["timings"]["predicted_n"] == SECOND_TOKENS


def steps_and_joins(log_text: str) -> tuple[int, int]:
    """From llama.cpp's batch log (LLAMA_BATCH_DEBUG): the steps whose batch held both calls, and the
    micro-batches (forward passes) that held both."""
    steps = joined = 0
    kind = None
    for line in log_text.splitlines():
        if "input batch info" in line:
            kind = "batch"
        elif "added ubatch to split" in line:
            kind = "ubatch"
        elif "seq_id_unq" in line and kind:
            both = {"0", "2"} <= set(re.findall(r"\d+", line.split("=", 1)[1]))
            steps += both and kind == "batch"
            joined += both and kind == "ubatch"
            kind = None
    return steps, joined


def test_two_calls_on_slots_apart_decode_in_one_pass_with_fleets_flags_and_in_two_without(
    llama_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("LLAMA_BATCH_DEBUG", "1")  # each batch and micro-batch's sequences, in the log
    model = tinymodels.generate("tiny", tmp_path / "tiny.gguf")
    found = {}
    for layout, flags in (("a stream per slot", [*PROFILE.args, "-no-kvu"]), ("fleet's", profile_args(PROFILE))):
        log = tmp_path / f"{len(found)}.log"
        with run_llama_server(llama_server, model, *flags, "-v", timeout_s=120, log=log) as url:
            asyncio.run(overlapping_calls(url))
        found[layout] = steps_and_joins(log.read_text())
    assert any(a in KV_LAYOUT for a in profile_args(PROFILE))
    for layout, (steps, _) in found.items():
        assert steps >= SECOND_TOKENS, (layout, found)  # the two calls shared the short one's every step
    assert found["a stream per slot"][1] == 0, found  # slots 0 and 2: never in one pass
    assert found["fleet's"][1] == found["fleet's"][0], found  # every shared step: one pass
