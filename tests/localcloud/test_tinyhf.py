"""The tiny Hugging Face repository the local hub will serve to vLLM hosts: the same bytes every time, and
headers fleet's own planner reads."""

import json

from fleet.localcloud import tinyhf
from fleet.plan import hfconfig, safetensors


def test_the_repository_is_the_same_bytes_every_time_and_its_headers_plan(tmp_path):
    first = tinyhf.ensure(tmp_path / "a")
    second = tinyhf.ensure(tmp_path / "b")
    assert sorted(first) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                             "tokenizer_config.json"]  # fmt: skip
    assert all(first[name].read_bytes() == second[name].read_bytes() for name in first)
    header = safetensors.read_local(first["model.safetensors"])
    layout = hfconfig.parse(first["config.json"].read_bytes(), "config.json")
    per_layer = 9  # two norms, four attention projections, three MLP matrices
    assert len(header.tensors) == tinyhf.LAYERS * per_layer + 3  # embeddings, final norm, output
    assert header.bytes_by_dtype() == {"F32": header.data_bytes}
    assert header.tensors["model.layers.1.self_attn.k_proj.weight"].shape == (layout.kv_heads * layout.head_dim, 128)
    assert layout.full_bytes_per_token() == tinyhf.LAYERS * 2 * tinyhf.KV_HEADS * tinyhf.HEAD_DIM * 4
    assert (first["model.safetensors"].stat().st_size - header.header_bytes) == header.data_bytes
    assert header.header_bytes % 8 == 0  # the data starts aligned, as the format's writers align it


def test_every_byte_is_one_token_after_the_special_ones():
    vocab = tinyhf.tokenizer_json()["model"]["vocab"]
    assert len(vocab) == len(set(vocab.values())) == tinyhf.vocab_size() == 259
    symbols = tinyhf.byte_symbols()
    assert len(set(symbols)) == 256 and symbols[ord("a")] == "a" and symbols[ord(" ")] == "\u0120"
    assert [vocab[t] for t in tinyhf.SPECIAL] == [0, 1, 2]
    config = json.loads(tinyhf.files()["config.json"])
    assert config["vocab_size"] == 259 and config["eos_token_id"] == vocab["<|im_end|>"]
