"""Header replicas: GGUF files whose header carries the architecture metadata and tensor list of the
real a4b, phonellm, 12b and 31b files, and whose tensor data is a sparse hole.

`fleet plan` reads them over HTTP ranges from the local hub exactly as it would from Hugging Face,
with no download. Dimensions follow the facts in DOMAIN.md (layers, windowed and global layers with
their KV heads and head sizes, the window, experts, the Mamba2 state); where DOMAIN.md is silent
(hidden sizes, FFN widths) values were chosen so that parameter counts and file sizes land near the
real ones (25.2B / 14.25 GB for a4b, ~18 GB for PhoneLLM). The quant types mimic the public files:
rows not divisible by 256 fall back to a 32-block type, as the real PhoneLLM quants do.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from fleet.localcloud import bigmodels

Q = gguf.GGMLQuantizationType
REPLICA_FORMAT = 2  # bump when a replica's bytes change: the cache is keyed by it


@dataclass(frozen=True)
class Replica:
    repo: str
    filename: str
    build: Callable[[gguf.GGUFWriter], None]


def _tensor(w: gguf.GGUFWriter, name: str, ggml_shape: tuple[int, ...], qtype: Q) -> None:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if ggml_shape[0] % block:  # the real files fall back to a 32-block type for such rows
        qtype = Q.IQ4_NL if qtype in (Q.IQ4_XS, Q.Q4_K) else Q.Q8_0
        block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = 1
    for d in ggml_shape:
        n *= d
    w.add_tensor_info(name, tuple(reversed(ggml_shape)), np.dtype(np.float32), n // block * size, raw_dtype=qtype)


def _vocab(w: gguf.GGUFWriter, n_vocab: int) -> None:
    # The real vocabulary's size (the loader checks the embedding against it), with stand-in tokens: the
    # planner reads no tokenizer data, and llama.cpp's loader needs only the byte tokens to be there.
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"<t{i}>" for i in range(len(tokens), n_vocab)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (n_vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])


def _gemma4(
    n_layer: int,
    n_embd: int,
    n_head: int,
    swa_kv: int,
    global_kv: int,
    n_ff: int,
    n_expert: int = 0,
    expert_used: int = 0,
    n_ff_exp: int = 0,
    n_vocab: int = 262144,
    name: str = "",
) -> Callable:
    """A Gemma 4 text model with the tensors llama.cpp's gemma4 loader asks for (src/models/gemma4.cpp):
    q/k norms and post norms on every layer, one shared `rope_freqs` for the global layers, global layers
    whose V is their K (transformers' `attention_k_eq_v`: no attn_v), and for MoE models a dense FFN beside
    the routed experts with its own norms and the router's scale."""
    windowed = [(i + 1) % 6 != 0 for i in range(n_layer)]

    def build(w: gguf.GGUFWriter) -> None:
        w.add_name(name)
        w.add_context_length(131072)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv([swa_kv if s else global_kv for s in windowed])
        w.add_key_length(512)
        w.add_value_length(512)
        w.add_key_length_swa(256)
        w.add_value_length_swa(256)
        w.add_rope_dimension_count(512)
        w.add_uint32(f"{w.arch}.rope.dimension_count_swa", 256)
        w.add_sliding_window(1024)
        w.add_array(f"{w.arch}.attention.sliding_window_pattern", windowed)
        w.add_uint32(f"{w.arch}.embedding_length_per_layer_input", 0)  # per-layer inputs: E2B/E4B only
        w.add_layer_norm_rms_eps(1e-6)
        w.add_final_logit_softcapping(30.0)
        if n_expert:
            w.add_expert_count(n_expert)
            w.add_expert_used_count(expert_used)
            w.add_expert_feed_forward_length(n_ff_exp)
        _vocab(w, n_vocab)
        _tensor(w, "token_embd.weight", (n_embd, n_vocab), Q.Q6_K)
        _tensor(w, "rope_freqs.weight", (256,), Q.F32)
        for i, swa in enumerate(windowed):
            p, hd, kv = f"blk.{i}.", (256 if swa else 512), (swa_kv if swa else global_kv)
            _tensor(w, p + "attn_norm.weight", (n_embd,), Q.F32)
            _tensor(w, p + "attn_q.weight", (n_embd, n_head * hd), Q.Q6_K)
            _tensor(w, p + "attn_k.weight", (n_embd, kv * hd), Q.Q6_K)
            if swa:
                _tensor(w, p + "attn_v.weight", (n_embd, kv * hd), Q.Q6_K)
            _tensor(w, p + "attn_output.weight", (n_head * hd, n_embd), Q.Q6_K)
            _tensor(w, p + "attn_q_norm.weight", (hd,), Q.F32)
            _tensor(w, p + "attn_k_norm.weight", (hd,), Q.F32)
            _tensor(w, p + "post_attention_norm.weight", (n_embd,), Q.F32)
            _tensor(w, p + "layer_output_scale.weight", (1,), Q.F32)
            _tensor(w, p + "ffn_norm.weight", (n_embd,), Q.F32)
            _tensor(w, p + "ffn_gate.weight", (n_embd, n_ff), Q.Q4_K)
            _tensor(w, p + "ffn_up.weight", (n_embd, n_ff), Q.Q4_K)
            _tensor(w, p + "ffn_down.weight", (n_ff, n_embd), Q.Q6_K)
            _tensor(w, p + "post_ffw_norm.weight", (n_embd,), Q.F32)
            if n_expert:
                _tensor(w, p + "ffn_gate_inp.weight", (n_embd, n_expert), Q.F32)
                _tensor(w, p + "ffn_gate_inp.scale", (n_embd,), Q.F32)
                _tensor(w, p + "pre_ffw_norm_2.weight", (n_embd,), Q.F32)
                _tensor(w, p + "post_ffw_norm_1.weight", (n_embd,), Q.F32)
                _tensor(w, p + "post_ffw_norm_2.weight", (n_embd,), Q.F32)
                _tensor(w, p + "ffn_gate_up_exps.weight", (n_embd, 2 * n_ff_exp, n_expert), Q.IQ4_XS)
                _tensor(w, p + "ffn_down_exps.weight", (n_ff_exp, n_embd, n_expert), Q.IQ4_XS)
        _tensor(w, "output_norm.weight", (n_embd,), Q.F32)

    return build


def _gemma4_mtp(w: gguf.GGUFWriter) -> None:
    """The a4b MTP draft head, llama.cpp's `gemma4-assistant` (src/models/gemma4-assistant.cpp): windowed
    and global blocks with queries and no keys or values of their own, since they attend over the target's
    cache (llama.cpp shares the target's last windowed and last global layer with them); its own small
    embedding; ~250 MB in all. Layer count and widths are chosen (no source gives them)."""
    n_embd, n_head, n_ff, target_embd = 768, 16, 2048, 2816
    windowed = [True, True, True, False]
    w.add_name("gemma-4-26B-A4B-it MTP head")
    w.add_context_length(131072)
    w.add_embedding_length(n_embd)
    w.add_uint32(f"{w.arch}.embedding_length_out", target_embd)
    w.add_block_count(len(windowed))
    w.add_uint32(f"{w.arch}.nextn_predict_layers", len(windowed))
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv([8 if s else 2 for s in windowed])
    w.add_key_length(512)
    w.add_value_length(512)
    w.add_key_length_swa(256)
    w.add_value_length_swa(256)
    w.add_rope_dimension_count(512)
    w.add_uint32(f"{w.arch}.rope.dimension_count_swa", 256)
    w.add_sliding_window(1024)
    w.add_array(f"{w.arch}.attention.sliding_window_pattern", windowed)
    w.add_layer_norm_rms_eps(1e-6)
    _vocab(w, 262144)
    _tensor(w, "token_embd.weight", (n_embd, 262144), Q.Q6_K)
    _tensor(w, "output_norm.weight", (n_embd,), Q.F32)
    _tensor(w, "nextn.post_projection.weight", (n_embd, target_embd), Q.F16)
    _tensor(w, "nextn.pre_projection.weight", (2 * target_embd, n_embd), Q.F16)
    _tensor(w, "rope_freqs.weight", (256,), Q.F32)
    for i, swa in enumerate(windowed):
        p, hd = f"blk.{i}.", (256 if swa else 512)
        _tensor(w, p + "attn_norm.weight", (n_embd,), Q.F32)
        _tensor(w, p + "attn_q.weight", (n_embd, n_head * hd), Q.F16)
        _tensor(w, p + "attn_output.weight", (n_head * hd, n_embd), Q.F16)
        _tensor(w, p + "attn_q_norm.weight", (hd,), Q.F32)
        _tensor(w, p + "post_attention_norm.weight", (n_embd,), Q.F32)
        _tensor(w, p + "layer_output_scale.weight", (1,), Q.F32)
        _tensor(w, p + "ffn_norm.weight", (n_embd,), Q.F32)
        _tensor(w, p + "ffn_gate.weight", (n_embd, n_ff), Q.F16)
        _tensor(w, p + "ffn_up.weight", (n_embd, n_ff), Q.F16)
        _tensor(w, p + "ffn_down.weight", (n_ff, n_embd), Q.F16)
        _tensor(w, p + "post_ffw_norm.weight", (n_embd,), Q.F32)


def _nemotron_h(w: gguf.GGUFWriter) -> None:
    """PhoneLLM: Nemotron-3-Nano hybrid 30B-A3B, 52 layers = 23 Mamba2 + 23 MoE + 6 attention (2 KV heads)."""
    n_embd, n_head, n_kv, head_dim = 2688, 32, 2, 128
    n_expert, n_ff_exp, n_ff_shared, n_vocab = 128, 1856, 3712, 131072
    d_inner, d_state, n_group, d_conv, ssm_heads = 4096, 128, 8, 4, 64
    attention_at = {5, 13, 21, 29, 37, 45}
    kinds = []
    for i in range(52):
        if i in attention_at:
            kinds.append("A")
        else:
            kinds.append("M" if sum(k != "A" for k in kinds) % 2 == 0 else "E")
    assert kinds.count("M") == 23 and kinds.count("E") == 23 and kinds.count("A") == 6
    w.add_name("phonellm-alpha-1 (Nemotron-3-Nano 30B-A3B)")
    w.add_context_length(262144)
    w.add_embedding_length(n_embd)
    w.add_block_count(52)
    w.add_feed_forward_length([n_ff_exp if k == "E" else 0 for k in kinds])
    w.add_head_count(n_head)
    w.add_head_count_kv([n_kv if k == "A" else 0 for k in kinds])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_eps(1e-5)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_group_count(n_group)
    w.add_ssm_time_step_rank(ssm_heads)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(6)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_expert_shared_feed_forward_length(n_ff_shared)
    _vocab(w, n_vocab)
    _tensor(w, "token_embd.weight", (n_embd, n_vocab), Q.Q6_K)
    for i, kind in enumerate(kinds):
        p = f"blk.{i}."
        _tensor(w, p + "attn_norm.weight", (n_embd,), Q.F32)
        if kind == "M":
            _tensor(w, p + "ssm_in.weight", (n_embd, 2 * d_inner + 2 * n_group * d_state + ssm_heads), Q.IQ4_XS)
            _tensor(w, p + "ssm_conv1d.weight", (d_conv, d_inner + 2 * n_group * d_state), Q.F32)
            _tensor(w, p + "ssm_conv1d.bias", (d_inner + 2 * n_group * d_state,), Q.F32)
            _tensor(w, p + "ssm_dt.bias", (ssm_heads,), Q.F32)
            _tensor(w, p + "ssm_a", (1, ssm_heads), Q.F32)
            _tensor(w, p + "ssm_d", (1, ssm_heads), Q.F32)
            _tensor(w, p + "ssm_norm.weight", (d_inner // n_group, n_group), Q.F32)
            _tensor(w, p + "ssm_out.weight", (d_inner, n_embd), Q.IQ4_XS)
        elif kind == "E":
            _tensor(w, p + "ffn_gate_inp.weight", (n_embd, n_expert), Q.F32)
            _tensor(w, p + "exp_probs_b.bias", (n_expert,), Q.F32)
            _tensor(w, p + "ffn_up_exps.weight", (n_embd, n_ff_exp, n_expert), Q.IQ4_XS)
            _tensor(w, p + "ffn_down_exps.weight", (n_ff_exp, n_embd, n_expert), Q.IQ4_XS)
            _tensor(w, p + "ffn_up_shexp.weight", (n_embd, n_ff_shared), Q.IQ4_XS)
            _tensor(w, p + "ffn_down_shexp.weight", (n_ff_shared, n_embd), Q.IQ4_XS)
        else:
            _tensor(w, p + "attn_q.weight", (n_embd, n_head * head_dim), Q.Q6_K)
            _tensor(w, p + "attn_k.weight", (n_embd, n_kv * head_dim), Q.Q6_K)
            _tensor(w, p + "attn_v.weight", (n_embd, n_kv * head_dim), Q.Q6_K)
            _tensor(w, p + "attn_output.weight", (n_head * head_dim, n_embd), Q.Q6_K)
    _tensor(w, "output_norm.weight", (n_embd,), Q.F32)
    _tensor(w, "output.weight", (n_embd, n_vocab), Q.Q6_K)


REPLICAS = [
    Replica(
        "unsloth/gemma-4-26B-A4B-it-GGUF",
        "gemma-4-26B-A4B-it-qat-UD-Q4_K_XL.gguf",
        _gemma4(30, 2816, 16, 8, 2, 2112, 128, 8, 704, name="gemma-4-26B-A4B-it"),
    ),
    Replica("unsloth/gemma-4-26B-A4B-it-GGUF", "mtp-gemma-4-26B-A4B-it.gguf", _gemma4_mtp),
    Replica("mradermacher/phonellm-alpha-1-i1-GGUF", "phonellm-alpha-1.i1-IQ4_XS.gguf", _nemotron_h),
    Replica(
        "unsloth/gemma-4-12b-it-GGUF",
        "gemma-4-12b-it-UD-Q4_K_XL.gguf",
        _gemma4(48, 3840, 16, 8, 1, 15360, name="gemma-4-12b-it"),
    ),
    Replica(
        "unsloth/gemma-4-31B-it-GGUF",
        "gemma-4-31B-it-UD-Q4_K_XL.gguf",
        _gemma4(60, 5376, 32, 16, 4, 21504, name="gemma-4-31B-it"),
    ),
]
ARCH = {"_nemotron_h": "nemotron_h_moe", "_gemma4_mtp": "gemma4-assistant"}


def write(replica: Replica, path: Path, fill: bool = False) -> Path:
    """Write the header, then the tensor data: a hole of the full size (no disk blocks), or with `fill`
    one random block of bytes tiled over every tensor (a file a real card loads, as the GPU bench does)."""
    arch = ARCH.get(getattr(replica.build, "__name__", ""), "gemma4")
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch)
    replica.build(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    sizes = [info.nbytes for info in w.tensors[0].values()]
    alignment = w.data_alignment
    w.close()
    with tmp.open("r+b") as f:
        f.seek(0, os.SEEK_END)
        start = f.tell() + (-f.tell() % alignment)
        if fill:
            tile = np.random.default_rng(7).integers(0, 256, bigmodels.BLOCKS_PER_TILE * 34, dtype=np.uint8).tobytes()
            f.write(bytes(start - f.tell()))
            for n in sizes:
                bigmodels.write_tiled(f, tile, n)
                f.write(bytes(-n % alignment))
        else:
            f.truncate(start + sum(n + (-n % alignment) for n in sizes))
    tmp.replace(path)
    return path


def ensure(directory: Path) -> dict[tuple[str, str], Path]:
    """Every replica under directory/<repo>/<file>, written once."""
    paths = {}
    for replica in REPLICAS:
        path = directory / replica.repo / replica.filename
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write(replica, path)
        paths[(replica.repo, replica.filename)] = path
    return paths
