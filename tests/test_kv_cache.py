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

TOKENS = 64
PROFILE = Profile(
    name="three",
    gpu_ram_gb=0,
    disk_gb=10,
    slots=3,
    ctx_per_slot=1024,
    files=[{"key": "main", "repo": "fleet-local/tiny-models", "file": "tiny.gguf"}],
    args=["-c", "3072", "-np", "3", "-t", "1"],
)


async def two_calls(url: str, slots: tuple[int, int]) -> None:
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(slot: int) -> None:
            body = {"prompt": f"call {slot}: hello", "n_predict": TOKENS, "id_slot": slot, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            reply = await client.post(f"{url}/completion", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["timings"]["predicted_n"] == TOKENS

        await asyncio.gather(*(one(s) for s in slots))


def one_pass_steps(log_text: str) -> int:
    """The server's count of steps that reused the previous step's graph: a step of both calls in one pass
    reuses it; passes alternating between two streams never do."""
    found = re.findall(r"graphs reused =\s+(\d+)", log_text)
    assert found, log_text[-2000:]
    return int(found[-1])


def test_two_calls_on_slots_apart_decode_in_one_pass_with_fleets_flags_and_in_two_without(llama_server, tmp_path):
    model = tinymodels.generate("tiny", tmp_path / "tiny.gguf")
    steps = {}
    for layout, flags in (("a stream per slot", [*PROFILE.args, "-no-kvu"]), ("fleet's", profile_args(PROFILE))):
        log = tmp_path / f"{len(steps)}.log"
        with run_llama_server(llama_server, model, *flags, timeout_s=120, log=log) as url:
            asyncio.run(two_calls(url, (0, 2)))
        steps[layout] = one_pass_steps(log.read_text())
    assert any(a in KV_LAYOUT for a in profile_args(PROFILE))
    # the two calls overlap for all but the few steps one of them starts or ends alone
    assert steps["fleet's"] >= TOKENS * 3 // 4, steps
    assert steps["a stream per slot"] <= TOKENS // 4, steps
