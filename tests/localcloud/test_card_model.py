"""The card model the local cloud's simulated hosts time their replies by, read from the card's own results."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

from fleet.localcloud.cardmodel import STREAMS_RESULTS, CardModel, CardModelError, from_results


def test_each_users_model_reads_its_measured_levels_and_a_stream_slows_as_streams_join():
    rows = json.loads(STREAMS_RESULTS.read_text())
    for name in ("a4b", "phonellm", "nemo"):
        card = from_results(name)
        measured = {r["streams"]: r["top_k_first"] for r in rows if r["model"] == name}
        assert {s: card.total_tok_s(s) for s in measured} == pytest.approx(measured)
        rates = [card.stream_tok_s(n) for n in range(1, 129)]
        assert all(a >= b for a, b in pairwise(rates)), name  # never faster for more streams
        totals = [card.total_tok_s(n) for n in range(1, 129)]
        assert all(a <= b for a, b in pairwise(totals)), name  # nor less in all
        assert card.total_tok_s(128) == card.total_tok_s(64) == measured[64]  # no faster than measured


def test_between_levels_the_total_is_on_the_line_and_below_the_first_each_stream_gets_the_firsts_rate():
    card = CardModel("m", ((8, 800.0), (16, 1200.0)))
    assert card.total_tok_s(12) == pytest.approx(1000.0)
    assert card.stream_tok_s(1) == card.stream_tok_s(8) == 100.0
    assert card.stream_tok_s(0) == card.total_tok_s(0) == 0.0


def test_results_that_do_not_model_a_card_are_refused_saying_why(tmp_path):
    with pytest.raises(CardModelError, match=r"measured no model 'gemma' \(it has a4b, nemo, phonellm\)"):
        from_results("gemma")
    with pytest.raises(CardModelError, match="no streams results to read"):
        from_results("a4b", tmp_path / "missing.json")
    with pytest.raises(CardModelError, match="distinct stream counts from 1 up"):
        CardModel("m", ((16, 1.0), (8, 2.0)))
    with pytest.raises(CardModelError, match="decode some tokens"):
        CardModel("m", ((1, 0.0),))
