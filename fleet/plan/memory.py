"""The GPU memory a profile needs, from its GGUF headers alone (DOMAIN.md "KV-cache rules").

- weights: every tensor at its type's block size (the gguf package's table), split by kind, but the input
  embedding of a model with its own output matrix, which stays in host memory;
- per slot: the KV cache of each attention layer (its own KV heads and head sizes; a windowed layer
  keeps only the window plus one micro-batch of cells unless --swa-full), at the cache type's size,
  plus the fixed recurrent state (f32) of each recurrent layer, whatever the context;
- the draft model's own weights and cache (none for a draft that reads the target's, as Gemma 4's MTP
  head does), a runtime overhead and a headroom from fleet.toml;
- with one KV cache shared by the slots (a profile's `-kvu`; fleet runs a stream per slot), each slot beyond
  the first also grows the compute buffer: the attention mask spans the whole cache, a micro-batch's row of
  f16 for every cell, in each context that attends it (the target's, and a draft's).
Pure functions over parsed headers; reading the headers is ggufhead.py's job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from fleet.engines.llama_server import SHARED_CACHE
from fleet.plan.gguf import GgufError, GgufHeader, gguf_package

GIB = 1024**3
MIB = 1024**2
CELL_PAD = 256
CARD_SIZES_GB = (16, 24, 32, 48, 80, 96, 141)
CACHE_TYPES = {
    "f32": "F32",
    "f16": "F16",
    "bf16": "BF16",
    "q8_0": "Q8_0",
    "q4_0": "Q4_0",
    "q4_1": "Q4_1",
    "q5_0": "Q5_0",
    "q5_1": "Q5_1",
    "iq4_nl": "IQ4_NL",
}
# Architectures whose windowed layers follow a period (llama.cpp's set_swa_pattern) when the file
# has no per-layer pattern: every `period`-th layer is global.
SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "gemma4": 6, "cohere2": 4}
# Draft architectures that keep no KV cache of their own: llama.cpp points each of their layers at one of
# the target's (llama-model.cpp create_memory: a gemma4-assistant layer shares the target's last windowed
# or last global layer). Their per-slot cost is nothing beyond the target's.
SHARES_TARGET_CACHE = {"gemma4-assistant"}
# Compute buffer bytes a cell of a shared cache adds per context that attends it: the f16 mask's row of the
# micro-batch (2 bytes a token) and 64 bytes more a cell, which covers what five contexts measured on an H200
# beyond the mask (bench/gpu/results/2026-12-02-plan.md: 2.006-2.125 bytes per cell and micro-batch token).
MASK_BYTES_PER_CELL_TOKEN = 2
MASK_BYTES_PER_CELL = 64


@dataclass(frozen=True)
class CacheSettings:
    ctx_per_slot: int
    ubatch: int = 512
    swa_full: bool = False
    type_k: str = "f16"
    type_v: str = "f16"
    # one KV cache for all slots, when the profile asks for it (fleet/engines/llama_server.py cache_args)
    shared: bool = False


@dataclass
class Weights:
    """Bytes of weights on the card, by kind; `host`: the input token embedding, which llama.cpp keeps in
    host memory whatever -ngl says (it is only indexed, one row per token), when the model has its own
    output matrix. A tied model's output is that same matrix, copied to the card: there it counts."""

    experts: int = 0
    attention: int = 0
    embeddings: int = 0
    other: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        return self.experts + self.attention + self.embeddings + self.other


@dataclass
class SlotCost:
    kv_global: int = 0
    kv_windowed: int = 0
    recurrent: int = 0
    layers: dict[str, int] = field(default_factory=dict)  # global / windowed / recurrent layer counts

    @property
    def total(self) -> int:
        return self.kv_global + self.kv_windowed + self.recurrent


