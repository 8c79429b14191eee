"""The session bill `fleet destroy` ends with: rent as the record closed it, traffic on top at the
profile's expected rate, a host still billing counted up to now."""

from datetime import timedelta

import pytest

from fleet.core.models import utcnow
from fleet.economics.bill import bill
from tests.test_machines import host


def test_the_session_bill_adds_traffic_at_the_expected_rate_to_the_rent():
    now = utcnow()
    closed = host(1, 7, dph_total=0.30, effective_usd_per_hour=0.33, accrued_usd=0.6)
    closed.created_at, closed.destroyed_at = now - timedelta(hours=3), now - timedelta(hours=1)
    live = host(2, 8, dph_total=0.20, effective_usd_per_hour=0.20)
    live.created_at = now - timedelta(minutes=30)
    session = bill([closed, live], now)
    first, second = session.lines
    assert (first.hours, first.rent_usd, first.traffic_usd) == (pytest.approx(2.0), 0.6, pytest.approx(0.06))
    assert (second.hours, second.rent_usd, second.traffic_usd) == (pytest.approx(0.5), pytest.approx(0.1), 0.0)
    assert session.total_usd == pytest.approx(0.76)
