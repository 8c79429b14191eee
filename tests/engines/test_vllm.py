"""vLLM hosts on the local cloud, for real: vLLM's CPU build (scripts/setup-vllm) serving the tiny Hugging Face
repository the local hub holds. One host, brought up by `fleet up` through the path every host takes (create,
SSH, the snapshot pulled and checked, start over TLS, probes), then each probe, the bench and the gateway on
it. A vLLM server takes most of a minute to start on two cores: the module starts one."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fleet.app import Fleet
from fleet.control import gateway
from fleet.control.up import UpRequest
from fleet.core.apikeys import cache_salt_key
from fleet.core.config import Serve
from fleet.core.models import HostState, as_utc
from fleet.economics import report
from fleet.engines import CACHE_SALT_HEADER, registry, vllm
from fleet.engines.metrics import requests_in_flight
from fleet.host.endpoints import publish
from fleet.localcloud import tinyhf, toolchain
from fleet.localcloud.tinymodels import REWRITING_TEMPLATE
from fleet.probes.cache import run_cache
from fleet.probes.call import load_call
from tests.fleetkit import fleet_for, settings_for
from tests.gateway.test_gateway import free_port

CHAT = "/v1/chat/completions"
MODEL = "tiny-vllm"
CLINIC = "You are the front desk of a clinic. The patient on this call was born on 14 March 1961. " * 5


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def _cloud_env(module_cloud_env) -> None:
    assert toolchain.vllm_python_path() is not None, "vLLM is not installed: run scripts/setup-vllm"


@pytest.fixture(scope="module")
async def vllm_host(_cloud_env, module_dir: Path) -> AsyncIterator[str]:
    """One READY tiny-vllm host, destroyed at the end."""
    async with fleet_for(settings_for(module_dir, timeouts={"load": 240, "probes": 240})) as fleet:
        result = await fleet.up(UpRequest(model=MODEL, region="eu", count=1))
        assert [h.name for h in result.ready], result
        try:
            yield result.ready[0].name
        finally:
            await fleet.destroy(None)


@pytest.fixture
async def fleet(vllm_host, module_dir: Path) -> AsyncIterator[Fleet]:
    # the probes' deadline as the bring-up's: thermal's three samples beside its load took over 60 s on a busy
    # machine
    settings = settings_for(module_dir, timeouts={"load": 240, "probes": 240})
    async with fleet_for(settings) as opened:
        yield opened


def host_dir(cloud, fleet: Fleet) -> Path:
    host = fleet.record.hosts(states=(HostState.READY,))[0]
    return cloud.info.state_dir / "hosts" / str(host.instance_id)


async def test_up_serves_the_repository_it_pulled_and_checked_over_tls_with_the_hosts_key(cloud, fleet):
    host = fleet.record.hosts(states=(HostState.READY,))[0]
    assert host.model == MODEL and host.api_url and host.api_url.startswith("https://")
    # the repository's files on the host are the hub's, byte for byte, the weights among them
    [pulled] = (host_dir(cloud, fleet) / "root" / "models").glob(tinyhf.REPO.replace("/", "--") + "@*")
    expected = tinyhf.files()
    assert sorted(p.name for p in pulled.iterdir()) == sorted(expected)
    for name, data in expected.items():
        assert hashlib.sha256((pulled / name).read_bytes()).digest() == hashlib.sha256(data).digest(), name
    assert host.pulled_bytes == sum(len(d) for d in expected.values())
    passed = {r.name: r.passed for r in fleet.record.probe_runs(host.id)}
    assert passed == {"smoke": True, "cache": True, "keepalive": True}
    # the key is vLLM's by its environment alone: on no process's command line
    key = fleet.api_key(host)
    cmdlines = [p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline") if p.exists()]
    assert not [c for c in cmdlines if key.encode() in c]
    async with httpx.AsyncClient(base_url=host.api_url, verify=fleet.tls, timeout=60) as c:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert (await c.post(CHAT, json=body, headers={"Authorization": "Bearer not-the-key"})).status_code == 401
        assert (await c.post(CHAT, json=body)).status_code == 401
        answer = await c.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200 and answer.json()["model"] == MODEL
        metrics = (await c.get("/metrics", headers={"Authorization": f"Bearer {key}"})).text
        # vLLM's own check covers /v1 alone; fleet's guard asks the key on every other path but /health
        assert (await c.get("/health")).status_code == 200
        for path, sent in (("/tokenize", {"prompt": "hi"}), ("/invocations", body), ("/metrics", None)):
            refused = await c.request("GET" if sent is None else "POST", path, json=sent)
            assert refused.status_code == 401, (path, refused.status_code)
        tokenized = await c.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {key}"})
        assert tokenized.status_code == 200 and tokenized.json()["count"] == 2
    assert "vllm:num_requests_running" in metrics and requests_in_flight(metrics) == 0


@pytest.mark.parametrize("probe", ["smoke", "cache", "keepalive"])
async def test_each_probe_passes_on_a_real_vllm_server(fleet, probe):
    host = fleet.record.hosts(states=(HostState.READY,))[0]
    (result,) = await fleet.probe(host.name, only=[probe])
    assert result.name == probe and result.passed, result
    if probe == "cache":
        # vLLM's usage said how much of each warm turn came from its cache, in blocks of the profile's size
        assert result.metrics["block_tokens"] == 32
        assert all(n > 0 for n in result.metrics["cache_n"]), result.metrics


async def test_the_thermal_probe_loads_a_real_vllm_server_and_reads_its_rate(fleet):
    """Thermal's mechanics on vLLM: the load reaches the server, each one-caller rate is read from replies that
    state no timings, and the verdict is the share's. Not whether this host sags: on vLLM's CPU build the
    one-caller rate swung from 10 to 350 tok/s between consecutive replies on a quiet machine, with the phase
    of the load's requests (CI once failed a healthy host at 0.24), so a share here measures the test bed's
    scheduler. A sagging host's failure is held on llama-server, which states its own rate (test_rotation)."""
    host = fleet.record.hosts(states=(HostState.READY,))[0]
    (result,) = await fleet.probe(host.name, only=["thermal"])
    assert result.name == "thermal", result
    load, rates = result.metrics["load"], result.metrics["decode_rates"]
    assert load["callers"] == fleet.settings.profile(MODEL).slots - 1 and load["failed"] == 0, load
    assert load["ok"] >= load["callers"], load
    assert len(rates) >= 3 and all(r > 0 for r in rates), rates
    share = result.metrics["decode_share"]
    assert result.passed == (share >= fleet.settings.probes.thermal_min_share), result
    assert [r.name for r in fleet.record.probe_runs(host.id)].count("thermal") == 1


