"""What a vLLM deployment leaves each sequence on a card, from headers alone: the weights from the
safetensors headers, the KV cache per token from config.json, and vLLM's own three settings.

vLLM takes `--gpu-memory-utilization` of the card's memory, puts the weights there, keeps room for its
activations and CUDA graphs (the profile's runtime, measured), and gives the rest to the KV cache in blocks of
16 tokens. A sequence holds every token it has in a full-attention layer and at most the window in a windowed
one. vLLM refuses to start when one sequence of `--max-model-len` does not fit the cache; when
`--max-num-seqs` sequences are all active, each gets its share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet.engines.vllm import BLOCK_TOKENS
from fleet.plan.hfconfig import AttentionLayout


@dataclass(frozen=True)
class VllmSettings:
    max_model_len: int
    max_num_seqs: int
    gpu_memory_utilization: float = 0.9
    kv_bytes: int | None = None  # per element; None: the weights' dtype (vLLM's --kv-cache-dtype auto)

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.max_num_seqs < 1:
            raise ValueError("--max-model-len and --max-num-seqs take 1 or more")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization takes a share of the card above 0, at most 1")
        if self.kv_bytes is not None and self.kv_bytes not in (1, 2, 4):
            raise ValueError("a KV cache element is 1, 2 or 4 bytes")


@dataclass(frozen=True)
class VllmPlan:
    model: str
    weights_bytes: int
    layout: AttentionLayout
    settings: VllmSettings
    runtime_bytes: int  # activations, CUDA graphs, the CUDA context

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // BLOCK_TOKENS) * BLOCK_TOKENS

    @property
    def sequence_bytes(self) -> int:
        """The cache of one sequence at --max-model-len."""
        return self.layout.sequence_bytes(self._blocks(self.settings.max_model_len), self.settings.kv_bytes)

    def card_bytes_needed(self) -> int:
        """The smallest card on which --max-num-seqs sequences all hold --max-model-len tokens."""
        held = self.weights_bytes + self.runtime_bytes + self.settings.max_num_seqs * self.sequence_bytes
        return -(-held * 1000 // int(self.settings.gpu_memory_utilization * 1000))

    def cache_bytes(self, card_bytes: int) -> int:
        """What vLLM gives its KV cache on a card of `card_bytes` (negative: the weights do not fit)."""
        budget = int(card_bytes * self.settings.gpu_memory_utilization)
        return budget - self.weights_bytes - self.runtime_bytes

    def full_length_sequences(self, card_bytes: int) -> int:
        """How many sequences can hold --max-model-len tokens at once."""
        cache = self.cache_bytes(card_bytes)
        return max(cache, 0) // self.sequence_bytes if self.sequence_bytes else 0

    def tokens_per_sequence(self, card_bytes: int) -> int:
        """The tokens each of --max-num-seqs active sequences can hold, in whole blocks (at most
        --max-model-len)."""
        share = max(self.cache_bytes(card_bytes), 0) // self.settings.max_num_seqs
        full = self.layout.full_bytes_per_token(self.settings.kv_bytes)
        windowed = self.layout.windowed_bytes_per_token(self.settings.kv_bytes)
        window = self.layout.window
        if window and share >= window * (full + windowed):
            tokens = window + (share - window * (full + windowed)) // full if full else self.settings.max_model_len
        else:
            tokens = share // (full + windowed) if full + windowed else self.settings.max_model_len
        return min(tokens - tokens % BLOCK_TOKENS, self.settings.max_model_len)

    def problem(self, card_bytes: int) -> str | None:
        """Why vLLM would not start with these settings on this card, in one line; None when it would."""
        cache = self.cache_bytes(card_bytes)
        if cache <= 0:
            return (
                f"{self.model}: weights and runtime ({(self.weights_bytes + self.runtime_bytes) / 2**30:.1f} GiB) "
                f"exceed --gpu-memory-utilization {self.settings.gpu_memory_utilization} of the card"
            )
        if cache < self.sequence_bytes:
            return (
                f"{self.model}: one sequence of --max-model-len {self.settings.max_model_len} needs "
                f"{self.sequence_bytes / 2**30:.2f} GiB of cache and the card leaves {cache / 2**30:.2f} GiB"
            )
        return None

    def as_dict(self, card_bytes: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "engine": "vllm",
            "weights_bytes": self.weights_bytes,
            "runtime_bytes": self.runtime_bytes,
            "kv_bytes_per_token_full": self.layout.full_bytes_per_token(self.settings.kv_bytes),
            "kv_bytes_per_token_windowed": self.layout.windowed_bytes_per_token(self.settings.kv_bytes),
            "window": self.layout.window,
            "sequence_bytes": self.sequence_bytes,
            "card_bytes": card_bytes,
            "cache_bytes": self.cache_bytes(card_bytes),
            "full_length_sequences": self.full_length_sequences(card_bytes),
            "tokens_per_sequence": self.tokens_per_sequence(card_bytes),
            "settings": vars(self.settings),
            "problem": self.problem(card_bytes),
        }
