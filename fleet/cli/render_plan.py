"""`fleet plan`'s table: the GPU memory a profile needs, term by term, and the slots each card size holds."""

from __future__ import annotations

from rich.table import Table

from fleet.cli.render import line, out
from fleet.plan.memory import GIB, Plan
from fleet.plan.vllm import VllmPlan


def plan(model: str, p: Plan, max_slots: dict[str, int]) -> None:
    def gib(n: int) -> str:
        return f"{n / GIB:8.2f} GiB"

    w = p.weights
    line(
        (model, "bold"),
        f": {p.slots} slots x {p.cache.ctx_per_slot} tokens, cache "
        f"{p.cache.type_k}/{p.cache.type_v}, -ub {p.cache.ubatch}, swa-full {'on' if p.cache.swa_full else 'off'}, "
        f"{'one cache for all slots' if p.cache.shared and p.slots > 1 else 'a cache per slot'}",
    )
    t = Table(show_header=False)
    t.add_column(no_wrap=True)
    t.add_column(justify="right", no_wrap=True)
    rows = [
        ("weights: experts", w.experts),
        ("weights: attention", w.attention),
        ("weights: embeddings", w.embeddings),
        ("weights: other", w.other),
    ]
    if p.draft_weights:
        rows.append(("weights: draft model", p.draft_weights.total))
    layers = p.per_slot.layers
    rows += [
        (f"per slot: KV of {layers['global']} global layers", p.per_slot.kv_global),
        (f"per slot: KV of {layers['windowed']} windowed layers", p.per_slot.kv_windowed),
        (f"per slot: state of {layers['recurrent']} recurrent layers", p.per_slot.recurrent),
    ]
    if p.draft_per_slot:
        rows.append(("per slot: draft model cache", p.draft_per_slot.total))
    elif p.draft_weights:
        rows.append(("per slot: draft model cache (reads the target's)", 0))
    if p.mask_bytes():
        rows.append((f"shared cache: its mask, {p.slots - 1} slots beyond the first", p.mask_bytes()))
    rows += [
        ("runtime overhead", p.overhead_bytes),
        ("headroom", p.headroom_bytes),
        (f"total at {p.slots} slots", p.total_bytes()),
    ]
    for label, value in rows:
        t.add_row(label, gib(value))
    if w.host:
        t.add_row("not on the card: input embedding (host memory)", gib(w.host))
    out.print(t)
    line(f"most slots per card: {', '.join(f'{gb} GB: {n}' for gb, n in max_slots.items())}")
    if p.bytes_fetched:
        share = 100 * p.bytes_fetched / max(p.file_bytes, 1)
        line(f"read {p.bytes_fetched:,} bytes of {p.file_bytes:,} ({share:.3f}%)")
    else:
        line(f"read no bytes of {p.file_bytes:,}: the headers were kept from an earlier read (by each file's sha256)")


def vllm_plan(model: str, p: VllmPlan, card_bytes: int) -> None:
    s = p.settings
    line(
        (model, "bold"),
        f": vLLM, --max-num-seqs {s.max_num_seqs}, --max-model-len {s.max_model_len}, "
        f"--gpu-memory-utilization {s.gpu_memory_utilization:g}, on a card of {card_bytes / GIB:.1f} GiB",
    )
    t = Table(show_header=False)
    t.add_column(no_wrap=True)
    t.add_column(justify="right", no_wrap=True)
    layout = p.layout
    rows = [
        ("weights (the safetensors headers)", f"{p.weights_bytes / GIB:10.2f} GiB"),
        ("runtime (activations, graphs, CUDA context)", f"{p.runtime_bytes / GIB:10.2f} GiB"),
        ("KV cache: what the card leaves", f"{p.cache_bytes(card_bytes) / GIB:10.2f} GiB"),
        (f"KV per token: {layout.full_layers} full layers", f"{p.layout.full_bytes_per_token(s.kv_bytes):,} B"),
        (
            f"KV per token: {layout.windowed_layers} windowed layers (window {layout.window})",
            f"{p.layout.windowed_bytes_per_token(s.kv_bytes):,} B",
        ),
        (f"one sequence of {s.max_model_len} tokens", f"{p.sequence_bytes / GIB:10.3f} GiB"),
        ("sequences at full length at once", f"{p.full_length_sequences(card_bytes):,}"),
        (f"tokens each of {s.max_num_seqs} active sequences holds", f"{p.tokens_per_sequence(card_bytes):,}"),
        (f"smallest card for {s.max_num_seqs} full-length sequences", f"{p.card_bytes_needed() / GIB:10.2f} GiB"),
    ]
    for label, value in rows:
        t.add_row(label, value)
    out.print(t)
    problem = p.problem(card_bytes)
    line((problem, "red") if problem else "vLLM starts with these settings on this card")
