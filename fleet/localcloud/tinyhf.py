"""A tiny random-weight Llama in Hugging Face's format: the repository a vLLM host serves on this CPU.

Written with numpy alone, deterministically: the same bytes on every machine, so the hub's sha256 of each file
is the same everywhere. Two layers of 128, four query heads and two KV heads of 32, float32 weights in one
safetensors file; a byte-level BPE vocabulary with no merges (each byte one token, 256 of them, after three
special tokens) and the ChatML template the tiny GGUF models use. The output rows of the special tokens and of
the bytes outside printable ASCII are zero, so sampling mostly yields printable text.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from fleet.localcloud.tinymodels import CHATML_TEMPLATE

REPO = "fleet-local/tiny-llama-hf"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 256
CONTEXT = 4096
SEED = 20261202


def byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes (GPT-2's table), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def vocab_size() -> int:
    return len(SPECIAL) + 256


def tokenizer_json() -> dict:
    vocab = {token: i for i, token in enumerate(SPECIAL)}
    vocab.update({symbol: len(SPECIAL) + b for b, symbol in enumerate(byte_symbols())})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    added = [
        {"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, token in enumerate(SPECIAL)
    ]  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }  # fmt: skip


def config_json() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size(),
        "bos_token_id": None,
        "eos_token_id": SPECIAL.index("<|im_end|>"),
        "pad_token_id": SPECIAL.index("<|endoftext|>"),
        "torch_dtype": "float32",
    }


def tokenizer_config_json() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHATML_TEMPLATE,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": CONTEXT,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True}
            for i, t in enumerate(SPECIAL)
        },
    }  # fmt: skip


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0, 0.08, (rows, cols)).astype("<f4")

    v = vocab_size()
    out = {"model.embed_tokens.weight": mat(v, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = np.ones(HIDDEN, "<f4")
        out[p + "self_attn.q_proj.weight"] = mat(HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.k_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.v_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.o_proj.weight"] = mat(HIDDEN, HEADS * HEAD_DIM)
        out[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, "<f4")
        out[p + "mlp.gate_proj.weight"] = mat(INTERMEDIATE, HIDDEN)
        out[p + "mlp.up_proj.weight"] = mat(INTERMEDIATE, HIDDEN)
        out[p + "mlp.down_proj.weight"] = mat(HIDDEN, INTERMEDIATE)
    out["model.norm.weight"] = np.ones(HIDDEN, "<f4")
    head = rng.normal(0, 0.5, (v, HIDDEN)).astype("<f4")
    printable = [len(SPECIAL) + b for b in range(0x20, 0x7F)]
    mask = np.zeros(v, dtype=bool)
    mask[printable] = True
    head[~mask] = 0.0
    out["lm_head.weight"] = head
    return out


def safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    """The safetensors encoding of float32 tensors, in name order: an 8-byte length, the JSON header padded
    with spaces to 8 bytes, then the data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(tensors[name].tobytes() for name in sorted(tensors))


def files() -> dict[str, bytes]:
    """Every file of the repository, by name."""

    def as_json(doc: dict) -> bytes:
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()

    return {
        "config.json": as_json(config_json()),
        "generation_config.json": as_json({"eos_token_id": SPECIAL.index("<|im_end|>"), "do_sample": True}),
        "tokenizer.json": as_json(tokenizer_json()),
        "tokenizer_config.json": as_json(tokenizer_config_json()),
        "model.safetensors": safetensors_bytes(weights()),
    }


def ensure(directory: Path) -> dict[str, Path]:
    """The repository's files in `directory`, written once (a file already there with other bytes is
    rewritten)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, data in files().items():
        path = directory / name
        if not path.exists() or path.read_bytes() != data:
            partial = path.with_suffix(path.suffix + ".tmp")
            partial.write_bytes(data)
            partial.replace(path)
        written[name] = path
    return written
