"""The session bill `fleet destroy` ends with: rent as the record closed it, traffic on top at the
profile's expected rate, a host still billing counted up to now."""

from datetime import timedelta

import pytest

from fleet.core.models import utcnow
from fleet.economics.bill import accrued_usd, bill
from tests.economics.test_machines import host


def test_the_session_bill_adds_traffic_at_the_expected_rate_to_the_rent():
    now = utcnow()
    closed = host(1, 7, dph_total=0.30, effective_usd_per_hour=0.33, accrued_usd=0.6)
    closed.created_at, closed.destroyed_at = now - timedelta(hours=3), now - timedelta(hours=1)
    closed.running_at = closed.created_at
    live = host(2, 8, dph_total=0.20, effective_usd_per_hour=0.20)
    live.created_at = live.running_at = now - timedelta(minutes=30)
    session = bill([closed, live], now)
    first, second = session.lines
    assert (first.hours, first.rent_usd, first.traffic_usd) == (pytest.approx(2.0), 0.6, pytest.approx(0.06))
    assert (second.hours, second.rent_usd, second.traffic_usd) == (pytest.approx(0.5), pytest.approx(0.1), 0.0)
    assert session.total_usd == pytest.approx(0.76)


def test_the_gpu_bills_from_running_the_disk_while_loading_and_the_pull_by_the_byte():
    now = utcnow()
    loading = host(3, 9, dph_total=0.40, storage_usd_per_hour=0.01, inet_down_usd_per_gb=0.02)
    loading.created_at = now - timedelta(hours=2)  # never ran: the disk alone, the whole time
    ran = host(4, 10, dph_total=0.40, storage_usd_per_hour=0.01, inet_down_usd_per_gb=0.02, pulled_bytes=15 * 10**9)
    ran.created_at, ran.running_at = now - timedelta(hours=2), now - timedelta(hours=1)
    assert accrued_usd(loading, now) == pytest.approx(0.01 * 2)
    assert accrued_usd(ran, now) == pytest.approx(0.01 * 1 + 0.40 * 1 + 15 * 0.02)
    [_, line] = bill([loading, ran], now).lines
    assert (line.rent_usd, line.pull_usd) == (pytest.approx(0.41), pytest.approx(0.30))
    assert line.total_usd == pytest.approx(accrued_usd(ran, now))  # no serving traffic at this profile's rate
