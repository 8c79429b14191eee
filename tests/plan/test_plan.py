"""The VRAM planner on generated GGUF headers whose sizes are computed here, independently, by hand."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from aiohttp import web

from fleet.control.up import UpRequest
from fleet.plan import gguf as ggufhead
from fleet.plan import memory as plan
from tests.fleetkit import fleet_for, settings_for, write_config
from tests.helpers import http_server

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[2]


def write_gguf(path: Path, arch: str, kv: dict, tensors: list[tuple[str, tuple[int, ...], Q, int]]) -> Path:
    """A header with the given metadata and tensors (ggml shapes, types, byte sizes); data is a hole."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        elif isinstance(value, bool):
            w.add_bool(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    data = 0
    for name, shape, qtype, nbytes in tensors:
        w.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), nbytes, raw_dtype=qtype)
        data += nbytes + (-nbytes % 32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with path.open("r+b") as f:
        f.seek(0, 2)
        end = f.tell()
        f.truncate(end + (-end % 32) + data)
    return path


def test_dense_model_weights_and_cache_for_each_cache_type(tmp_path):
    # llama-like: 4 layers, embd 512, 8 heads of 64, 2 KV heads; Q4_K matrices (144 bytes / 256), F32 norms
    tensors = [("token_embd.weight", (512, 1000), Q.Q8_0, 512 * 1000 // 32 * 34)]
    for i in range(4):
        tensors += [
            (f"blk.{i}.attn_q.weight", (512, 512), Q.Q4_K, 512 * 512 // 256 * 144),
            (f"blk.{i}.attn_k.weight", (512, 128), Q.Q4_K, 512 * 128 // 256 * 144),
            (f"blk.{i}.attn_v.weight", (512, 128), Q.Q4_K, 512 * 128 // 256 * 144),
            (f"blk.{i}.attn_output.weight", (512, 512), Q.Q4_K, 512 * 512 // 256 * 144),
            (f"blk.{i}.ffn_up.weight", (512, 1536), Q.Q4_K, 512 * 1536 // 256 * 144),
            (f"blk.{i}.attn_norm.weight", (512,), Q.F32, 512 * 4),
        ]
    path = write_gguf(
        tmp_path / "dense.gguf",
        "llama",
        {"block_count": 4, "embedding_length": 512, "attention.head_count": 8, "attention.head_count_kv": 2},
        tensors,
    )
    header = ggufhead.read_local(path)
    w = plan.weights(header)
    assert w.embeddings == 17000 * 32  # 512*1000/32*34
    assert w.attention == 4 * (2 * 512 * 512 + 2 * 512 * 128) // 256 * 144 + 4 * 512 * 4
    assert w.other == 4 * 512 * 1536 // 256 * 144 and w.experts == 0
    # per token and layer: K and V each 2 heads x 64; f16 2 bytes, q8_0 34/32, q4_0 18/32; ctx 1000 pads to 1024
    for cache_type, k_bytes in (("f16", 128 * 2), ("q8_0", 128 // 32 * 34), ("q4_0", 128 // 32 * 18)):
        cost = plan.slot_cost(header, plan.CacheSettings(1000, type_k=cache_type, type_v=cache_type))
        assert cost.kv_global == 4 * 1024 * 2 * k_bytes and cost.kv_windowed == 0 and cost.recurrent == 0
    mixed = plan.slot_cost(header, plan.CacheSettings(1024, type_k="q8_0", type_v="f16"))
    assert mixed.kv_global == 4 * 1024 * (136 + 256)
    with pytest.raises(ggufhead.GgufError, match="unknown cache type"):
        plan.slot_cost(header, plan.CacheSettings(1024, type_k="q3_x"))


def test_sliding_window_model_with_per_layer_kv_arrays(tmp_path):
    # gemma-like, 6 layers: 5 windowed (8 KV heads x 256), 1 global (2 KV heads x 512), window 1024
    pattern = [True, True, True, True, True, False]
    path = write_gguf(
        tmp_path / "swa.gguf",
        "gemma3",
        {
            "block_count": 6,
            "embedding_length": 1024,
            "attention.head_count": 8,
            "attention.head_count_kv": [8, 8, 8, 8, 8, 2],
            "attention.key_length": 512,
            "attention.value_length": 512,
            "attention.key_length_swa": 256,
            "attention.value_length_swa": 256,
            "attention.sliding_window": 1024,
            "attention.sliding_window_pattern": pattern,
        },
        [("token_embd.weight", (1024, 100), Q.F16, 1024 * 100 * 2)],
    )
    header = ggufhead.read_local(path)
    windowed_cell = 2 * 8 * 256 * 2  # K and V, f16
    global_cell = 2 * 2 * 512 * 2
    off = plan.slot_cost(header, plan.CacheSettings(32768, ubatch=512))
    assert off.kv_windowed == 5 * (1024 + 512) * windowed_cell
    assert off.kv_global == 32768 * global_cell
    assert off.layers == {"global": 1, "windowed": 5, "recurrent": 0}
    small_ub = plan.slot_cost(header, plan.CacheSettings(32768, ubatch=64))
    assert small_ub.kv_windowed == 5 * 1280 * windowed_cell  # 1024 + 64 padded to 256
    full = plan.slot_cost(header, plan.CacheSettings(32768, swa_full=True))
    assert full.kv_windowed == 5 * 32768 * windowed_cell
    short = plan.slot_cost(header, plan.CacheSettings(1000))
    assert short.kv_windowed == 5 * 1024 * windowed_cell  # never more than the context


def test_hybrid_recurrent_model_state_does_not_grow_with_context(tmp_path):
    # 4 layers: mamba2, attention (2 KV x 128), MoE, mamba2; d_inner 4096, state 128, 8 groups, conv 4
    path = write_gguf(
        tmp_path / "hybrid.gguf",
        "nemotron_h_moe",
        {
            "block_count": 4,
            "embedding_length": 2688,
            "attention.head_count": [0, 32, 0, 0],
            "attention.head_count_kv": [0, 2, 0, 0],
            "attention.key_length": 128,
            "attention.value_length": 128,
            "feed_forward_length": [0, 0, 1856, 0],
            "ssm.state_size": 128,
            "ssm.inner_size": 4096,
            "ssm.conv_kernel": 4,
            "ssm.group_count": 8,
        },
        [("blk.2.ffn_up_exps.weight", (2688, 1856, 4), Q.IQ4_NL, 2688 * 1856 * 4 // 32 * 18)],
    )
    header = ggufhead.read_local(path)
    state = 4 * ((4 - 1) * (4096 + 2 * 8 * 128) + 128 * 4096)  # conv + ssm, f32
    for ctx in (4096, 65536):
        cost = plan.slot_cost(header, plan.CacheSettings(ctx))
        assert cost.recurrent == 2 * state
        assert cost.kv_global == ctx * 2 * 2 * 128 * 2
        assert cost.layers == {"global": 1, "windowed": 0, "recurrent": 2}
    assert plan.weights(header).experts == 2688 * 1856 * 4 // 32 * 18


def test_plan_totals_and_slots_per_card(tmp_path):
    main = write_gguf(
        tmp_path / "m.gguf",
        "llama",
        {"block_count": 1, "embedding_length": 256, "attention.head_count": 2, "attention.head_count_kv": 2},
        [("token_embd.weight", (256, 4096), Q.F16, 256 * 4096 * 2)],
    )
    h = ggufhead.read_local(main)
    p = plan.make_plan("m", 4, plan.CacheSettings(4096, shared=False), h, None, plan.PlanSettings(100, 50))
    per_slot = 4096 * 2 * 256 * 2
    assert p.per_slot_bytes == per_slot and p.weights_bytes == 256 * 4096 * 2
    assert p.total_bytes() == p.weights_bytes + 4 * per_slot + 150
    assert p.max_slots(p.weights_bytes + 150 + 3 * per_slot + 1) == 3
    assert p.max_slots(p.weights_bytes) == 0
    # one cache for the slots: each slot beyond the first adds its cells' mask rows to the compute buffer
    shared = plan.make_plan("m", 4, plan.CacheSettings(4096, shared=True), h, None, plan.PlanSettings(100, 50))
    mask = 4096 * (2 * 512 + 64)
    assert shared.mask_per_slot_bytes == mask and shared.mask_bytes(1) == 0
    assert shared.total_bytes() == p.weights_bytes + 4 * per_slot + 3 * mask + 150
    assert shared.total_bytes(1) == p.total_bytes(1)  # one slot: nothing is shared
    assert shared.max_slots(p.weights_bytes + 150 + 3 * per_slot + 2 * mask) == 3
    assert shared.max_slots(p.weights_bytes + 150 + 3 * per_slot + 2 * mask - 1) == 2
    assert shared.max_slots(p.weights_bytes + 150 + 2 * per_slot + mask - 1) == 1  # two would not fit, one does
    draft = plan.make_plan("m", 4, plan.CacheSettings(4096, shared=True), h, h, plan.PlanSettings(100, 50))
    assert draft.mask_per_slot_bytes == 2 * mask  # the draft's context attends a shared cache too


def test_cache_settings_come_from_the_profile_flags():
    args = ["-c", "98304", "-np", "3", "--cache-type-k", "q8_0", "-ctv", "q4_0", "-ub", "2048", "--swa-full"]
    assert plan.cache_settings_from_args(args, 32768) == plan.CacheSettings(32768, 2048, True, "q8_0", "q4_0")
    assert plan.cache_settings_from_args([], 4096) == plan.CacheSettings(4096)
    assert not plan.cache_settings_from_args(["-np", "3"], 4096).shared  # a stream per slot: fleet's layout
    assert plan.cache_settings_from_args(["-np", "3", "-kvu"], 4096).shared  # the profile's own choice


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"PK\x03\x04 a zip file, not a model" * 10, "no GGUF magic"),
        (b"GGUF" + (9).to_bytes(4, "little") + bytes(16), "unsupported GGUF version 9"),
        (b"GGUF" + (3).to_bytes(4, "little") + (10**12).to_bytes(8, "little") + bytes(8), "implausible"),
    ],
)
def test_garbage_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ggufhead.GgufError, match=message):
        ggufhead.read_local(path)


def test_truncated_header_is_a_clear_error(tmp_path):
    good = write_gguf(tmp_path / "g.gguf", "llama", {"block_count": 1}, [("token_embd.weight", (256, 10), Q.F16, 5120)])
    header_end = ggufhead.read_local(good).header_bytes
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: header_end - 40])
    with pytest.raises(ggufhead.GgufError, match="truncated"):
        ggufhead.read_local(cut)


@pytest.fixture
async def odd_servers(tmp_path):
    """A server that ignores ranges (whole file, 200) and one that serves a non-GGUF file with ranges."""
    big = tmp_path / "big.gguf"
    with big.open("wb") as f:
        f.write(b"GGUF")
        f.truncate(1 << 30)
    sent = {"ignoring": 0}

    async def ignoring(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Length": str(1 << 30)})
        await response.prepare(request)
        chunk = bytes(1 << 16)
        try:
            for _ in range((1 << 30) // len(chunk)):
                await response.write(chunk)
                sent["ignoring"] += len(chunk)
        except (ConnectionError, RuntimeError):
            pass
        return response

    async def ranged_garbage(request: web.Request) -> web.Response:
        return web.Response(
            status=206, body=b"<html>not found</html>" * 10, headers={"Content-Range": "bytes 0-219/220"}
        )

    async with http_server({"/ignoring": ignoring, "/garbage": ranged_garbage}) as base:
        yield base, sent


async def test_a_server_ignoring_ranges_is_refused_without_a_download(odd_servers):
    base, sent = odd_servers
    with pytest.raises(ggufhead.GgufError, match="ignores HTTP ranges"):
        await ggufhead.read_url(f"{base}/ignoring")
    await asyncio.sleep(0.2)
    assert sent["ignoring"] < 16 << 20  # far from the 1 GiB a download would be
    with pytest.raises(ggufhead.GgufError, match="no GGUF magic"):
        await ggufhead.read_url(f"{base}/garbage")
    with pytest.raises(ggufhead.GgufError, match="ConnectError"):
        await ggufhead.read_url("http://127.0.0.1:9/none.gguf")


async def test_plan_reads_under_one_percent_of_the_replica_from_the_hub(cloud, local_cloud_env, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEET_CACHE_DIR", str(tmp_path / "cache"))  # no header kept from an earlier read
    async with cloud.client() as api:
        before = (await api.get("/admin/hub-stats")).json()["bytes_served"]
    async with fleet_for(settings_for(tmp_path)) as fleet:
        a4b = await fleet.plan("a4b")
        phonellm = await fleet.plan("phonellm")
    async with cloud.client() as api:
        after = (await api.get("/admin/hub-stats")).json()["bytes_served"]
    main = "unsloth/gemma-4-26B-A4B-it-GGUF/gemma-4-26B-A4B-it-qat-UD-Q4_K_XL.gguf"
    served = after.get(main, 0) - before.get(main, 0)
    assert 0 < served < 0.01 * 14e9
    assert a4b.bytes_fetched < 0.01 * a4b.file_bytes and a4b.file_bytes > 14e9
    # DOMAIN.md: a4b serves 3 slots of 32k on a 24 GB card; PhoneLLM 12 slots
    assert a4b.per_slot.layers == {"global": 5, "windowed": 25, "recurrent": 0}
    assert a4b.max_slots(24 * plan.GIB) >= 3 and a4b.total_bytes() < 24 * plan.GIB
    assert phonellm.per_slot.layers == {"global": 6, "windowed": 0, "recurrent": 23}
    assert phonellm.max_slots(24 * plan.GIB) >= 12
    assert phonellm.per_slot.recurrent == 23 * 4 * (3 * (4096 + 2 * 8 * 128) + 128 * 4096)


def run_fleet(env, *args):
    return subprocess.run(
        [sys.executable, "-m", "fleet.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_plan_cli_and_the_offer_filter(cloud, tmp_path):
    env = {
        **os.environ,
        "FLEET_CONFIG": str(write_config(tmp_path)),
        "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir),
        "FLEET_CACHE_DIR": str(tmp_path / "cache"),  # no header read before this test
    }
    result = run_fleet(env, "plan", "--model", "a4b")
    assert result.returncode == 0, result.stderr
    assert "reading gemma-4-26B-A4B-it-qat-UD-Q4_K_XL.gguf's GGUF header" in result.stderr  # progress, on stderr
    result = run_fleet(env, "plan", "--model", "a4b", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["bytes_fetched"] == 0  # the headers were kept on disk by each file's sha256
    assert {"weights_bytes", "per_slot_bytes", "total_bytes", "max_slots"} <= set(data)
    assert set(data["max_slots"]) == {"16", "24", "32", "48", "80", "96", "141"}
    wider = json.loads(
        run_fleet(
            env, "plan", "-m", "a4b", "--ctx", "65536", "--slots", "2", "--swa-full", "--gpu-ram", "20", "--json"
        ).stdout
    )
    assert wider["per_slot_bytes"] > 2 * data["per_slot_bytes"] and wider["slots"] == 2
    assert "20" in wider["max_slots"]
    bad = run_fleet(env, "plan", "--model", "a4b", "--ctx", "0")
    assert bad.returncode == 2 and "must be positive" in bad.stderr

    offers = json.loads(run_fleet(env, "offers", "--model", "a4b", "--region", "eu", "--json").stdout)
    removed = {r["filter"]: r["count"] for r in offers["funnel"]["removed"]}
    plan_filter = next(name for name in removed if name.startswith("GPU memory"))
    # the profile's 24 GB card is the larger: the funnel says so, and what the plan needs, in GiB
    assert removed[plan_filter] >= 1 and f"the plan needs {data['total_bytes'] / 2**30:.2f} GiB" in plan_filter
    assert all(o["gpu_name"] != "RTX A4000" for o in offers["offers"])
    tiny = json.loads(run_fleet(env, "offers", "--model", "tiny", "--region", "eu", "--json").stdout)
    assert any(o["gpu_name"] == "RTX A4000" for o in tiny["offers"])


async def test_up_uses_the_plan_filter(cloud, local_cloud_env, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        result = await fleet.up(UpRequest("a4b", "eu", dry_run=True))
    assert result.planned and all(o.gpu_ram_mb >= 20000 for o in result.planned)


async def test_a_reset_header_range_is_tried_again(cloud, local_cloud_env, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEET_CACHE_DIR", str(tmp_path / "cache"))  # read from the hub, not from the disk
    cloud.set_faults({"pull_reset": {"after_bytes": 1000, "count": 1}})
    try:
        async with fleet_for(settings_for(tmp_path)) as fleet:
            p = await fleet.plan("12b")
        assert p.per_slot.layers == {"global": 8, "windowed": 40, "recurrent": 0}
        async with cloud.client() as api:
            assert (await api.get("/admin/faults")).json()["pull_reset"]["count"] == 0
    finally:
        cloud.set_faults({})


def test_a_model_missing_from_the_hub_is_a_one_line_failure(cloud, tmp_path):
    ghost = (
        "\n[models.ghost]\ngpu_ram_gb = 0\ndisk_gb = 10\nslots = 1\nctx_per_slot = 2048\n"
        'files = [{ key = "main", repo = "nobody/nothing", file = "missing.gguf" }]\n'
    )
    env = {
        **os.environ,
        "FLEET_CONFIG": str(write_config(tmp_path, ghost)),
        "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir),
    }
    for args in (["plan", "--model", "ghost"], ["offers", "--model", "ghost", "--region", "eu"]):
        result = run_fleet(env, *args)
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: plan: ") and "HTTP 404" in lines[0]
    assert cloud.state()["instances"] == {}
