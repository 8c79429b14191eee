"""`fleet plan`'s table: the GPU memory a profile needs, term by term, and the slots each card size holds."""

from __future__ import annotations

from rich.table import Table

from fleet.cli.render import line, out
from fleet.plan.memory import GIB, Plan


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
