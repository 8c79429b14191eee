"""What a host is worth to a voice deployment: how many concurrent callers it holds while meeting the
profile's voice target, and what one call-minute costs on it.

Pure: the bench (fleet/probes/bench.py) measures levels of concurrent callers; `next_level` says which
level to measure next and `capacity` reads the answer off what was measured. The search doubles the
callers while the target holds, then bisects between the last level that held and the first that did
not, so the capacity is always one less than the smallest level measured to miss (the level right
above it is measured), with about log2(N) levels measured instead of N.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fleet.core.config import VoiceTarget


class Level(Protocol):
    """What the capacity search reads of one measured level of concurrent callers (the bench's LevelResult,
    fleet/probes/bench.py)."""

    requests: int
    errors: int
    first_content_p95_ms: float | None
    decode_per_caller_tok_s: float | None

    def as_dict(self) -> dict[str, Any]: ...


def judge_level(level: Level, target: VoiceTarget) -> str | None:
    """None when the level meets the target, else why not (one clause)."""
    if level.errors:
        return f"{level.errors} of {level.requests} requests failed"
    p95 = level.first_content_p95_ms
    if p95 is None or p95 > target.first_content_p95_ms:
        return f"first content p95 {p95:.0f} ms > {target.first_content_p95_ms:g} ms" if p95 else "no first content"
    decode = level.decode_per_caller_tok_s
    if decode is None or decode < target.decode_tok_s:
        return (
            f"decode {decode:.1f} tok/s per caller < {target.decode_tok_s:g}" if decode else "no decode rate measured"
        )
    return None


def next_level(measured: Mapping[int, Level], target: VoiceTarget, most: int) -> int | None:
    """The next number of callers to measure, or None when the capacity is known."""
    if 1 not in measured:
        return 1
    held = [n for n, lv in measured.items() if judge_level(lv, target) is None]
    missed = [n for n, lv in measured.items() if judge_level(lv, target) is not None]
    low = max((n for n in held if not missed or n < min(missed)), default=0)
    if not missed:
        return None if low >= most else min(low * 2, most)
    high = min(missed)
    return None if high - low <= 1 else (low + high) // 2


@dataclass(frozen=True)
class Capacity:
    callers: int  # the most concurrent callers that met the target (0: not even one)
    target: VoiceTarget
    exhausted: bool  # every level up to the most asked for held: the host may hold more
    held: Level | None  # the evidence: the level at the capacity ...
    missed: Level | None  # ... and the one above it, with why it missed
    why_missed: str | None

    def as_dict(self) -> dict[str, object]:
        return {
            "callers": self.callers,
            "at_least": self.exhausted,
            "target": self.target.model_dump(),
            "held": self.held.as_dict() if self.held else None,
            "missed": self.missed.as_dict() if self.missed else None,
            "why_missed": self.why_missed,
        }


def capacity(measured: Mapping[int, Level], target: VoiceTarget, most: int) -> Capacity:
    """The answer once `next_level` says None (or the best known so far)."""
    missed = sorted(n for n, lv in measured.items() if judge_level(lv, target) is not None)
    below = [n for n, lv in measured.items() if judge_level(lv, target) is None and (not missed or n < missed[0])]
    callers = max(below, default=0)
    first_miss = measured[missed[0]] if missed else None
    return Capacity(
        callers=callers,
        target=target,
        exhausted=not missed and callers >= most,
        held=measured.get(callers),
        missed=first_miss,
        why_missed=judge_level(first_miss, target) if first_miss else None,
    )


class Benched(Protocol):
    """What sizing reads of a host's latest bench (core.models.BenchRun)."""

    capacity: int
    calls_capacity: int | None


def calls_held(run: Benched | None, slots: int) -> int:
    """What a host counts for when a target is sized in calls: the calls in conversation its latest bench held
    at the voice target, else the speakers it held (a bench from before calls were measured), else its slots;
    never more than the slots it was started with (each call keeps its cache in one)."""
    if run is None:
        return slots
    held = run.calls_capacity if run.calls_capacity is not None else run.capacity
    return max(min(held, slots), 0)


def usd_per_voice_minute(effective_usd_per_hour: float, callers: int) -> float | None:
    """Dollars per concurrent call-minute: the host's effective $/h (traffic included) over the calls it
    carries at once, per minute. None for a host that carries none."""
    return effective_usd_per_hour / callers / 60 if callers > 0 else None
