"""What a Hugging Face model's config.json says about its KV cache: which layers attend over the whole
context, which over a sliding window, and the KV heads and head size of each.

A multimodal checkpoint nests its language model's settings under `text_config`; its top level then describes
the wrapper. Every field is read strictly (an integer where an integer belongs, no layer count above
MAX_LAYERS): the file comes from the hub.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fleet.core.errors import FleetError

MAX_LAYERS = 1024
MAX_CONFIG_BYTES = 4 * 1024 * 1024
# the dtype names config.json uses (`torch_dtype`, or `dtype` in newer files) and their bytes
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
WINDOWED = "sliding_attention"
FULL = "full_attention"


class ConfigJsonError(FleetError, ValueError):
    """A config.json fleet cannot plan from: the message says why, in one line."""

    prefix = "plan"


@dataclass(frozen=True)
class AttentionLayout:
    full_layers: int
    windowed_layers: int
    window: int  # tokens a windowed layer attends to (0: no windowed layers)
    kv_heads: int
    head_dim: int
    full_kv_heads: int  # a full-attention layer's own, where the model gives them another shape
    full_head_dim: int
    dtype_bytes: int  # the weights' dtype, which vLLM's KV cache takes by default ("auto")

    def full_bytes_per_token(self, kv_bytes: int | None = None) -> int:
        """K and V of every full-attention layer for one token."""
        b = kv_bytes or self.dtype_bytes
        return self.full_layers * 2 * self.full_kv_heads * self.full_head_dim * b

    def windowed_bytes_per_token(self, kv_bytes: int | None = None) -> int:
        b = kv_bytes or self.dtype_bytes
        return self.windowed_layers * 2 * self.kv_heads * self.head_dim * b

    def sequence_bytes(self, tokens: int, kv_bytes: int | None = None) -> int:
        """The KV cache one sequence of `tokens` holds: every token in a full layer, at most the window in a
        windowed one."""
        windowed = min(tokens, self.window) if self.window else 0
        return tokens * self.full_bytes_per_token(kv_bytes) + windowed * self.windowed_bytes_per_token(kv_bytes)


def parse(data: bytes, source: str) -> AttentionLayout:
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigJsonError(f"{source}: larger than {MAX_CONFIG_BYTES >> 20} MiB")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, an integer of 4300 digits
        raise ConfigJsonError(f"{source}: not JSON we read ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise ConfigJsonError(f"{source}: not a JSON object")
    text = doc.get("text_config", doc)
    if not isinstance(text, dict):
        raise ConfigJsonError(f"{source}: text_config is not an object")
    return layout(text, doc, source)


def layout(text: dict[str, Any], top: dict[str, Any], source: str) -> AttentionLayout:
    layers = _int(text, "num_hidden_layers", source, 1, MAX_LAYERS)
    heads = _int(text, "num_attention_heads", source, 1, 4096)
    kv_heads = _int(text, "num_key_value_heads", source, 1, heads, default=heads)
    hidden = _int(text, "hidden_size", source, 1, 1 << 20, default=0)
    head_dim = _int(text, "head_dim", source, 1, 1 << 16, default=hidden // heads or None, allow_null=True)
    window = _int(text, "sliding_window", source, 1, 1 << 24, default=0, allow_null=True)
    windowed = _windowed_layers(text, layers, window, source)
    dtype_name = text.get("dtype", text.get("torch_dtype", top.get("dtype", top.get("torch_dtype", "bfloat16"))))
    if dtype_name not in DTYPE_BYTES:
        raise ConfigJsonError(f"{source}: dtype {str(dtype_name)[:20]!r} (fleet knows {', '.join(DTYPE_BYTES)})")
    return AttentionLayout(
        full_layers=layers - windowed,
        windowed_layers=windowed,
        window=window if windowed else 0,
        kv_heads=kv_heads,
        head_dim=head_dim,
        full_kv_heads=_int(text, "num_global_key_value_heads", source, 1, heads, default=kv_heads, allow_null=True),
        full_head_dim=_int(text, "global_head_dim", source, 1, 1 << 16, default=head_dim, allow_null=True),
        dtype_bytes=DTYPE_BYTES[dtype_name],
    )


def _windowed_layers(text: dict[str, Any], layers: int, window: int, source: str) -> int:
    """How many layers attend over a window: as `layer_types` names them, else every `sliding_window_pattern`-th
    layer global (Gemma 3's older configs); with a window and neither, none (a layer planned as full never
    under-plans)."""
    types = text.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or not all(t in (WINDOWED, FULL) for t in types):
            raise ConfigJsonError(f"{source}: layer_types must name {layers} layers, each {WINDOWED} or {FULL}")
        if WINDOWED in types and not window:
            raise ConfigJsonError(f"{source}: layer_types has windowed layers but sliding_window is unset")
    if not window or text.get("use_sliding_window") is False:
        return 0
    if types is not None:
        return types.count(WINDOWED)
    if "sliding_window_pattern" in text:
        period = _int(text, "sliding_window_pattern", source, 1, MAX_LAYERS)
        return layers - layers // period
    return 0


def _int(
    doc: dict[str, Any],
    key: str,
    source: str,
    low: int,
    high: int,
    default: int | None = None,
    allow_null: bool = False,
) -> int:
    """`doc[key]`, an integer in [low, high]; `default` when the key is absent (or null, where allowed)."""
    value = doc.get(key)
    if value is None and (key not in doc or allow_null):
        if default is None:
            raise ConfigJsonError(f"{source}: no {key}")
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigJsonError(f"{source}: {key} must be an integer from {low} to {high}, not {str(value)[:20]!r}")
    return value
