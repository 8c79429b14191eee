"""The conversation load's arithmetic (fleet/probes/conversation.py) on recorded turns: what a level says of
its turns, the gaps each call waits, and the capacity search reading calls levels as it reads speakers."""

import pytest

from fleet.core.config import VoiceTarget
from fleet.economics.capacity import calls_held, capacity, next_level
from fleet.probes.conversation import Turn, gaps, summarize_calls
from fleet.probes.stream import ChatResult, Timing


def reply(first_ms: float, cache_n: int, prompt: int, status: int = 200) -> ChatResult:
    r = ChatResult(status=status, timing=Timing(None, 1.0, first_ms, first_ms + 200.0, True), max_tokens=32)
    r.server_timings = {"predicted_per_second": 80.0, "predicted_n": 32, "cache_n": cache_n}
    r.usage = {"prompt_tokens": prompt}
    if status != 200:
        r.error = f"HTTP {status}"
    return r


def test_a_level_counts_its_turns_their_overlap_and_the_duty():
    turns = [
        Turn(0.0, 0.2, 0, reply(30, 950, 1000)),
        Turn(0.1, 0.3, 1, reply(50, 960, 1000)),  # sent while one other turn was in flight
        Turn(1.0, 1.2, 2, reply(90, 100, 1000)),  # both slots busy: it waited for one
        Turn(2.0, 2.4, 0, reply(0, 0, 0, status=503)),
    ]
    level = summarize_calls(3, turns, span_s=10.0, slots=2, gap_s=2.5)
    assert (level.calls, level.requests, level.errors) == (3, 4, 1)
    assert level.first_content_p50_ms == 50 and level.first_content_p95_ms == pytest.approx(86.0)
    assert level.waited == 1 and level.peak_in_flight == 3
    assert level.duty == pytest.approx((0.2 + 0.2 + 0.2 + 0.4) / 10.0)
    assert level.cache_reuse == 0.95 and level.turn_gap_s == 2.5
    assert summarize_calls(1, [], span_s=0.0, slots=1, gap_s=1.0).duty is None
    assert level.draft_acceptance is None  # no reply drafted
    drafted = reply(30, 950, 1000)
    drafted.server_timings |= {"draft_n": 20, "draft_n_accepted": 15}
    assert summarize_calls(1, [Turn(0.0, 0.2, 0, drafted)], 10.0, 2, 2.5).draft_acceptance == 0.75


def test_each_call_waits_its_own_gaps_the_same_every_run():
    one, again, other = gaps(0, 50, 8.0), gaps(0, 50, 8.0), gaps(1, 50, 8.0)
    assert one == again and one != other
    assert all(4.0 <= g <= 12.0 for g in one + other)
    assert sum(one) / len(one) == pytest.approx(8.0, rel=0.15)
    assert gaps(3, 4, 0.0) == [0.0] * 4  # no gap: the speakers' load


def test_the_capacity_search_reads_calls_levels_and_sizing_counts_calls():
    target = VoiceTarget(first_content_p95_ms=100, decode_tok_s=15)
    ok, slow = reply(40, 950, 1000), reply(400, 950, 1000)
    measured = {n: summarize_calls(n, [Turn(0, 0.1, 0, ok)], 10.0, 64, 8.0) for n in (1, 2, 4, 8)}
    measured[16] = summarize_calls(16, [Turn(0, 0.1, 0, slow)], 10.0, 64, 8.0)
    assert next_level(measured, target, 64) == 12  # between the last that held and the first that missed
    held = capacity(measured, target, 64)
    assert held.callers == 8 and held.why_missed.startswith("first content p95 400")

    class Run:
        capacity, calls_capacity = 4, 24

    class Older:
        capacity, calls_capacity = 4, None

    assert calls_held(Run(), 32) == 24 and calls_held(Run(), 16) == 16  # never past the slots
    assert calls_held(Older(), 32) == 4 and calls_held(None, 8) == 8  # speakers, then slots