async def test_the_cache_probe_on_vllm_fails_a_template_that_rewrites_history(fleet):
    host = fleet.record.hosts(states=(HostState.READY,))[0]
    profile = fleet.settings.profile(MODEL)
    call = load_call().with_system_chars(profile.probes.system_chars)
    result = await run_cache(
        fleet.server(host),
        call,
        3,
        8,
        0,
        24,
        engine=registry.ENGINES["vllm"],
        template_text=REWRITING_TEMPLATE,
        block_tokens=32,
    )
    assert not result.passed and "rewrites history" in result.diagnosis, result
    refused = await run_cache(
        fleet.server(host), call, 3, 8, 0, 24, engine=registry.ENGINES["vllm"], template_text=None
    )
    assert not refused.passed and "no chat template" in refused.diagnosis


async def test_bench_on_vllm_measures_capacity_and_cost_per_voice_minute(fleet):
    host = fleet.record.hosts(states=(HostState.READY,))[0]
    report = await fleet.bench(host.name, max_callers=2, waves=1, warmup=1, max_tokens=16)
    assert [lv.callers for lv in report.levels] == [1, 2]
    assert all(lv.errors == 0 for lv in report.levels)
    assert report.capacity.callers >= 1 and report.usd_per_voice_minute is not None
    assert report.usd_per_voice_minute > 0
    # its rates are the client's own (vLLM states none), and its warm turns came from the prefix cache
    assert report.levels[0].decode_per_caller_tok_s and report.levels[0].decode_per_caller_tok_s > 0
    assert report.levels[0].cache_reuse is not None and report.levels[0].cache_reuse > 0.5


