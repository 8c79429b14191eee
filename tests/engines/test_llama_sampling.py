"""llama-server's sampling with fleet's patch 0004 (images/llama-server/patches): when the sampler chain's
first sampler to act is top-k (fleet's profiles: temperature, top-k, top-p, min-p, penalties off), the server
takes the top-k candidates straight from the logits instead of sorting the whole vocabulary. It must give
exactly the tokens and probabilities of the whole-vocabulary path, on a model with Gemma's 262,144-token
vocabulary and on the tiny one, at temperature 0 and at temperature 1 with a fixed seed (the same tokens for
the same seed is a stronger claim than the same distribution: the chain draws from the same candidates in the
same order), with a logit bias (`ignore_eos` biases the end-of-generation tokens), and with `n_probs`.

Both paths are in the patched binary: typical-p at 1.0 changes nothing, and put before top-k in a request's
`samplers` it makes the chain act on the whole vocabulary first, which is llama.cpp's path before 0004."""

import json
from pathlib import Path

import httpx
import pytest

from fleet.localcloud import tinymodels
from fleet.localcloud.llamaproc import llama_server as run_llama_server

TOP_K_FIRST = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
WHOLE_VOCAB = ["typ_p", "penalties", "dry", "top_n_sigma", "top_k", "top_p", "min_p", "xtc", "temperature"]
# fleet's profiles' sampling (a4b: temperature 1, top-k 64, top-p 0.95; phonellm: greedy, top-k 40), and more
SAMPLINGS = {
    "a4b": {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "min_p": 0.0},
    "phonellm": {"temperature": 0.0, "top_k": 40, "top_p": 1.0, "min_p": 0.0},
    "min-p": {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05},
    "k-128": {"temperature": 1.5, "top_k": 128, "top_p": 1.0, "min_p": 0.0},
}
PROMPTS = ("the caller asked about the delivery window", "order 4417 ships on", "hello")


@pytest.fixture(scope="module", params=["gemma-vocab", "tiny"])
def server(request, llama_server: Path, tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("sampling")
    model = tinymodels.LARGE_VOCAB if request.param == "gemma-vocab" else tinymodels.MODELS["tiny"]
    path = tinymodels.generate(model, tmp / model.filename)
    with run_llama_server(llama_server, path, "-np", "2", "-c", "2048", "-t", "1", timeout_s=120) as url:
        yield url


def complete(url: str, prompt: str, samplers: list[str], sampling: dict, **extra) -> dict:
    body = {"prompt": prompt, "n_predict": 24, "seed": 7, "samplers": samplers, "typ_p": 1.0,
            "repeat_penalty": 1.0, "cache_prompt": False, "n_probs": 5, **sampling, **extra}  # fmt: skip
    reply = httpx.post(f"{url}/completion", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    found = reply.json()
    return {"content": found["content"], "tokens": found.get("tokens"), "probs": found["completion_probabilities"]}


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_top_k_from_the_logits_gives_the_whole_vocabularys_tokens_and_probabilities(server, name):
    sampling = SAMPLINGS[name]
    for prompt in PROMPTS:
        fast = complete(server, prompt, TOP_K_FIRST, sampling, return_tokens=True)
        whole = complete(server, prompt, WHOLE_VOCAB, sampling, return_tokens=True)
        assert len(fast["tokens"]) > 0
        assert json.dumps(fast) == json.dumps(whole), (name, prompt)
    # the seed decides the draw: another seed gives another reply at temperature above 0 (the test would pass
    # on a server that ignored the sampler's randomness altogether otherwise)
    if sampling["temperature"] > 0:
        other = complete(server, PROMPTS[0], TOP_K_FIRST, sampling, seed=8, n_predict=24)
        assert other["content"] != complete(server, PROMPTS[0], TOP_K_FIRST, sampling)["content"]


def test_a_logit_bias_reaches_the_candidates_top_k_takes_from_the_logits(server):
    # ignore_eos biases the end-of-generation tokens to -inf; a large bias on one token makes it every reply's
    # token: the fast path must take biased tokens into its candidates, whatever their raw logits
    sampling = SAMPLINGS["a4b"]
    for prompt in PROMPTS:
        fast = complete(server, prompt, TOP_K_FIRST, sampling, ignore_eos=True)
        whole = complete(server, prompt, WHOLE_VOCAB, sampling, ignore_eos=True)
        assert json.dumps(fast) == json.dumps(whole), prompt
    token = httpx.post(f"{server}/tokenize", json={"content": "Q"}, timeout=30).json()["tokens"][-1]
    forced = complete(server, PROMPTS[0], TOP_K_FIRST, sampling, logit_bias=[[token, 100.0]], return_tokens=True)
    assert set(forced["tokens"]) == {token}
    whole = complete(server, PROMPTS[0], WHOLE_VOCAB, sampling, logit_bias=[[token, 100.0]], return_tokens=True)
    assert json.dumps(forced) == json.dumps(whole)


# Several sequences sampled in one step each take their own top-k from their own row of logits (patch 0004). One
# request with several prompts makes their tasks start in the same step, so the batches are the same on both paths
# and each prompt's tokens must be too. With a draft model (the same model, so that drafts are often accepted and
# sometimes not), a step samples several outputs of each sequence, and those a rejected draft leaves unsampled must
# not reach the next step.
MANY = [f"caller {k}: the order ships on" for k in range(8)]


@pytest.fixture(scope="module", params=["alone", "draft"])
def busy_server(request, llama_server: Path, tmp_path_factory) -> str:
    path = tinymodels.generate(tinymodels.LARGE_VOCAB, tmp_path_factory.mktemp("busy") / "gemma-vocab.gguf")
    draft = ["-md", str(path), "--spec-draft-n-max", "3"] if request.param == "draft" else []
    with run_llama_server(llama_server, path, "-np", "8", "-c", "4096", "-t", "4", *draft, timeout_s=120) as url:
        yield url


def complete_many(url: str, samplers: list[str], sampling: dict) -> list[list[int]]:
    body = {"prompt": MANY, "n_predict": 24, "seed": 7, "samplers": samplers, "typ_p": 1.0, "repeat_penalty": 1.0,
            "cache_prompt": False, "return_tokens": True, **sampling}  # fmt: skip
    reply = httpx.post(f"{url}/completion", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return [r["tokens"] for r in sorted(reply.json(), key=lambda r: r["index"])]


@pytest.mark.parametrize("name", ["a4b", "phonellm"])
def test_sequences_sampled_in_one_step_get_the_whole_vocabularys_tokens(busy_server, name):
    fast = complete_many(busy_server, TOP_K_FIRST, SAMPLINGS[name])
    whole = complete_many(busy_server, WHOLE_VOCAB, SAMPLINGS[name])
    assert len(fast) == len(MANY) and all(len(tokens) == 24 for tokens in fast)
    assert fast == whole
    if SAMPLINGS[name]["temperature"] > 0:
        # the prompts differ, and so do their draws: a server that gave every sequence one sequence's candidates
        # would give them all the same tokens (greedy, the tiny model's random weights give every prompt one reply)
        assert len({tuple(tokens) for tokens in fast}) > 1
