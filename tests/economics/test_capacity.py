"""The capacity search and the cost per voice-minute on recorded levels: the search finds what measuring
every level would, the level right above the capacity is always measured, and it measures few levels."""

import math
from pathlib import Path

import pytest

from fleet.core import config
from fleet.economics.capacity import capacity, judge_level, next_level, usd_per_voice_minute
from fleet.engines import registry
from fleet.probes.bench import LevelResult

TARGET = config.VoiceTarget(first_content_p95_ms=500, decode_tok_s=15)


def level(callers: int, p95: float, decode: float = 60.0, errors: int = 0) -> LevelResult:
    return LevelResult(callers, callers * 3, errors, p95 * 0.8, p95, decode, None, decode * callers, 0.95, 0)


def search(p95_of, most: int) -> tuple[int, list[int]]:
    """Run the search against a host whose first-content p95 at n callers is p95_of(n)."""
    measured: dict[int, LevelResult] = {}
    order = []
    while (n := next_level(measured, TARGET, most)) is not None:
        assert n not in measured and 1 <= n <= most
        order.append(n)
        measured[n] = level(n, p95_of(n))
    return capacity(measured, TARGET, most).callers, order


@pytest.mark.parametrize("most", [1, 2, 3, 7, 12, 32])
def test_the_search_finds_the_first_miss_minus_one_for_every_host(most):
    for limit in range(0, most + 1):  # the host holds `limit` callers: p95 crosses 500 ms above it
        found, order = search(lambda n, limit=limit: 100 + (n > limit) * 900, most)
        assert found == limit, (limit, order)
        if limit < most:
            assert limit + 1 in order  # the evidence: the level right above was measured and missed
        assert len(order) <= 2 * math.ceil(math.log2(most)) + 1


def test_the_capacity_carries_its_evidence():
    measured = {1: level(1, 90), 2: level(2, 120), 4: level(4, 900), 3: level(3, 480)}
    held = capacity(measured, TARGET, 4)
    assert (held.callers, held.exhausted) == (3, False)
    assert held.held.callers == 3 and held.missed.callers == 4
    assert held.why_missed == "first content p95 900 ms > 500 ms"
    assert held.as_dict()["target"] == {"first_content_p95_ms": 500, "decode_tok_s": 15, "turn_gap_s": 8.0}
    every = capacity({1: level(1, 90), 2: level(2, 120)}, TARGET, 2)
    assert (every.callers, every.exhausted, every.missed) == (2, True, None)
    none = capacity({1: level(1, 700)}, TARGET, 4)
    assert (none.callers, none.held) == (0, None)


def test_a_level_misses_on_decode_or_errors_too():
    assert judge_level(level(2, 200), TARGET) is None
    assert judge_level(level(2, 200, decode=9.5), TARGET) == "decode 9.5 tok/s per caller < 15"
    assert judge_level(level(2, 200, errors=1), TARGET) == "1 of 6 requests failed"


def test_cost_per_voice_minute():
    assert usd_per_voice_minute(0.36, 3) == pytest.approx(0.002)  # $0.36/h over 3 calls: $0.002 a call-minute
    assert usd_per_voice_minute(0.36, 0) is None


def test_a_bad_voice_target_is_named(tmp_path):
    root = Path(__file__).resolve().parents[2]
    text = (
        (root / "fleet.toml")
        .read_text()
        .replace("voice = { turn_gap_s = 0.3 }\n", "voice = { first_content_p95_ms = 0 }\n", 1)
    )
    (tmp_path / "fleet.toml").write_text(text)
    with pytest.raises(config.ConfigError, match=r"models\.tiny\.voice\.first_content_p95_ms: .*greater than 0"):
        registry.load(tmp_path / "fleet.toml")
    assert registry.load(root / "fleet.toml").profile("a4b").voice == config.VoiceTarget()