def _pad(n: int, to: int = CELL_PAD) -> int:
    return -(-n // to) * to


def _cache_bytes(elements: int, type_name: str) -> int:
    try:
        package = gguf_package()
        block, size = package.GGML_QUANT_SIZES[package.GGMLQuantizationType[CACHE_TYPES[type_name]]]
    except KeyError:
        raise GgufError(f"unknown cache type {type_name!r} (have: {', '.join(CACHE_TYPES)})") from None
    if elements % block:
        raise GgufError(f"a KV row of {elements} elements does not fit {type_name}'s block of {block}")
    return elements // block * size


def weights(header: GgufHeader) -> Weights:
    w = Weights()
    untied = any(t.name == "output.weight" for t in header.tensors)
    for t in header.tensors:
        name = t.name
        if name == "token_embd.weight" and untied:
            w.host += t.nbytes
        elif "_exps" in name or "_shexp" in name or ".ffn_gate_inp" in name:
            w.experts += t.nbytes
        elif ".attn_" in name:
            w.attention += t.nbytes
        elif name.startswith(("token_embd", "output.", "per_layer_token_embd")) or name == "output":
            w.embeddings += t.nbytes
        else:
            w.other += t.nbytes
    return w


def _per_layer(value: Any, n_layer: int, name: str) -> list[int]:
    if value is None:
        return [0] * n_layer
    if isinstance(value, list):
        if len(value) != n_layer:
            raise GgufError(f"{name}: {len(value)} values for {n_layer} layers")
        return [int(v) for v in value]
    return [int(value)] * n_layer


def windowed_layers(header: GgufHeader, n_layer: int) -> list[bool]:
    if not header.key("attention.sliding_window"):
        return [False] * n_layer
    pattern = header.key("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise GgufError(f"sliding_window_pattern: {len(pattern)} values for {n_layer} layers")
        return [bool(p) for p in pattern]
    period = int(pattern) if pattern else SWA_PERIOD.get(header.arch, 0)
    if period <= 0:
        return [True] * n_layer  # a window on every layer (mistral-style)
    return [(i + 1) % period != 0 for i in range(n_layer)]


def slot_cost(header: GgufHeader, cache: CacheSettings) -> SlotCost:
    """What one slot of `cache.ctx_per_slot` tokens costs in GPU memory for this model."""
    n_layer = int(header.key("block_count") or 0)
    if n_layer <= 0:
        raise GgufError(f"{header.source}: no {header.arch}.block_count in the header")
    n_embd = int(header.key("embedding_length") or 0)
    heads = _per_layer(header.key("attention.head_count", 0), n_layer, "attention.head_count")
    kv_heads = _per_layer(
        header.key("attention.head_count_kv", header.key("attention.head_count", 0)), n_layer, "attention.head_count_kv"
    )
    ff = header.key("feed_forward_length")
    ff_layers = _per_layer(ff, n_layer, "feed_forward_length") if isinstance(ff, list) else None
    default_dim = n_embd // max(max(heads), 1) if n_embd else 0
    k_len = int(header.key("attention.key_length") or default_dim)
    v_len = int(header.key("attention.value_length") or k_len)
    k_len_swa = int(header.key("attention.key_length_swa") or k_len)
    v_len_swa = int(header.key("attention.value_length_swa") or v_len)
    windowed = windowed_layers(header, n_layer)
    window = int(header.key("attention.sliding_window") or 0)
    d_state = int(header.key("ssm.state_size") or 0)

    cells = _pad(cache.ctx_per_slot)
    cells_windowed = cells if cache.swa_full else min(cells, _pad(window + cache.ubatch))
    cost = SlotCost(layers={"global": 0, "windowed": 0, "recurrent": 0})
    for i in range(n_layer):
        if kv_heads[i] > 0:
            kl, vl = (k_len_swa, v_len_swa) if windowed[i] else (k_len, v_len)
            per_cell = _cache_bytes(kv_heads[i] * kl, cache.type_k) + _cache_bytes(kv_heads[i] * vl, cache.type_v)
            if windowed[i]:
                cost.kv_windowed += per_cell * cells_windowed
                cost.layers["windowed"] += 1
            else:
                cost.kv_global += per_cell * cells
                cost.layers["global"] += 1
        elif d_state and (ff_layers is None or ff_layers[i] == 0):
            d_inner = int(header.key("ssm.inner_size") or 0)
            d_conv = int(header.key("ssm.conv_kernel") or 0)
            n_group = int(header.key("ssm.group_count") or 0)
            conv = (d_conv - 1) * (d_inner + 2 * n_group * d_state)
            cost.recurrent += 4 * (conv + d_state * d_inner)  # f32 states
            cost.layers["recurrent"] += 1
    return cost


@dataclass(frozen=True)
class PlanSettings:
    runtime_overhead_bytes: int
    headroom_bytes: int


@dataclass
class Plan:
    model: str
    slots: int
    cache: CacheSettings
    weights: Weights
    draft_weights: Weights | None
    per_slot: SlotCost
    draft_per_slot: SlotCost | None
    overhead_bytes: int
    headroom_bytes: int
    bytes_fetched: int
    file_bytes: int

    @property
    def weights_bytes(self) -> int:
        return self.weights.total + (self.draft_weights.total if self.draft_weights else 0)

    @property
    def per_slot_bytes(self) -> int:
        return self.per_slot.total + (self.draft_per_slot.total if self.draft_per_slot else 0)

    @property
    def mask_per_slot_bytes(self) -> int:
        """What each slot beyond the first adds to the compute buffers when the slots share one cache."""
        if not self.cache.shared:
            return 0
        contexts = 2 if self.draft_weights else 1
        per_cell = MASK_BYTES_PER_CELL_TOKEN * self.cache.ubatch + MASK_BYTES_PER_CELL
        return _pad(self.cache.ctx_per_slot) * per_cell * contexts

    def mask_bytes(self, slots: int | None = None) -> int:
        n = self.slots if slots is None else slots
        return (n - 1) * self.mask_per_slot_bytes if n > 1 else 0

    def total_bytes(self, slots: int | None = None) -> int:
        n = self.slots if slots is None else slots
        return (
            self.weights_bytes
            + n * self.per_slot_bytes
            + self.mask_bytes(n)
            + self.overhead_bytes
            + self.headroom_bytes
        )

    def max_slots(self, card_bytes: int) -> int:
        free = card_bytes - self.weights_bytes - self.overhead_bytes - self.headroom_bytes
        if free < 0 or self.per_slot_bytes <= 0:
            return 0 if free < 0 else 10**6
        mask = self.mask_per_slot_bytes
        shared = (free + mask) // (self.per_slot_bytes + mask)  # n slots and n - 1 masks in `free`
        return shared if shared >= 2 else min(1, free // self.per_slot_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "slots": self.slots,
            "ctx_per_slot": self.cache.ctx_per_slot,
            "cache": vars(self.cache),
            "weights_bytes": self.weights_bytes,
            "weights": {**vars(self.weights), "total": self.weights.total},
            "draft_weights": {**vars(self.draft_weights), "total": self.draft_weights.total}
            if self.draft_weights
            else None,
            "per_slot_bytes": self.per_slot_bytes,
            "per_slot": {
                "kv_global": self.per_slot.kv_global,
                "kv_windowed": self.per_slot.kv_windowed,
                "recurrent": self.per_slot.recurrent,
                "layers": self.per_slot.layers,
                "draft": self.draft_per_slot.total if self.draft_per_slot else 0,
            },
            "mask_bytes": self.mask_bytes(),
            "overhead_bytes": self.overhead_bytes,
            "headroom_bytes": self.headroom_bytes,
            "total_bytes": self.total_bytes(),
            "max_slots": {str(gb): self.max_slots(gb * GIB) for gb in CARD_SIZES_GB},
            "bytes_fetched": self.bytes_fetched,
            "file_bytes": self.file_bytes,
        }


def cache_settings_from_args(args: list[str], ctx_per_slot: int) -> CacheSettings:
    """The cache-shaping flags of a llama-server command line."""

    def value(*flags: str, default: str) -> str:
        for i, a in enumerate(args):
            if a in flags and i + 1 < len(args):
                return args[i + 1]
            for flag in flags:
                if a.startswith(flag + "="):
                    return a.split("=", 1)[1]
        return default

    ubatch = value("-ub", "--ubatch-size", default="512")
    if not re.fullmatch(r"\d+", ubatch):
        raise GgufError(f"-ub {ubatch!r} is not a number")
    return CacheSettings(
        ctx_per_slot=ctx_per_slot,
        ubatch=int(ubatch),
        swa_full="--swa-full" in args,
        type_k=value("-ctk", "--cache-type-k", default="f16"),
        type_v=value("-ctv", "--cache-type-v", default="f16"),
        shared=any(a in SHARED_CACHE for a in args),  # a stream per slot unless the profile asks for one cache
    )


def make_plan(
    model: str, slots: int, cache: CacheSettings, main: GgufHeader, draft: GgufHeader | None, settings: PlanSettings
) -> Plan:
    return Plan(
        model=model,
        slots=slots,
        cache=cache,
        weights=weights(main),
        draft_weights=weights(draft) if draft else None,
        per_slot=slot_cost(main, cache),
        draft_per_slot=slot_cost(draft, cache) if draft and draft.arch not in SHARES_TARGET_CACHE else None,
        overhead_bytes=settings.runtime_overhead_bytes,
        headroom_bytes=settings.headroom_bytes,
        bytes_fetched=main.bytes_fetched + (draft.bytes_fetched if draft else 0),
        file_bytes=(main.file_size or 0) + ((draft.file_size or 0) if draft else 0),
    )


def card_problem(plan: Plan, total_mib: float, used_mib: float) -> str | None:
    """What nvidia-smi on a host with llama-server loaded says is wrong against the plan, or None (pure).

    A card smaller than the profile needs (an offer that misreports its GPU, or a card already half taken),
    or less memory in use than the weights alone: llama-server left the model off the card (no usable CUDA
    device, a driver too old for the build, a CPU-only build) and would serve at a CPU's speed."""
    need = plan.total_bytes() - plan.headroom_bytes
    if total_mib * MIB < need:
        return (
            f"the card has {total_mib:,.0f} MiB; the profile needs {need / MIB:,.0f} MiB at {plan.slots} slots "
            "(fleet plan)"
        )
    if used_mib * MIB < plan.weights_bytes:
        return (
            f"llama-server left the model off the card: {used_mib:,.0f} MiB in use, the weights alone are "
            f"{plan.weights_bytes / MIB:,.0f} MiB (no usable CUDA device, a driver too old, or a CPU-only build)"
        )
    return None
