"""The chat templates fleet ships, checked over the six turn shapes: here (Jinja2, what `fleet up` runs
before renting) and through a real llama-server's /apply-template (what the cache probe runs). Google's
Gemma 4 template breaks the prefix on four shapes (DOMAIN.md trap 2), the repaired one on none; the
live cache probe on the stock template fails where the repaired one passes."""

import asyncio
import json
import secrets

import httpx
import pytest

from fleet.localcloud import tinymodels
from fleet.localcloud.llamaproc import llama_server as run_llama_server
from fleet.probes import template as chat_template
from fleet.probes.cache import run_cache, server_renderer, server_token_count
from fleet.probes.call import load_call
from fleet.probes.renderings import TURN_SHAPES, check_renderings
from fleet.probes.server import Server

NO_THINKING = {"enable_thinking": False}
GEMMA_BREAKS = {"tool call", "text before call", "whitespace", "multi-call"}
EXPECTED = {
    "gemma-4.jinja": GEMMA_BREAKS,
    "gemma-4.repaired.jinja": set(),
    "nemotron-3-nano.jinja": {"whitespace"},  # it trims the model's reply
}
THOUGHT_GLUE = "<|channel>thought\n<channel|>"


def local(name: str):
    return asyncio.run(chat_template.check_text(chat_template.bundled(name), NO_THINKING))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_local_check_finds_each_templates_breaks(name):
    result = local(name)
    assert result.shapes == list(TURN_SHAPES) and len(TURN_SHAPES) == 6
    assert {b.shape for b in result.breaks} == EXPECTED[name]
    for b in result.breaks:
        assert b.before != b.after and b.at_token is None  # no tokenizer here: the character is named


def test_gemma_breaks_are_the_four_changes():
    stock = local("gemma-4.jinja")
    breaks = {b.shape: b for b in stock.breaks}
    assert breaks["tool call"].before.endswith("{time_of_day")  # dictsort put `date` first
    assert breaks["tool call"].after.endswith('{date:<|"|>tu')
    assert breaks["text before call"].before.endswith("Let me check")  # the text went after the call
    assert breaks["whitespace"].before.endswith(" Okay, booke")  # trimmed
    # thinking off: every prompt ends with an empty thought block that history drops, on every shape;
    # reported apart from the breaks (it costs the model's last turn, every turn)
    assert {g.text for g in stock.glue} == {THOUGHT_GLUE} and len(stock.glue) == 6
    repaired = local("gemma-4.repaired.jinja")
    assert repaired.breaks == [] and repaired.glue == []


def test_the_repaired_template_changes_only_what_its_header_says():
    stock = chat_template.bundled("gemma-4.jinja")
    header, repaired = chat_template.bundled("gemma-4.repaired.jinja").split("-#}\n", 1)
    assert header.startswith("{#- fleet: Google's Gemma 4 chat template")
    assert len(repaired.splitlines()) == len(stock.splitlines()) + 2  # moved and edited; change 4 adds 2
    assert repaired.count("dictsort") == stock.count("dictsort") - 2  # tool arguments only
    assert "{%- if (enable_thinking is defined and enable_thinking)" in repaired
    assert "'<|tool_call>call:'" in repaired  # llama.cpp still recognises it as Gemma 4 (common/chat.cpp)
    assert "{#- OpenAI Chat Completions:" in repaired


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return tinymodels.ensure(tmp_path_factory.mktemp("models"))["tiny"]


def served(llama_server, model, template_path, *flags):
    flags = ["-np", "1", "-c", "8192", "-t", "1", "--jinja", "--chat-template-file", str(template_path), *flags]
    return run_llama_server(llama_server, model, *flags, "--chat-template-kwargs", json.dumps(NO_THINKING))


async def served_check(base: str):
    call = load_call()
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        return await check_renderings(
            server_renderer(client), server_token_count(client), call.system, call.user_turns[0], call.tools
        )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_llama_server_renders_each_template_as_the_local_check_does(llama_server, tiny_model, tmp_path, name):
    path = tmp_path / name
    path.write_text(chat_template.bundled(name))
    with served(llama_server, tiny_model, path) as base:
        result = asyncio.run(served_check(base))
    assert {b.shape for b in result.breaks} == EXPECTED[name]
    assert all(b.at_token is not None and b.at_token > 0 for b in result.breaks)  # the server names the token
    here = {b.shape: b for b in local(name).breaks}
    for b in result.breaks:
        assert (b.before, b.after) == (here[b.shape].before, here[b.shape].after)


@pytest.mark.parametrize(("name", "passes"), [("gemma-4.jinja", False), ("gemma-4.repaired.jinja", True)])
def test_the_cache_probe_on_the_stock_and_the_repaired_gemma_template(llama_server, tiny_model, tmp_path, name, passes):
    path = tmp_path / name
    path.write_text(chat_template.bundled(name))
    call = load_call().with_system_chars(500)
    key = secrets.token_urlsafe(16)
    (tmp_path / "key").write_text(key)
    with served(llama_server, tiny_model, path, "--api-key-file", str(tmp_path / "key")) as base:
        result = asyncio.run(run_cache(Server(base, key), call, 4, 24, 0, 24))
    assert result.passed is passes, result.diagnosis
    if passes:
        assert result.metrics["glue"] is None and result.metrics["prefix_breaks"] == []
        # every warm turn processed what was appended and nothing of the model's last turn
        assert all(n <= a + 1 for n, a in zip(result.metrics["prompt_n"], result.metrics["appended"], strict=True))
    else:
        assert result.metrics["glue"]["text"] == THOUGHT_GLUE
        assert "the template rewrites history (tool call, step 1: the prefix breaks at token" in result.diagnosis
