"""How many calls a host holds when each call speaks only part of the time: the analytic side of capacity in
calls, beside what the conversation load measures (fleet/probes/conversation.py).

A call in conversation asks the LLM for a turn, then listens while the agent's reply is spoken and the caller
answers: its duty is the share of its time a turn is in flight. With N calls each in flight independently
with probability `duty`, the turns in flight at a moment are Binomial(N, duty). A host that meets the voice
target with k simultaneous turns (its capacity in speakers, `fleet bench`'s speaker levels) then holds the
most N for which more than k turns overlap at most `tail` of the time (0.05: the target is a p95).
Pure: plain numbers in and out.
"""

from __future__ import annotations

from math import comb


def duty(turn_s: float, gap_s: float) -> float:
    """The share of a call's time its turn is in flight: a turn of `turn_s`, then `gap_s` of speech."""
    if turn_s < 0 or gap_s < 0 or turn_s + gap_s <= 0:
        raise ValueError(f"a turn of {turn_s} s and a gap of {gap_s} s is no call")
    return turn_s / (turn_s + gap_s)


def overlap_beyond(calls: int, speakers: int, share: float) -> float:
    """P(more than `speakers` of `calls` independent calls are in flight at once), each with probability
    `share`."""
    if not 0 <= share <= 1:
        raise ValueError(f"a duty of {share} is not a share")
    if speakers >= calls:
        return 0.0
    held = sum(comb(calls, i) * share**i * (1 - share) ** (calls - i) for i in range(max(speakers, -1) + 1))
    return max(0.0, 1.0 - held)


def calls_for(speakers: int, share: float, tail: float = 0.05, most: int = 4096) -> int:
    """The most calls (up to `most`) whose simultaneous turns exceed `speakers` at most `tail` of the time.
    `speakers` calls are always held: their turns can never exceed it."""
    if speakers <= 0:
        return 0
    if share <= 0:
        return most
    calls = speakers
    while calls < most and overlap_beyond(calls + 1, speakers, share) <= tail:
        calls += 1
    return calls
