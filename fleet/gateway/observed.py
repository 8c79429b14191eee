"""What the gateway's observe filter (observe.lua) counted, as `fleet metrics` on HAProxy's admin socket prints
it: per target backend and host slot, first content in buckets, and the warm turns that hit the host's cache.
Parsed strictly (pure): a line that is not what the filter prints is an error, never a guess."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet.core.errors import FleetError


class ObservedError(FleetError, ValueError):
    """HAProxy's `fleet metrics` answer is not what observe.lua prints."""


@dataclass(frozen=True)
class SlotObserved:
    backend: str
    slot: int
    bounds_ms: tuple[float, ...]  # the buckets' upper bounds; the last bucket holds every slower answer
    buckets: tuple[int, ...]  # counts, one more than bounds_ms
    count: int
    sum_ms: float
    warm_turns: int
    warm_turns_cached: int  # ... whose host took part of the prompt from its cache
    cached_tokens: int
    processed_tokens: int
    answered: int | None = None  # requests its host answered since it took the slot (None: an older filter's line)

    def first_content_ms(self, q: float) -> float | None:
        """The q-quantile of first content, interpolated in its bucket (as Prometheus's histogram_quantile
        does); the last finite bound when it lies in the open bucket; None before any answer."""
        if self.count == 0:
            return None
        rank = q * self.count
        below = 0
        for i, n in enumerate(self.buckets):
            if n and below + n >= rank:
                if i == len(self.bounds_ms):
                    return self.bounds_ms[-1]
                low = self.bounds_ms[i - 1] if i else 0.0
                return low + (self.bounds_ms[i] - low) * (rank - below) / n
            below += n
        return self.bounds_ms[-1]

    @property
    def cached_share(self) -> float | None:
        """The share of warm turns whose host reused its cache (None before any)."""
        return self.warm_turns_cached / self.warm_turns if self.warm_turns else None

    def summary(self) -> dict[str, Any]:
        """What `fleet gateway status` shows of it (and the daemon exports): first content p50, p95 and its
        histogram, and the warm turns with their cache hits and prompt tokens."""
        return {
            "first_content_p50_ms": self.first_content_ms(0.5),
            "first_content_p95_ms": self.first_content_ms(0.95),
            "first_content": {
                "bounds_ms": list(self.bounds_ms),
                "buckets": list(self.buckets),
                "count": self.count,
                "sum_ms": self.sum_ms,
            },
            "warm_turns": self.warm_turns,
            "warm_turns_cached": self.warm_turns_cached,
            "warm_turns_cached_share": self.cached_share,
            "cached_tokens": self.cached_tokens,
            "processed_tokens": self.processed_tokens,
        }


NOTHING_OBSERVED: dict[str, Any] = {
    "first_content_p50_ms": None,
    "first_content_p95_ms": None,
    "first_content": None,
    "warm_turns": 0,
    "warm_turns_cached": 0,
    "warm_turns_cached_share": None,
    "cached_tokens": 0,
    "processed_tokens": 0,
}


def parse_observed(text: str) -> list[SlotObserved]:
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("le "):
        raise ObservedError(f"`fleet metrics` answered {text[:80]!r}: no bucket line")
    try:
        bounds = tuple(float(x) for x in lines[0].split()[1:])
    except ValueError:
        raise ObservedError(f"`fleet metrics`: bucket bounds {lines[0][:80]!r}") from None
    if not bounds or list(bounds) != sorted(set(bounds)):
        raise ObservedError(f"`fleet metrics`: bucket bounds {lines[0][:80]!r} do not rise")
    width = 2 + 2 + len(bounds) + 1 + 4  # and the count answered, where the filter is this fleet's
    out = []
    for line in lines[1:]:
        fields = line.split()
        if len(fields) not in (width, width + 1) or not fields[1].startswith("s") or not fields[1][1:].isdigit():
            raise ObservedError(f"`fleet metrics`: {line[:80]!r} is not a slot's line")
        try:
            count, sum_ms = int(fields[2]), float(fields[3])
            buckets = tuple(int(x) for x in fields[4 : 5 + len(bounds)])
            warm, cached, cached_tokens, processed = (int(x) for x in fields[5 + len(bounds) : width])
            answered = int(fields[width]) if len(fields) > width else None
        except ValueError:
            raise ObservedError(f"`fleet metrics`: {line[:80]!r} holds something not a number") from None
        numbers = (count, warm, cached, cached_tokens, processed, answered or 0, *buckets)
        if sum(buckets) != count or min(numbers) < 0 or cached > warm or (answered is not None and answered < count):
            raise ObservedError(f"`fleet metrics`: {line[:80]!r} does not add up")
        out.append(
            SlotObserved(
                fields[0],
                int(fields[1][1:]),
                bounds,
                buckets,
                count,
                sum_ms,
                warm,
                cached,
                cached_tokens,
                processed,
                answered,
            )
        )
    return out
