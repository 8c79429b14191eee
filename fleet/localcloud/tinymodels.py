"""Tiny random-weight GGUF models that the CPU llama-server serves in well under a second.

Generated deterministically with the `gguf` package: the same name always gives the same bytes
(and so the same sha256 the hub advertises). Three architectures, because the cache traps differ:
- `tiny`: llama, plain attention (the default test model);
- `tiny-swa`: gemma2 with a 16-token sliding window (SWA cache loss with --ctx-checkpoints 0);
- `tiny-recurrent`: mamba, a recurrent state (same trap, other cause);
- `tiny-hybrid`: nemotron_h, Mamba2 layers beside an attention layer and an MLP (the hybrid memory of the
  phonellm profile's Nemotron-H: a KV cache and a recurrent state per slot);
- `tiny-rewrite`: `tiny` with a chat template that trims the model's replies (the template trap).
All share a 356-token byte-level SPM vocabulary with a ChatML template. The output rows of the
control and byte tokens are zero, so sampling mostly yields printable ASCII.

`LARGE_VOCAB` is `tiny` with Gemma's vocabulary size (262,144 tokens, the output tied to the embedding as
Gemma's is), made on demand only (64 MiB): a server's per-token work over the whole vocabulary (the logits,
the sampler chain) weighs on it as on Gemma, while its layers cost next to nothing.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The cache trap of DOMAIN.md: a template that rewrites what the model said (here: trims the reply), so
# the next turn's prompt no longer starts with what the server has cached.
REWRITING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' + ((message['content'] or '') | trim) + '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CONTROL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
N_CTX_TRAIN = 4096
SWA_WINDOW = 16


@dataclass(frozen=True)
class TinyModel:
    name: str
    arch: str
    filename: str
    template: str = CHATML_TEMPLATE
    truncate_to: float | None = None  # keep this share of the file: a model llama-server cannot load
    n_vocab: int | None = None  # the byte-level vocabulary padded with words to this size, the output tied


GEMMA_VOCAB = 262144


MODELS: dict[str, TinyModel] = {
    "tiny": TinyModel("tiny", "llama", "tiny-llama-bytes.gguf"),
    "tiny-swa": TinyModel("tiny-swa", "gemma2", "tiny-gemma2-swa16.gguf"),
    "tiny-recurrent": TinyModel("tiny-recurrent", "mamba", "tiny-mamba.gguf"),
    "tiny-hybrid": TinyModel("tiny-hybrid", "nemotron_h", "tiny-nemotron-h-hybrid.gguf"),
    "tiny-rewrite": TinyModel("tiny-rewrite", "llama", "tiny-llama-rewriting-template.gguf", REWRITING_TEMPLATE),
    # its header promises tensors the file does not hold: llama-server dies loading it
    "tiny-truncated": TinyModel("tiny-truncated", "llama", "tiny-llama-truncated.gguf", truncate_to=0.6),
}
LARGE_VOCAB = TinyModel("tiny-gemma-vocab", "llama", "tiny-llama-gemma-vocab.gguf", n_vocab=GEMMA_VOCAB)


def _vocab(n_vocab: int | None = None) -> tuple[list[str], list[float], list[int]]:
    tokens = list(CONTROL_TOKENS)
    types = [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * (len(CONTROL_TOKENS) - 1)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    for code in range(0x20, 0x7F):
        tokens.append("\u2581" if code == 0x20 else chr(code))
        types.append(gguf.TokenType.NORMAL)
    if n_vocab is not None:
        words = n_vocab - len(tokens)
        tokens += [f"\u2581w{i}" for i in range(words)]
        types += [gguf.TokenType.NORMAL] * words
    scores = [0.0] * len(tokens)
    return tokens, scores, [int(t) for t in types]


def add_vocab(writer: gguf.GGUFWriter, template: str, n_vocab: int | None = None) -> int:
    tokens, scores, types = _vocab(n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(4)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)
    writer.add_chat_template(template)
    return len(tokens)


def output_matrix(rng: np.random.Generator, n_vocab: int, n_embd: int = N_EMBD) -> np.ndarray:
    """Random output rows, zero for the control and byte tokens: sampling yields printable ASCII."""
    out = rng.normal(0, 0.5, (n_vocab, n_embd)).astype(np.float32)
    out[: len(CONTROL_TOKENS) + 256] = 0.0
    return out


def _normal(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    return rng.normal(0, 0.1, (rows, cols)).astype(np.float32)


def _add_ssm_keys(writer: gguf.GGUFWriter, d_conv: int, d_inner: int, d_state: int, heads: int) -> None:
    """The state-space keys of a Mamba (heads: the time-step rank) or Mamba2 layer (heads: its heads)."""
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(heads)


def _write_llama(writer: gguf.GGUFWriter, rng: np.random.Generator, n_vocab: int, tied: bool = False) -> None:
    head_dim = N_EMBD // N_HEAD
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    if tied:  # no output.weight: llama.cpp reads the logits through the token embedding
        _attention_tensors(writer, rng, n_vocab, head_dim, post_norms=False, embd=output_matrix(rng, n_vocab))
        return
    _attention_tensors(writer, rng, n_vocab, head_dim, post_norms=False)
    writer.add_tensor("output.weight", output_matrix(rng, n_vocab))


def _write_gemma2(writer: gguf.GGUFWriter, rng: np.random.Generator, n_vocab: int) -> None:
    head_dim = N_EMBD // N_HEAD
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(SWA_WINDOW)
    writer.add_attn_logit_softcapping(50.0)
    writer.add_final_logit_softcapping(30.0)
    _attention_tensors(writer, rng, n_vocab, head_dim, post_norms=True, embd=output_matrix(rng, n_vocab))


def _attention_tensors(
    writer: gguf.GGUFWriter,
    rng: np.random.Generator,
    n_vocab: int,
    head_dim: int,
    post_norms: bool,
    embd: np.ndarray | None = None,
) -> None:
    def mat(rows: int, cols: int) -> np.ndarray:
        return _normal(rng, rows, cols)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    writer.add_tensor("token_embd.weight", embd if embd is not None else mat(n_vocab, N_EMBD))
    for i in range(N_LAYER):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones(N_EMBD))
        writer.add_tensor(p + "attn_q.weight", mat(N_HEAD * head_dim, N_EMBD))
        writer.add_tensor(p + "attn_k.weight", mat(N_HEAD_KV * head_dim, N_EMBD))
        writer.add_tensor(p + "attn_v.weight", mat(N_HEAD_KV * head_dim, N_EMBD))
        writer.add_tensor(p + "attn_output.weight", mat(N_EMBD, N_HEAD * head_dim))
        if post_norms:
            writer.add_tensor(p + "post_attention_norm.weight", ones(N_EMBD))
        writer.add_tensor(p + "ffn_norm.weight", ones(N_EMBD))
        writer.add_tensor(p + "ffn_gate.weight", mat(N_FF, N_EMBD))
        writer.add_tensor(p + "ffn_up.weight", mat(N_FF, N_EMBD))
        writer.add_tensor(p + "ffn_down.weight", mat(N_EMBD, N_FF))
        if post_norms:
            writer.add_tensor(p + "post_ffw_norm.weight", ones(N_EMBD))
    writer.add_tensor("output_norm.weight", ones(N_EMBD))


def _write_mamba(writer: gguf.GGUFWriter, rng: np.random.Generator, n_vocab: int) -> None:
    d_inner, d_state, d_conv, dt_rank = 2 * N_EMBD, 16, 4, 4
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_layer_norm_rms_eps(1e-5)
    _add_ssm_keys(writer, d_conv, d_inner, d_state, dt_rank)

    def mat(rows: int, cols: int) -> np.ndarray:
        return _normal(rng, rows, cols)

    writer.add_tensor("token_embd.weight", mat(n_vocab, N_EMBD))
    for i in range(N_LAYER):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(p + "ssm_in.weight", mat(2 * d_inner, N_EMBD))
        writer.add_tensor(p + "ssm_conv1d.weight", mat(d_inner, d_conv))
        writer.add_tensor(p + "ssm_conv1d.bias", np.zeros(d_inner, dtype=np.float32))
        writer.add_tensor(p + "ssm_x.weight", mat(dt_rank + 2 * d_state, d_inner))
        writer.add_tensor(p + "ssm_dt.weight", mat(d_inner, dt_rank))
        writer.add_tensor(p + "ssm_dt.bias", np.zeros(d_inner, dtype=np.float32))
        a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))
        writer.add_tensor(p + "ssm_a", a)
        writer.add_tensor(p + "ssm_d", np.ones(d_inner, dtype=np.float32))
        writer.add_tensor(p + "ssm_out.weight", mat(N_EMBD, d_inner))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("output.weight", output_matrix(rng, n_vocab))


# Nemotron-H's layer kinds, told apart as llama.cpp does: a Mamba2 layer has no KV heads and no FFN, an
# attention layer KV heads and no FFN, an MLP layer an FFN alone.
HYBRID_LAYERS = ("mamba2", "attention", "mlp", "mamba2")


def _write_nemotron_h(writer: gguf.GGUFWriter, rng: np.random.Generator, n_vocab: int) -> None:
    head_dim = N_EMBD // N_HEAD
    # d_state is Nemotron-H's own 128: a slot's recurrent state, which a context checkpoint holds, is then 144
    # KiB, above the mmap threshold tests/engines/test_prompt_cache_reuse.py sets, as a real hybrid's always is
    d_inner, d_state, d_conv, n_group, n_ssm_head = 2 * N_EMBD, 128, 4, 2, 8
    d_conv_dim = d_inner + 2 * n_group * d_state
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(len(HYBRID_LAYERS))
    writer.add_feed_forward_length([N_FF if kind == "mlp" else 0 for kind in HYBRID_LAYERS])
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv([N_HEAD_KV if kind == "attention" else 0 for kind in HYBRID_LAYERS])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_eps(1e-5)
    writer.add_layer_norm_rms_eps(1e-5)
    _add_ssm_keys(writer, d_conv, d_inner, d_state, n_ssm_head)
    writer.add_ssm_group_count(n_group)

    def mat(rows: int, cols: int) -> np.ndarray:
        return _normal(rng, rows, cols)

    writer.add_tensor("token_embd.weight", mat(n_vocab, N_EMBD))
    for i, kind in enumerate(HYBRID_LAYERS):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        if kind == "mamba2":
            writer.add_tensor(p + "ssm_in.weight", mat(2 * d_inner + 2 * n_group * d_state + n_ssm_head, N_EMBD))
            writer.add_tensor(p + "ssm_conv1d.weight", mat(d_conv_dim, d_conv))
            writer.add_tensor(p + "ssm_conv1d.bias", np.zeros(d_conv_dim, dtype=np.float32))
            writer.add_tensor(p + "ssm_dt.bias", np.zeros(n_ssm_head, dtype=np.float32))
            writer.add_tensor(p + "ssm_a", -np.arange(1, n_ssm_head + 1, dtype=np.float32).reshape(n_ssm_head, 1))
            writer.add_tensor(p + "ssm_d", np.ones((n_ssm_head, 1), dtype=np.float32))
            writer.add_tensor(p + "ssm_norm.weight", np.ones((n_group, d_inner // n_group), dtype=np.float32))
            writer.add_tensor(p + "ssm_out.weight", mat(N_EMBD, d_inner))
        elif kind == "attention":
            writer.add_tensor(p + "attn_q.weight", mat(N_HEAD * head_dim, N_EMBD))
            writer.add_tensor(p + "attn_k.weight", mat(N_HEAD_KV * head_dim, N_EMBD))
            writer.add_tensor(p + "attn_v.weight", mat(N_HEAD_KV * head_dim, N_EMBD))
            writer.add_tensor(p + "attn_output.weight", mat(N_EMBD, N_HEAD * head_dim))
        else:
            writer.add_tensor(p + "ffn_up.weight", mat(N_FF, N_EMBD))
            writer.add_tensor(p + "ffn_down.weight", mat(N_EMBD, N_FF))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("output.weight", output_matrix(rng, n_vocab))


_WRITERS = {"llama": _write_llama, "gemma2": _write_gemma2, "mamba": _write_mamba, "nemotron_h": _write_nemotron_h}


def generate(name: str | TinyModel, path: Path, seed: int = 1234) -> Path:
    """Write the tiny model `name` (or `LARGE_VOCAB`) to `path` (atomically); the same model gives the same
    bytes."""
    model = name if isinstance(name, TinyModel) else MODELS[name]
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), model.arch)
    writer.add_name(model.name)
    n_vocab = add_vocab(writer, model.template, model.n_vocab)
    if model.n_vocab is not None:
        _write_llama(writer, np.random.default_rng(seed), n_vocab, tied=True)
    else:
        _WRITERS[model.arch](writer, np.random.default_rng(seed), n_vocab)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if model.truncate_to is not None:
        os.truncate(tmp, int(tmp.stat().st_size * model.truncate_to))
    tmp.replace(path)
    return path


def ensure(directory: Path) -> dict[str, Path]:
    """Generate every tiny model into `directory` unless already there; name -> path."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, model in MODELS.items():
        path = directory / model.filename
        if not path.exists():
            generate(name, path)
        paths[name] = path
    return paths


def sha256_of(path: Path) -> str:
    """The file's sha256. Holes of a sparse file are hashed from a zero buffer, not read."""
    digest = hashlib.sha256()
    zeros = bytes(1 << 24)
    size = path.stat().st_size
    with path.open("rb") as f:
        fd = f.fileno()
        pos = 0
        while pos < size:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # no data after pos: the rest is a hole
                data = size
            while pos < data:  # a hole
                n = min(len(zeros), data - pos)
                digest.update(zeros[:n] if n < len(zeros) else zeros)
                pos += n
            if pos >= size:
                break
            hole = os.lseek(fd, pos, os.SEEK_HOLE)
            f.seek(pos)
            while pos < hole:
                block = f.read(min(1 << 20, hole - pos))
                digest.update(block)
                pos += len(block)
    return digest.hexdigest()
