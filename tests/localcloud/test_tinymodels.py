"""The generated tiny models: deterministic bytes, served by the real llama-server, and the
sliding-window, recurrent and hybrid ones reproduce the cache loss of DOMAIN.md trap 2 / 5."""

import httpx
import pytest

from fleet.localcloud import tinymodels
from fleet.localcloud.llamaproc import llama_server as run_llama_server


def test_generation_is_deterministic(tmp_path):
    for name in tinymodels.MODELS:
        a = tinymodels.generate(name, tmp_path / f"{name}-a.gguf")
        b = tinymodels.generate(name, tmp_path / f"{name}-b.gguf")
        assert tinymodels.sha256_of(a) == tinymodels.sha256_of(b)
        assert a.read_bytes()[:4] == b"GGUF"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tinymodels.ensure(tmp_path_factory.mktemp("models"))


def rewritten_second_turn(base: str) -> dict:
    """Turn 1 generates 300 tokens; turn 2 keeps the prompt but replaces the reply, a rewrite ~300 tokens
    back: beyond what a 16-token window plus a 64-token micro-batch keeps."""
    system = "You are a test. " * 55
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Tell me a story."}]
    body = {"messages": messages, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    first = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
    assert first["timings"]["predicted_n"] == 300
    messages = [
        *messages,
        {"role": "assistant", "content": "A different reply."},
        {"role": "user", "content": "Again?"},
    ]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["timings"]


@pytest.mark.parametrize(
    ("name", "flags", "cache_lost"),
    [
        ("tiny", ["--ctx-checkpoints", "0"], False),
        ("tiny-swa", ["--ctx-checkpoints", "0"], True),
        ("tiny-swa", [], False),
        ("tiny-recurrent", ["--ctx-checkpoints", "0"], True),
        # the phonellm profile's trap (DOMAIN.md trap 5): its hybrid memory keeps its cache by checkpoints alone
        ("tiny-hybrid", ["--ctx-checkpoints", "0"], True),
        ("tiny-hybrid", [], False),
    ],
)
def test_cache_loss_reproduces_on_the_window_and_recurrent_models(llama_server, models, name, flags, cache_lost):
    flags = ["-np", "1", "-c", "4096", "-t", "1", "-ub", "64", *flags]
    with run_llama_server(llama_server, models[name], *flags) as base:
        timings = rewritten_second_turn(base)
    if cache_lost:
        assert timings["cache_n"] == 0, timings
    else:
        assert timings["cache_n"] > 100, timings
