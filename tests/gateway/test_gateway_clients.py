"""The gateway as a voice team's clients see it (issue 36), with the OpenAI SDK itself (`openai`, in the dev lock)
on one real host of the local cloud: /v1/models and /v1/models/{id}, streaming through, and every refusal in
OpenAI's shape with a `code` the client can branch on (a bad key, a model not served, no host at all, a host
failing under a request), with Retry-After where a retry can succeed; a slot's served count starts again with
each host; and `fleet destroy --all --keep-gateway` leaves agents an answer they can act on."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.services.openai.llm import OpenAILLMService

from fleet.app import Fleet
from fleet.control import gateway
from fleet.control.up import UpRequest
from fleet.core.config import Serve
from fleet.gateway.files import files_for
from tests.fleetkit import fleet_for, settings_for
from tests.gateway.test_gateway import cli_env_for, free_port, logged_lines, served_by_host, wait_hosts_up
from tests.helpers import kill_llama_server


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-clients")


@pytest.fixture
async def gw(cloud, local_cloud_env, module_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    """One tiny host behind a gateway of this test's own."""
    base = settings_for(module_dir / request.node.name[:40])
    gateway_settings = {
        "directory": str(module_dir / request.node.name[:40] / "gw"),
        "port": free_port(),
        "metrics_port": 0,
    }
    settings = base.model_copy(
        update={
            "serve": [Serve(model="tiny", region="eu")],
            "gateway": base.gateway.model_copy(update=gateway_settings),
        }
    )
    async with fleet_for(settings) as fleet:
        try:
            assert len((await fleet.up(UpRequest("tiny", "eu"))).ready) == 1
            await gateway.start(fleet)
            yield fleet
        finally:
            await gateway.stop(fleet)
            await fleet.destroy(None)


def sdk(fleet: Fleet, key: str) -> openai.AsyncOpenAI:
    """The OpenAI SDK as an agent configures it for the gateway: its URL, its key, fleet's CA for this client
    alone (never the process's SSL_CERT_FILE), no silent retries."""
    port = fleet.settings.serve[0].port or fleet.settings.gateway.port
    return openai.AsyncOpenAI(
        base_url=f"https://localhost:{port}/v1",
        api_key=key,
        max_retries=0,
        timeout=30,
        http_client=openai.DefaultAsyncHttpx2Client(verify=fleet.tls),
    )


async def test_the_sdk_lists_retrieves_and_streams_and_is_refused_in_its_own_shape(gw):
    key = await gateway.add_key(gw, "sdk")
    await wait_hosts_up(gw, count=1)
    client = sdk(gw, key)
    try:
        assert [m.id for m in (await client.models.list()).data] == ["tiny"]
        assert (await client.models.retrieve("tiny")).id == "tiny"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("gpt-4o")
        assert missing.value.code == "model_not_found"
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
            stream=True,
            extra_headers={"X-Session-Id": "call-sdk-1"},
        )
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        assert "".join(pieces)
        with pytest.raises(openai.NotFoundError) as other:
            await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        assert other.value.code == "model_not_found" and "serves the model tiny" in str(other.value)
        with pytest.raises(openai.AuthenticationError) as bad:
            await sdk(gw, "fa-not-a-key").chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}]
            )
        assert bad.value.code == "invalid_api_key"
    finally:
        await client.close()


async def test_no_host_and_a_host_failing_under_a_request_are_answered_in_json_with_retry_after(gw):
    """The only host's server killed while the gateway serves it: whatever answers next, HAProxy's own error
    (before its check marks the host down) or admission (after), it is OpenAI's shape with Retry-After, never
    HTML; and once the host is gone, `no_host`, at once."""
    key = await gateway.add_key(gw, "agent")
    await wait_hosts_up(gw, count=1)
    [host] = gw.record.hosts()
    await kill_llama_server(host.ssh_host, host.ssh_port, gw.ssh_key.private)
    client = sdk(gw, key)
    seen = []
    try:
        for _ in range(40):
            try:
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
                seen.append("ok")
            except openai.APIStatusError as e:
                body = e.response.json()
                assert e.response.headers["content-type"] == "application/json", e.response.text[:200]
                assert "Retry-After" in e.response.headers and set(body["error"]) >= {"message", "type", "code"}
                seen.append(body["error"]["code"])
                if body["error"]["code"] == "no_host":
                    break
            await asyncio.sleep(0.1)
    finally:
        await client.close()
    assert seen[-1] == "no_host" and set(seen) <= {"host_failed", "no_host"}, seen


