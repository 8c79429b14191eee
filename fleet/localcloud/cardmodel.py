"""A card's decode as measured: how many tokens a second a stream gets while N streams decode at once.

The local cloud's simulated hosts (issue 48: a thousand hosts on one machine) time their replies by it. The
points come from a run of `bench/server_decode.py` on a card (`bench/gpu/results/*-streams.json`: llama-server
with fleet's patches, each model's total tokens a second at 1-64 streams); between two measured levels the
total is read on the straight line through them, past the last it stays at the last (a card does not decode
faster for more streams than it was measured at), below the first it is the first's per stream.
"""

from __future__ import annotations

import functools
import json
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

from fleet.localcloud.toolchain import REPO_ROOT

RESULTS = REPO_ROOT / "bench" / "gpu" / "results"
STREAMS_RESULTS = RESULTS / "2026-12-06-streams.json"  # the a4b replica, phonellm and the NeMo shape on an H100
SERVED_COLUMN = "top_k_first"  # llama-server as fleet's hosts run it (patch 0004 on)


class CardModelError(ValueError):
    """The results give no model of that name, or too little to model it."""


@dataclass(frozen=True)
class CardModel:
    model: str
    levels: tuple[tuple[int, float], ...]  # (streams at once, tokens a second over all of them), streams rising

    def __post_init__(self) -> None:
        streams = [s for s, _ in self.levels]
        if not self.levels or streams != sorted(set(streams)) or streams[0] < 1:
            raise CardModelError(f"{self.model}: levels must be distinct stream counts from 1 up, got {streams}")
        if any(total <= 0 for _, total in self.levels):
            raise CardModelError(f"{self.model}: every level must decode some tokens a second")

    def total_tok_s(self, streams: int) -> float:
        """Tokens a second over all `streams` decoding at once."""
        if streams < 1:
            return 0.0
        first_streams, first_total = self.levels[0]
        if streams <= first_streams:
            return first_total / first_streams * streams
        if streams >= self.levels[-1][0]:
            return self.levels[-1][1]
        i = bisect_left(self.levels, streams, key=lambda level: level[0])
        (s0, t0), (s1, t1) = self.levels[i - 1], self.levels[i]
        return t0 + (t1 - t0) * (streams - s0) / (s1 - s0)

    def stream_tok_s(self, streams: int) -> float:
        """Tokens a second one stream gets while `streams` decode at once (itself among them)."""
        if streams < 1:
            return 0.0
        first_streams, first_total = self.levels[0]
        return first_total / first_streams if streams <= first_streams else self.total_tok_s(streams) / streams


def _rows(path: Path) -> list:
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CardModelError(f"{path}: no streams results to read ({e})") from None
    return rows if isinstance(rows, list) else []


def models(path: Path = STREAMS_RESULTS) -> list[str]:
    """The models the streams results measured."""
    return sorted({r["model"] for r in _rows(path) if isinstance(r, dict) and isinstance(r.get("model"), str)})


@functools.cache  # a cloud of simulated hosts reads it once, not once a host
def from_results(model: str, path: Path = STREAMS_RESULTS, column: str = SERVED_COLUMN) -> CardModel:
    """The card model of `model` from a streams bench's JSON rows ({"model", "streams", column: tok/s})."""
    rows = _rows(path)
    levels = sorted(
        (int(r["streams"]), float(r[column]))
        for r in rows
        if isinstance(r, dict) and r.get("model") == model and isinstance(r.get(column), int | float)
    )
    if not levels:
        raise CardModelError(f"{path.name} measured no model {model!r} (it has {', '.join(models(path)) or 'none'})")
    return CardModel(model, tuple(levels))