async def test_the_gateway_serves_the_vllm_host(fleet, module_dir):
    settings = fleet.settings.model_copy(
        update={
            "serve": [Serve(model=MODEL, region="eu")],
            "gateway": fleet.settings.gateway.model_copy(
                update={"directory": str(module_dir / "gw"), "port": free_port(), "metrics_port": 0}
            ),
        }
    )
    async with fleet_for(settings) as gw:
        try:
            await gateway.start(gw)
            await publish(gw)
            key = await gateway.add_key(gw, "agent")
            base = f"https://localhost:{settings.gateway.port}"
            async with httpx.AsyncClient(
                base_url=base, verify=gw.tls, headers={"Authorization": f"Bearer {key}"}, timeout=60
            ) as c:
                models = await c.get("/v1/models")
                assert [m["id"] for m in models.json()["data"]] == [MODEL]
                for _ in range(100):  # the gateway's health check finds the host up
                    hosts = (await gateway.status(gw))["targets"][0]["hosts"]
                    if any(h["status"].startswith("UP") for h in hosts):
                        break
                    await __import__("asyncio").sleep(0.1)
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
                lines = []
                async with c.stream("POST", CHAT, json={**body, "stream": True}) as reply:
                    assert reply.status_code == 200
                    lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
                assert lines[-1] == "data: [DONE]" and len(lines) > 3
                served = {h["host"]: h["served"] for h in (await gateway.status(gw))["targets"][0]["hosts"]}
                assert sum(served.values()) >= 1
                # the prompt the agent sent is cached under its salt alone (the gateway's header, which
                # fleet_vllm_salt writes into the body): the agent's salt finds it, any other none of it
                clinic = {**body, "messages": [{"role": "user", "content": CLINIC}], "max_tokens": 2}
                assert (await c.post(CHAT, json=clinic)).status_code == 200
            agents = hmac.new(cache_salt_key(gw.key_secret), b"agent/agent", hashlib.sha256).hexdigest()
            host = gw.record.hosts(states=(HostState.READY,))[0]
            async with gw.server(host).client(timeout=120) as direct:

                async def cached(salt: str | None, **extra: object) -> int:
                    headers = {CACHE_SALT_HEADER: salt} if salt else {}
                    reply = await direct.post(CHAT, json={**clinic, **extra}, headers=headers)
                    assert reply.status_code == 200, reply.text
                    return (reply.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

                assert await cached("someone-else") == 0
                assert await cached(None, cache_salt=agents) == 0  # a body's salt is dropped: none is the client's
                assert await cached(agents) > 0
        finally:
            await gateway.stop(gw)


async def test_the_report_sets_both_engines_side_by_side(fleet):
    vllm_host = fleet.record.hosts(states=(HostState.READY,))[0]
    since = vllm_host.created_at
    if not fleet.record.latest_bench([vllm_host.id]):
        await fleet.bench(vllm_host.name, max_callers=1, waves=1, warmup=0, max_tokens=16)
    llama = (await fleet.up(UpRequest(model="tiny", region="eu", count=1))).ready[0]
    try:
        await fleet.bench(llama.name, max_callers=1, waves=1, warmup=0, max_tokens=16)
        session = fleet.session(as_utc(since))
        table = {row["host"]: row for row in report.rows(session)}
        assert (table[vllm_host.name]["engine"], table[llama.name]["engine"]) == ("vllm", "llama-server")
        assert all(table[name]["usd_per_voice_minute"] for name in (vllm_host.name, llama.name))
        assert f"| {vllm_host.name} | vllm |" in report.markdown(session)
        images = report.plots(session)
        assert len(images["What callers feel, by concurrent callers"]) > 10_000
    finally:
        await fleet.destroy([llama.name])


async def test_a_standby_vllm_host_keeps_its_repository_and_serves_again(vllm_host, module_dir):
    settings = settings_for(module_dir, timeouts={"load": 240, "probes": 240})
    async with fleet_for(settings) as fleet:
        [parked] = (await fleet.up(UpRequest(MODEL, "eu", standby=True))).ready
        try:
            assert parked.state == HostState.STANDBY
            result = await fleet.up(UpRequest(MODEL, "eu"))
            [host] = result.ready
            [attempt] = result.attempts
            # the same instance, started again: its repository checked on the disk it kept, not pulled again
            assert (host.name, host.instance_id, attempt.resumed) == (parked.name, parked.instance_id, True)
            assert host.state == HostState.READY and host.pulled_bytes == parked.pulled_bytes
            [probe] = await fleet.probe(host.name, only=["cache"])
            assert probe.passed, probe.diagnosis
        finally:
            await fleet.destroy([parked.name])


def test_a_vllm_profiles_argv_carries_no_key_and_its_block_size():
    profile = settings_for(Path(os.devnull).parent).profile(MODEL)
    argv = vllm.server_argv(profile, 18080, "models/x")
    assert "--api-key" not in argv and argv[argv.index("--served-model-name") + 1] == MODEL
    assert argv[argv.index("--max-num-seqs") + 1] == str(profile.slots)
    assert argv[argv.index("--max-model-len") + 1] == str(profile.ctx_per_slot)
    assert "--enable-prompt-tokens-details" in argv and vllm.block_tokens(profile) == 32


def test_the_vllm_host_takes_its_cache_salt_from_the_gateways_header():
    # the image's middleware cannot import fleet: its header's name is written there, and held equal here
    middleware = (Path(__file__).resolve().parents[2] / "images/vllm/host/fleet_vllm_salt.py").read_text()
    assert f'HEADER = b"{CACHE_SALT_HEADER}"' in middleware
    serve = (Path(__file__).resolve().parents[2] / "images/vllm/host/fleet-serve").read_text()
    assert "--middleware fleet_vllm_salt.CacheSaltFromHeader --middleware fleet_vllm_guard.KeyOnEveryPath" in serve
