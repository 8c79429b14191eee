"""The vLLM planner's inputs read strictly from what the hub serves (safetensors headers over HTTP ranges,
config.json), and its terms computed here by hand."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from fleet.localcloud import replicas_hf
from fleet.plan import gguf as ggufhead
from fleet.plan import hfconfig, safetensors
from fleet.plan.vllm import VllmPlan, VllmSettings
from tests.fleetkit import write_config
from tests.helpers import http_server

GIB = 1 << 30


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], int]], metadata=None) -> Path:
    """A safetensors file of the given (dtype, shape, nbytes) tensors; its data is a hole of the right length."""
    header, offset = {}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return path


SHARD = {
    "model.embed_tokens.weight": ("BF16", [1000, 64], 1000 * 64 * 2),
    "model.layers.0.mlp.down_proj.weight": ("U8", [64, 128], 64 * 128),  # NVFP4: two 4-bit weights a byte
    "model.layers.0.mlp.down_proj.weight_scale": ("F8_E4M3", [64, 16], 64 * 16),
    "model.layers.0.mlp.down_proj.weight_scale_2": ("F32", [], 4),
    "model.norm.weight": ("F4", [64], 32),
}


def test_a_shards_tensors_and_their_bytes_come_from_its_header(tmp_path):
    path = write_safetensors(tmp_path / "model.safetensors", SHARD, {"format": "pt"})
    header = safetensors.read_local(path)
    assert header.data_bytes == 1000 * 64 * 2 + 64 * 128 + 64 * 16 + 4 + 32
    assert header.bytes_by_dtype()["U8"] == 8192 and header.metadata == {"format": "pt"}
    assert header.tensors["model.layers.0.mlp.down_proj.weight_scale_2"].shape == ()
    assert header.bytes_fetched == header.header_bytes < 1024


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}, "unknown dtype"),
        ({"w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 6]}}, "6 bytes where F16 \\[4\\] holds 8"),
        ({"w": {"dtype": "F16", "shape": [-1], "data_offsets": [0, 2]}}, "non-negative integers"),
        ({"w": {"dtype": "F16", "shape": [True], "data_offsets": [0, 2]}}, "non-negative integers"),
        ({"w": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2], "extra": 1}}, "exactly dtype"),
        ({"w": {"dtype": "F16", "shape": [1000], "data_offsets": [0, 2000]}}, "end at byte 2000 of 100 bytes"),
        ({"w": {"dtype": "U8", "shape": [10**200, 10**200], "data_offsets": [0, 8]}}, "8 bytes where U8"),
        (
            {
                "a": {"dtype": "U8", "shape": [50], "data_offsets": [0, 50]},
                "b": {"dtype": "U8", "shape": [50], "data_offsets": [0, 50]},
            },
            "starts at 0, not where the last ended \\(50\\)",
        ),
        ({"a": {"dtype": "U8", "shape": [50], "data_offsets": [50, 100]}}, "starts at 50, not where the last ended"),
        ({"__metadata__": {"a": 1}}, "strings to strings"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_a_header_that_does_not_add_up_is_refused_in_one_line(tmp_path, header, message):
    text = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(100))
    with pytest.raises(safetensors.SafetensorsError, match=message):
        safetensors.read_local(path)


def test_a_length_beyond_the_formats_limit_or_not_json_is_refused(tmp_path):
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(safetensors.SafetensorsError, match="a header of 1000000000000 bytes"):
        safetensors.read_local(huge)
    html = tmp_path / "html.safetensors"
    html.write_bytes(struct.pack("<Q", 12) + b"<html></html")
    with pytest.raises(safetensors.SafetensorsError, match="not JSON"):
        safetensors.read_local(html)
    digits = b'{"w": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 1]}}'
    long_int = tmp_path / "digits.safetensors"
    long_int.write_bytes(struct.pack("<Q", len(digits)) + digits)
    with pytest.raises(safetensors.SafetensorsError, match="not JSON we read"):  # not a ValueError's traceback
        safetensors.read_local(long_int)


@pytest.fixture
async def files_server(tmp_path):
    """Real HTTP with ranges (aiohttp's file responses), counting the bytes each answer sent."""
    sent: dict[str, int] = {}
    write_safetensors(tmp_path / "model.safetensors", {"w": ("BF16", [4096, 4096], 4096 * 4096 * 2)})

    async def ranged(request: web.Request) -> web.StreamResponse:
        response = web.FileResponse(tmp_path / request.match_info["name"])
        asked = request.http_range  # a slice; an open end would be the whole rest of the file
        size = (tmp_path / request.match_info["name"]).stat().st_size
        length = (asked.stop if asked.stop is not None else size) - (asked.start or 0)
        sent[request.match_info["name"]] = sent.get(request.match_info["name"], 0) + length
        return response

    async def whole(request: web.Request) -> web.Response:
        return web.Response(body=(tmp_path / "model.safetensors").read_bytes()[:4096])

    async with http_server({"/ranged/{name}": ranged, "/whole": whole}) as base:
        yield base, sent


async def test_a_remote_header_is_read_with_two_ranges_and_a_server_ignoring_ranges_is_refused(files_server):
    base, sent = files_server
    header = await safetensors.read_url(f"{base}/ranged/model.safetensors")
    assert header.data_bytes == 4096 * 4096 * 2 and header.file_size == header.header_bytes + 4096 * 4096 * 2
    assert header.bytes_fetched == header.header_bytes
    assert sent["model.safetensors"] <= header.header_bytes  # the ranges asked for the header, no more
    with pytest.raises(safetensors.SafetensorsError, match="ignores HTTP ranges"):
        await safetensors.read_url(f"{base}/whole")


GEMMA_LIKE = {
    "architectures": ["Gemma4ForConditionalGeneration"],
    "torch_dtype": "bfloat16",
    "text_config": {
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 2,
        "sliding_window": 1024,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    },
}


def test_the_kv_cache_per_token_comes_from_config_json():
    layout = hfconfig.parse(json.dumps(GEMMA_LIKE).encode(), "config.json")
    assert (layout.full_layers, layout.windowed_layers, layout.window) == (1, 5, 1024)
    assert layout.full_bytes_per_token() == 1 * 2 * 2 * 512 * 2  # K and V, 2 global KV heads of 512, bf16
    assert layout.windowed_bytes_per_token() == 5 * 2 * 4 * 256 * 2
    assert layout.sequence_bytes(4000) == 4000 * 4096 + 1024 * 20480  # windowed layers hold the window only
    assert layout.sequence_bytes(100, kv_bytes=1) == 100 * 2048 + 100 * 10240  # an fp8 cache
    plain = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 128, "torch_dtype": "float32"}
    dense = hfconfig.parse(json.dumps(plain).encode(), "config.json")
    assert (dense.full_layers, dense.kv_heads, dense.head_dim, dense.window) == (2, 4, 32, 0)
    assert dense.full_bytes_per_token() == 2 * 2 * 4 * 32 * 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": 10**6}, "num_hidden_layers must be an integer from 1 to 1024"),
        ({"num_key_value_heads": "4"}, "num_key_value_heads must be an integer"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types must name 6 layers"),
        ({"sliding_window": None}, "sliding_window is unset"),
        ({"torch_dtype": "int4"}, "dtype 'int4'"),
    ],
)
def test_a_config_fleet_cannot_plan_from_is_refused_in_one_line(change, message):
    doc = {**GEMMA_LIKE, "text_config": {**GEMMA_LIKE["text_config"], **change}}
    with pytest.raises(hfconfig.ConfigJsonError, match=message):
        hfconfig.parse(json.dumps(doc).encode(), "config.json")
    with pytest.raises(hfconfig.ConfigJsonError, match="not JSON"):
        hfconfig.parse(b"\xff", "config.json")
    with pytest.raises(hfconfig.ConfigJsonError, match="not JSON"):
        hfconfig.parse(b'{"num_hidden_layers": ' + b"9" * 5000 + b"}", "config.json")


