"""A header replica of `nvidia/Gemma-4-26B-A4B-NVFP4`, the checkpoint our vLLM users serve: its config.json and
safetensors shards whose headers list the checkpoint's tensors and whose data is a sparse hole, so that
`fleet plan --model voice-agent` reads it from the local hub as it would from Hugging Face.

The text model's shape is the published configuration of Gemma 4 26B-A4B (`text_config`): 30 layers, five
of sliding attention (window 1024; 16 query heads, 8 KV heads of 256) to one of full attention (2 KV heads
of 512, K serving as V: `attention_k_eq_v`), hidden 2816, a dense MLP of 2112 beside 128 experts of 704 (8
used), a vocabulary of 262,144 tied to the output. The quantization follows NVIDIA ModelOpt's NVFP4 export:
each quantized linear layer is `weight` (two 4-bit values a byte, U8), `weight_scale` (one FP8 E4M3 scale per
16 values), `weight_scale_2` and `input_scale` (F32); embeddings, norms and the routers stay BF16. The
vision tower is left out (a voice agent sends no image): the real file is larger by it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

REPO = "nvidia/Gemma-4-26B-A4B-NVFP4"
LAYERS = 30
HIDDEN = 2816
HEADS = 16
KV_HEADS = 8
GLOBAL_KV_HEADS = 2
HEAD_DIM = 256
GLOBAL_HEAD_DIM = 512
WINDOW = 1024
DENSE_FF = 2112
EXPERTS = 128
EXPERTS_USED = 8
EXPERT_FF = 704
VOCAB = 262144
SHARD_BYTES = 5 << 30
DTYPE_BYTES = {"BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}


def layer_types() -> list[str]:
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(LAYERS)]


def config_json() -> dict:
    text = {
        "model_type": "gemma4_text",
        "hidden_size": HIDDEN,
        "intermediate_size": DENSE_FF,
        "moe_intermediate_size": EXPERT_FF,
        "num_experts": EXPERTS,
        "top_k_experts": EXPERTS_USED,
        "enable_moe_block": True,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_global_key_value_heads": GLOBAL_KV_HEADS,
        "head_dim": HEAD_DIM,
        "global_head_dim": GLOBAL_HEAD_DIM,
        "attention_k_eq_v": True,
        "sliding_window": WINDOW,
        "layer_types": layer_types(),
        "max_position_embeddings": 262144,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
        "final_logit_softcapping": 30.0,
        "dtype": "bfloat16",
    }
    quant = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head", "*router*"]}
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "quantization_config": quant,
        "dtype": "bfloat16",
    }


def _nvfp4(name: str, rows: int, cols: int) -> list[tuple[str, str, list[int]]]:
    return [
        (f"{name}.weight", "U8", [rows, cols // 2]),
        (f"{name}.weight_scale", "F8_E4M3", [rows, cols // 16]),
        (f"{name}.weight_scale_2", "F32", []),
        (f"{name}.input_scale", "F32", []),
    ]


def tensors() -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every tensor of the text model, in file order."""
    out: list[tuple[str, str, list[int]]] = [("model.language_model.embed_tokens.weight", "BF16", [VOCAB, HIDDEN])]
    for i, kind in enumerate(layer_types()):
        p = f"model.language_model.layers.{i}."
        full = kind == "full_attention"
        heads_kv, dim = (GLOBAL_KV_HEADS, GLOBAL_HEAD_DIM) if full else (KV_HEADS, HEAD_DIM)
        out += _nvfp4(p + "self_attn.q_proj", HEADS * dim, HIDDEN)
        out += _nvfp4(p + "self_attn.k_proj", heads_kv * dim, HIDDEN)
        if not full:  # a full layer's K serves as its V
            out += _nvfp4(p + "self_attn.v_proj", heads_kv * dim, HIDDEN)
        out += _nvfp4(p + "self_attn.o_proj", HIDDEN, HEADS * dim)
        out += [(p + "self_attn.q_norm.weight", "BF16", [dim]), (p + "self_attn.k_norm.weight", "BF16", [dim])]
        out += _nvfp4(p + "mlp.gate_proj", DENSE_FF, HIDDEN) + _nvfp4(p + "mlp.up_proj", DENSE_FF, HIDDEN)
        out += _nvfp4(p + "mlp.down_proj", HIDDEN, DENSE_FF)
        out.append((p + "router.proj.weight", "BF16", [EXPERTS, HIDDEN]))
        for e in range(EXPERTS):
            q = f"{p}experts.{e}."
            out += _nvfp4(q + "gate_proj", EXPERT_FF, HIDDEN) + _nvfp4(q + "up_proj", EXPERT_FF, HIDDEN)
            out += _nvfp4(q + "down_proj", HIDDEN, EXPERT_FF)
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm")
        out += [(f"{p}{n}.weight", "BF16", [HIDDEN]) for n in (*norms, "post_feedforward_layernorm")]
    out.append(("model.language_model.norm.weight", "BF16", [HIDDEN]))
    return out


def nbytes(dtype: str, shape: list[int]) -> int:
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= d
    return n


def shards() -> list[list[tuple[str, str, list[int]]]]:
    """The tensors split into files of at most SHARD_BYTES of data, in order."""
    out: list[list[tuple[str, str, list[int]]]] = [[]]
    size = 0
    for t in tensors():
        if size + nbytes(t[1], t[2]) > SHARD_BYTES and out[-1]:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes(t[1], t[2])
    return out


def _write_shard(path: Path, entries: list[tuple[str, str, list[int]]]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes(dtype, shape)]}
        offset += nbytes(dtype, shape)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    partial = path.with_suffix(".part")
    with partial.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)  # the data: a sparse hole
    os.replace(partial, path)


def ensure(directory: Path) -> dict[str, Path]:
    """The replica's files in `directory`, written once: file name -> path."""
    done = directory / ".complete"
    if done.exists():
        return {p.name: p for p in sorted(directory.iterdir()) if p.suffix in (".json", ".safetensors")}
    directory.mkdir(parents=True, exist_ok=True)
    parts = shards()
    names = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    paths = {}
    for name, entries in zip(names, parts, strict=True):
        path = directory / name
        if not path.exists():
            _write_shard(path, entries)
        paths[name] = path
    docs = {
        "config.json": config_json(),
        "model.safetensors.index.json": {
            "metadata": {"total_size": sum(nbytes(t[1], t[2]) for t in tensors())},
            "weight_map": {t[0]: name for name, entries in zip(names, parts, strict=True) for t in entries},
        },
    }
    for name, doc in docs.items():
        data = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
        path = directory / name
        path.write_bytes(data)
        paths[name] = path
    done.touch()
    return paths
