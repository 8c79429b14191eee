"""The analytic capacity in calls (fleet/economics/duty.py) on plain numbers."""

import pytest

from fleet.economics.duty import calls_for, duty, overlap_beyond


def test_duty_is_the_share_of_a_call_its_turn_is_in_flight():
    assert duty(0.5, 7.5) == pytest.approx(0.0625)
    assert duty(1.0, 0.0) == 1.0  # a caller who never pauses speaks all the time: every call a speaker
    for bad in ((-1.0, 1.0), (1.0, -1.0), (0.0, 0.0)):
        with pytest.raises(ValueError):
            duty(*bad)


def test_the_overlap_tail_is_the_binomial_tail():
    # 3 calls at duty 1/2: more than 1 in flight is P(2) + P(3) = 3/8 + 1/8
    assert overlap_beyond(3, 1, 0.5) == pytest.approx(0.5)
    assert overlap_beyond(4, 4, 0.9) == 0.0  # never more in flight than there are calls
    assert overlap_beyond(10, 0, 0.1) == pytest.approx(1 - 0.9**10)
    with pytest.raises(ValueError):
        overlap_beyond(4, 1, 1.5)


def test_calls_for_a_speaker_capacity_grows_as_the_duty_falls():
    assert calls_for(4, 1.0) == 4  # every call speaks at once: calls are speakers
    assert calls_for(0, 0.1) == 0  # a host that holds no speaker holds no call
    low, high = calls_for(8, 0.05), calls_for(8, 0.2)
    assert low > high > 8
    # the answer is the edge: one call more and the tail passes 5%
    assert overlap_beyond(high, 8, 0.2) <= 0.05 < overlap_beyond(high + 1, 8, 0.2)
    assert calls_for(8, 0.0, most=100) == 100  # calls that never speak: only the bound stops them