def test_which_layers_are_windowed_when_config_json_does_not_list_them():
    base = {"num_hidden_layers": 12, "num_attention_heads": 4, "head_dim": 64, "sliding_window": 512}
    pattern = hfconfig.parse(json.dumps({**base, "sliding_window_pattern": 6}).encode(), "c")
    assert (pattern.full_layers, pattern.windowed_layers, pattern.window) == (2, 10, 512)  # Gemma 3's older form
    off = hfconfig.parse(json.dumps({**base, "use_sliding_window": False}).encode(), "c")
    assert (off.full_layers, off.windowed_layers) == (12, 0)  # Qwen 2.5 names a window it does not use
    unsaid = hfconfig.parse(json.dumps(base).encode(), "c")
    assert unsaid.windowed_layers == 0  # not said which: every layer planned whole, never under-planned


def test_what_vllms_settings_leave_each_sequence():
    layout = hfconfig.parse(json.dumps(GEMMA_LIKE).encode(), "config.json")
    full, windowed = 4096, 20480  # bytes per token: 1 full layer, 5 windowed (test above)
    settings = VllmSettings(max_model_len=32768, max_num_seqs=12, gpu_memory_utilization=0.5)
    p = VllmPlan("m", weights_bytes=2 * GIB, layout=layout, settings=settings, runtime_bytes=GIB // 2)
    card = 8 * GIB
    assert p.cache_bytes(card) == 1536 * 1024 * 1024  # 4 GiB budget - 2 GiB - 0.5 GiB
    assert p.sequence_bytes == 32768 * full + 1024 * windowed == 155189248
    assert p.full_length_sequences(card) == 10  # 1610612736 // 155189248
    # twelve active: 134217728 bytes each; the window's 1024 tokens take 25165824, the rest 4096 a token
    assert p.tokens_per_sequence(card) == 1024 + 26624 == 27648  # 26624 = (134217728 - 25165824) // 4096
    assert p.problem(card) is None
    # so little cache that a sequence cannot fill its window: every token costs both kinds of layer
    small = VllmPlan("m", 2 * GIB, layout, VllmSettings(32768, 4000, 0.5), GIB // 2)
    assert small.tokens_per_sequence(card) == 1610612736 // 4000 // (full + windowed) // 16 * 16 == 16
    assert "exceed --gpu-memory-utilization" in p.problem(4 * GIB)
    tight = VllmPlan("m", 2 * GIB, layout, VllmSettings(400_000, 1, 0.5), GIB // 2)
    assert "one sequence of --max-model-len 400000 needs" in tight.problem(card)
    for bad in ({"max_num_seqs": 0}, {"gpu_memory_utilization": 1.5}, {"kv_bytes": 3}):
        with pytest.raises(ValueError):
            VllmSettings(**{"max_model_len": 1024, "max_num_seqs": 4, **bad})


async def test_the_hubs_token_never_follows_a_redirect_to_another_host(tmp_path):
    """Both header readers: the hub (127.0.0.1) redirects to its CDN (localhost, another origin); the token goes
    to the hub alone, every range included."""
    from tests.plan.test_plan import Q, write_gguf

    write_safetensors(tmp_path / "m.safetensors", {"w": ("BF16", [64, 64], 64 * 64 * 2)})
    write_gguf(tmp_path / "m.gguf", "llama", {"block_count": 1}, [("token_embd.weight", (64, 64), Q.F16, 8192)])
    seen: dict[str, list[str]] = {"hub": [], "cdn": []}

    async def cdn(request: web.Request) -> web.StreamResponse:
        seen["cdn"].append(request.headers.get("Authorization", ""))
        return web.FileResponse(tmp_path / request.match_info["name"])

    async with http_server({"/cdn/{name}": cdn}) as cdn_base:
        cdn_base = cdn_base.replace("127.0.0.1", "localhost")

        async def hub(request: web.Request) -> web.StreamResponse:
            seen["hub"].append(request.headers.get("Authorization", ""))
            raise web.HTTPFound(f"{cdn_base}/cdn/{request.match_info['name']}")

        async with http_server({"/resolve/{name}": hub}) as hub_base:
            token = {"Authorization": "Bearer hf_not_for_the_cdn"}
            st = await safetensors.read_url(f"{hub_base}/resolve/m.safetensors", headers=token)
            gg = await ggufhead.read_url(f"{hub_base}/resolve/m.gguf", headers=token, cache=tmp_path / "kept")
    assert st.data_bytes == 8192 and gg.tensors
    assert seen["hub"] and set(seen["hub"]) == {"Bearer hf_not_for_the_cdn"}
    assert len(seen["cdn"]) >= 3 and set(seen["cdn"]) == {""}  # both readers' ranges reached the CDN, bare


def fleet_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLEET_CONFIG": str(write_config(tmp_path))}
    return subprocess.run(
        [sys.executable, "-m", "fleet.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_fleet_plan_reads_the_nvfp4_checkpoints_headers_for_the_deployment_our_users_ran(local_cloud_env, tmp_path):
    done = fleet_cli(tmp_path, "plan", "--model", "voice-agent", "--gpu-ram", "96", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    weights = sum(replicas_hf.nbytes(dtype, shape) for _, dtype, shape in replicas_hf.tensors())
    assert plan["weights_bytes"] == weights  # every shard's header, read by ranges
    # five full layers of 2 KV heads of 512 (K serving as V is not assumed: planned as K and V), twenty-five
    # windowed ones of 8 heads of 256, bf16
    assert plan["kv_bytes_per_token_full"] == 5 * 2 * 2 * 512 * 2
    assert plan["kv_bytes_per_token_windowed"] == 25 * 2 * 8 * 256 * 2 and plan["window"] == 1024
    # the sweep's 48 callers at 8k each: every one holds its whole length on the 96 GB card
    assert plan["settings"]["max_num_seqs"] == 48 and plan["tokens_per_sequence"] == 8192
    assert plan["full_length_sequences"] >= 48 and plan["problem"] is None
    small = fleet_cli(tmp_path, "plan", "--model", "voice-agent", "--gpu-ram", "16", "--json")
    assert small.returncode == 0 and "exceed --gpu-memory-utilization" in json.loads(small.stdout)["problem"]
    refused = fleet_cli(tmp_path, "plan", "--model", "voice-agent", "--swa-full", "--json")
    assert refused.returncode == 2 and json.loads(refused.stdout)["error"].startswith("--swa-full is llama-server's")
