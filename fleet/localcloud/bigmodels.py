"""Random-weight GGUF models of a real model's shape, large enough to load a real card, written in seconds.

Every quantized weight is one block of valid Q8_0 rows (random normal values, properly quantized) tiled to
the tensor's length. The block's length is not a multiple of any row, so neighbouring rows differ, and decode
reads every byte of every weight as it would on the real model: a memory-bound decode rate is the real one.
The vocabulary and chat template are the tiny models' (a byte-level SPM vocabulary, ChatML), so the output
and embedding matrices are small; the transformer blocks carry the weight.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import gguf
import numpy as np

from fleet.localcloud import tinymodels

Q8_0 = gguf.GGMLQuantizationType.Q8_0
BLOCKS_PER_TILE = 30841  # a prime count of 34-byte blocks, ~1 MiB: no row length divides it
WRITE_TILES = 64  # tiles per write call


@dataclass(frozen=True)
class DenseShape:
    """A llama-architecture decoder's shape (llama.cpp loads Mistral and Llama models as `llama`)."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx_train: int
    rope_theta: float

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, ggml shape) of every block weight, in file order."""
        q, kv = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        out = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            out += [
                (p + "attn_q.weight", (self.n_embd, q)),
                (p + "attn_k.weight", (self.n_embd, kv)),
                (p + "attn_v.weight", (self.n_embd, kv)),
                (p + "attn_output.weight", (q, self.n_embd)),
                (p + "ffn_gate.weight", (self.n_embd, self.n_ff)),
                (p + "ffn_up.weight", (self.n_embd, self.n_ff)),
                (p + "ffn_down.weight", (self.n_ff, self.n_embd)),
            ]
        return out

    def quantized_bytes(self) -> int:
        """Bytes of the Q8_0 block weights: what one decoded token reads, beside the small embeddings."""
        block, size = gguf.GGML_QUANT_SIZES[Q8_0]
        return sum(shape[0] * shape[1] // block * size for _, shape in self.tensors())


# Mistral NeMo 12B's decoder (its published config: 40 layers, hidden 5120, 32 query heads of 128, 8 KV heads,
# FFN 14336, rope theta 1e6), in Q8_0: 11.6 GB of weights.
NEMO_12B = DenseShape("nemo-12b-shape", 40, 5120, 32, 8, 128, 14336, 131072, 1_000_000.0)
SHAPES = {s.name: s for s in (NEMO_12B,)}


def _tile(rng: np.random.Generator) -> bytes:
    block, _ = gguf.GGML_QUANT_SIZES[Q8_0]
    values = rng.normal(0.0, 0.02, (BLOCKS_PER_TILE, block)).astype(np.float32)
    return gguf.quants.quantize(values, Q8_0).tobytes()


def write_tiled(f: BinaryIO, tile: bytes, nbytes: int) -> None:
    """`nbytes` of `tile` repeated, written in large calls."""
    chunk = tile * WRITE_TILES
    while nbytes >= len(chunk):
        f.write(chunk)
        nbytes -= len(chunk)
    while nbytes >= len(tile):
        f.write(tile)
        nbytes -= len(tile)
    f.write(tile[:nbytes])


def write_dense(shape: DenseShape, path: Path, seed: int = 1234) -> Path:
    """Write `shape` with tiled random Q8_0 weights to `path` (atomically); the same seed gives the same bytes."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(shape.name)
    n_vocab = tinymodels.add_vocab(writer, tinymodels.CHATML_TEMPLATE)
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)

    small: dict[str, np.ndarray] = {
        "token_embd.weight": rng.normal(0.0, 0.5, (n_vocab, shape.n_embd)).astype(np.float32),
        "output_norm.weight": np.ones(shape.n_embd, dtype=np.float32),
        "output.weight": tinymodels.output_matrix(rng, n_vocab, shape.n_embd),
    }
    for i in range(shape.n_layer):
        small[f"blk.{i}.attn_norm.weight"] = np.ones(shape.n_embd, dtype=np.float32)
        small[f"blk.{i}.ffn_norm.weight"] = np.ones(shape.n_embd, dtype=np.float32)
    order: list[tuple[str, np.ndarray | int]] = []
    block, size = gguf.GGML_QUANT_SIZES[Q8_0]
    for name, array in small.items():
        writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes)
        order.append((name, array))
    for name, ggml_shape in shape.tensors():
        nbytes = ggml_shape[0] * ggml_shape[1] // block * size
        writer.add_tensor_info(name, tuple(reversed(ggml_shape)), np.dtype(np.float32), nbytes, raw_dtype=Q8_0)
        order.append((name, nbytes))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    alignment = writer.data_alignment
    writer.close()

    tile = _tile(rng)
    with tmp.open("r+b") as f:
        f.seek(0, os.SEEK_END)
        f.write(bytes(-f.tell() % alignment))
        for _, data in order:
            if isinstance(data, int):
                write_tiled(f, tile, data)
                n = data
            else:
                f.write(data.tobytes())
                n = data.nbytes
            f.write(bytes(-n % alignment))
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write a random-weight GGUF model of a real model's shape")
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    if not args.path.exists():
        write_dense(shape, args.path)
    print(args.path)


if __name__ == "__main__":
    main()