async def test_a_slots_served_count_starts_again_with_each_host_and_destroy_can_keep_the_gateway(gw, module_dir):
    key = await gateway.add_key(gw, "counter")
    await wait_hosts_up(gw, count=1)
    client = sdk(gw, key)
    hi = [{"role": "user", "content": "hi"}]
    try:
        for _ in range(3):
            await client.chat.completions.create(model="tiny", messages=hi, max_tokens=2)
        assert list((await served_by_host(gw)).values()) == [3]
        [first] = gw.record.hosts()
        await gw.destroy([first.name])
        [second] = (await gw.up(UpRequest("tiny", "eu"))).ready
        await wait_hosts_up(gw, count=1)
        await client.chat.completions.create(model="tiny", messages=hi, max_tokens=2)
        assert await served_by_host(gw) == {second.name: 1}  # the slot's, since this host took it
        env = cli_env_for(gw.settings, gw.settings.database.file.parent)  # this test's record
        kept = subprocess.run(
            [".venv/bin/fleet", "destroy", "--all", "--yes", "--keep-gateway", "--json"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert kept.returncode == 0, kept.stderr
        assert json.loads(kept.stdout)["gateway_stopped"] is None
        with pytest.raises(openai.APIStatusError) as none:
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert none.value.status_code == 503 and none.value.code == "no_host"
        alone = subprocess.run(
            [".venv/bin/fleet", "destroy", "somehost", "--keep-gateway"], env=env, capture_output=True, text=True
        )
        assert alone.returncode == 2 and "--keep-gateway goes with --all" in alone.stderr
    finally:
        await client.close()


class GatewayLLM(OpenAILLMService):
    """pipecat's OpenAI service as docs/gateway.md has a team write it for a gateway whose certificate is fleet's
    CA's: that CA for this client alone (pipecat's own client takes no `verify`), and no silent retries, so that a
    bot's failover runs at once."""

    def __init__(self, *, verify: ssl.SSLContext, **kwargs: Any) -> None:
        self._verify = verify
        super().__init__(**kwargs)

    def create_client(
        self, api_key=None, base_url=None, organization=None, project=None, default_headers=None, **kwargs
    ):
        return openai.AsyncOpenAI(
            api_key=api_key, base_url=base_url, default_headers=default_headers, max_retries=0, timeout=10,
            http_client=openai.DefaultAsyncHttpxClient(verify=self._verify),
        )  # fmt: skip


def logged(fleet: Fleet, agent: str) -> list[dict[str, str]]:
    lines = files_for(fleet.settings).access_log.read_text().splitlines()
    return [f for f in (dict(w.split("=", 1) for w in line.split()) for line in lines) if f.get("agent") == agent]


async def logged_at_least(fleet: Fleet, agent: str, count: int) -> list[dict[str, str]]:
    """The agent's access log lines, read, once there are `count`."""
    lines = await logged_lines(files_for(fleet.settings).access_log, count, agent=agent)
    return [dict(w.split("=", 1) for w in line.split()) for line in lines]


async def test_pipecat_talks_through_the_gateway_keeps_its_call_on_its_host_and_fails_over_at_once(gw):
    key = await gateway.add_key(gw, "pipecat")
    await wait_hosts_up(gw, count=1)
    port = gw.settings.serve[0].port or gw.settings.gateway.port
    llm = GatewayLLM(
        verify=gw.tls,
        api_key=key,
        base_url=f"https://localhost:{port}/v1",
        settings=OpenAILLMService.Settings(model="tiny", max_tokens=8, extra={"user": "call-pipecat-1"}),
    )
    context = LLMContext(messages=[{"role": "user", "content": "Hello"}])
    first = await llm.run_inference(context, system_instruction="You are a receptionist.")
    context.add_message({"role": "assistant", "content": first or ""})
    context.add_message({"role": "user", "content": "And on Friday?"})
    assert first and await llm.run_inference(context, system_instruction="You are a receptionist.")
    turns = await logged_at_least(gw, "pipecat", 2)
    assert [t["admit"] for t in turns] == ["new", "turn"] and turns[0]["call"] == turns[1]["call"]  # one call
    # the host goes: the bot's next turn fails at once (503, no_host), one request, no silent retry
    await gw.destroy([h.name for h in gw.record.open_hosts()])  # the gateway stays
    with pytest.raises(openai.APIStatusError) as failed:
        await llm.run_inference(context, system_instruction="You are a receptionist.")
    assert failed.value.status_code == 503 and failed.value.code == "no_host"
    for _ in range(100):  # HAProxy writes a request's line once its answer has gone
        if len(logged(gw, "pipecat")) == 3:
            break
        await asyncio.sleep(0.05)
    assert [t["status"] for t in logged(gw, "pipecat")] == ["200", "200", "503"]


def livekit_llm(fleet: Fleet, key: str, call: str) -> Any:
    """LiveKit Agents' OpenAI plugin as docs/gateway.md has a team configure it: an OpenAI client of its own with
    fleet's CA for it alone and no SDK retries, the call named by `user`."""
    from livekit.plugins import openai as livekit_openai

    port = fleet.settings.serve[0].port or fleet.settings.gateway.port
    client = openai.AsyncOpenAI(
        api_key=key, base_url=f"https://localhost:{port}/v1", max_retries=0, timeout=10,
        http_client=openai.DefaultAsyncHttpxClient(verify=fleet.tls),
    )  # fmt: skip
    return livekit_openai.LLM(model="tiny", client=client, user=call, max_completion_tokens=8)


async def livekit_turn(model: Any, context: Any) -> str:
    from livekit.agents import APIConnectOptions

    # LiveKit's own retries (3, 2 s apart, by default) stack on the SDK's: none, so a fallback runs at once
    async with model.chat(chat_ctx=context, conn_options=APIConnectOptions(max_retry=0, timeout=10)) as stream:
        return "".join([c.delta.content async for c in stream if c.delta is not None and c.delta.content])


async def test_livekit_agents_talk_through_the_gateway_keep_their_call_on_its_host_and_fail_over_at_once(gw):
    from livekit.agents import APIStatusError, llm

    key = await gateway.add_key(gw, "livekit")
    await wait_hosts_up(gw, count=1)
    model = livekit_llm(gw, key, "call-livekit-1")
    context = llm.ChatContext.empty()
    context.add_message(role="system", content="You are a receptionist.")
    context.add_message(role="user", content="Hello")
    first = await livekit_turn(model, context)
    context.add_message(role="assistant", content=first)
    context.add_message(role="user", content="And on Friday?")
    assert first and await livekit_turn(model, context)
    turns = await logged_at_least(gw, "livekit", 2)
    assert [t["admit"] for t in turns] == ["new", "turn"] and turns[0]["call"] == turns[1]["call"]  # one call
    # the host goes: the agent's next turn fails at once (503, no_host), one request, no retry of LiveKit's
    await gw.destroy([h.name for h in gw.record.open_hosts()])  # the gateway stays
    with pytest.raises(APIStatusError) as failed:
        await livekit_turn(model, context)
    assert failed.value.status_code == 503
    lines = await logged_at_least(gw, "livekit", 3)
    assert [t["status"] for t in lines] == ["200", "200", "503"]


def readme_snippet() -> str:
    """The README's agent snippet, as written (the first Python block)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return readme.split("```python\n", 1)[1].split("```", 1)[0]


async def test_the_readmes_snippet_runs_as_written_against_the_gateway(gw):
    key = await gateway.add_key(gw, "readme")
    await wait_hosts_up(gw, count=1)
    port = gw.settings.serve[0].port or gw.settings.gateway.port
    code = readme_snippet()
    # what a reader puts in: their CA file's path (status names it), their port, their key; nothing else changes
    for written, theirs in (
        ('"~/.local/state/fleet/tls/ca.pem"', repr((await gateway.status(gw))["ca_file"])),
        ("https://localhost:8443/v1", f"https://localhost:{port}/v1"),
        ('"fa-..."', repr(key)),
    ):
        assert code.count(written) == 1, f"the README's snippet no longer has {written}"
        code = code.replace(written, theirs)
    ran = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0 and ran.stdout.strip(), ran.stderr[-2000:]
    turns = await logged_at_least(gw, "readme", 1)
    assert [(t["status"], t["admit"]) for t in turns] == [("200", "new")]
