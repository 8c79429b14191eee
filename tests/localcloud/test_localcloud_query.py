"""The search semantics of the local cloud, as pure functions over plain offers."""

import pytest

from fleet.localcloud import catalog, query


def offer(**kw):
    base = {
        "id": 1,
        "machine_id": 10,
        "gpu_ids": [100],
        "gpu_name": "RTX 3090",
        "num_gpus": 1,
        "reliability": 0.99,
        "reliability2": 0.99,
        "cuda_max_good": 12.8,
        "geolocation": "Sweden, SE",
        "direct_port_count": 4,
        "inet_down_cost": 0.01,
        "verification": "verified",
        "external": None,
        "rentable": True,
        "dph_base": 0.2,
        "storage_cost": 0.144,
        "score": 10.0,
    }
    return {**base, **kw}


def test_numbers_sent_as_strings_compare_numerically():
    assert query.matches(offer(), {"reliability": {"gt": "0.98"}, "cuda_max_good": {"gte": "12.8"}})
    assert not query.matches(offer(reliability=0.97), {"reliability": {"gt": "0.98"}})
    assert query.matches(offer(), {"reliability2": {"gte": 0.99}})


def test_geolocation_matches_the_country_suffix():
    assert query.matches(offer(), {"geolocation": {"in": ["DE", "SE"]}})
    assert not query.matches(offer(), {"geolocation": {"notin": ["SE"]}})
    assert query.matches(offer(geolocation="Texas, US"), {"geolocation": {"eq": "US"}})
    assert not query.matches(offer(geolocation=None), {"geolocation": {"in": ["SE"]}})


def test_external_null_matches_the_cli_default_external_false():
    assert query.matches(offer(), {"external": {"eq": False}})


def test_malformed_filters_are_refused():
    with pytest.raises(query.QueryError):
        query.validate_filters({"reliability": {"approx": "0.9"}})
    with pytest.raises(query.QueryError):
        query.validate_filters({"reliability": "0.9"})
    with pytest.raises(query.QueryError):
        query.matches(offer(), {"reliability": {"gt": "high"}})
    with pytest.raises(query.QueryError):
        query.matches(offer(), {"geolocation": {"in": "SE"}})


def test_search_prices_the_allocated_disk_and_orders():
    offers = [offer(id=1, dph_base=0.3, score=5.0), offer(id=2, machine_id=11, gpu_ids=[200], dph_base=0.2)]
    rows = catalog.search(offers, {"order": [["dph_total", "asc"]], "allocated_storage": 100}, {})
    assert [r["id"] for r in rows] == [2, 1]
    assert rows[0]["dph_total"] == pytest.approx(0.2 + 0.144 / 720 * 100)
    assert rows[0]["search"]["totalHour"] == rows[0]["dph_total"]
    by_score = catalog.search(offers, {}, {})
    assert [r["id"] for r in by_score] == [2, 1]  # default order: score desc


def test_search_applies_the_default_limit_of_64():
    offers = [offer(id=i, machine_id=i, gpu_ids=[i]) for i in range(100)]
    assert len(catalog.search(offers, {}, {})) == 64
    assert len(catalog.search(offers, {"limit": 3}, {})) == 3


def test_verified_filter_reads_the_verification_field():
    offers = [offer(id=1), offer(id=2, machine_id=2, gpu_ids=[2], verification="unverified")]
    assert [r["id"] for r in catalog.search(offers, {"verified": {"eq": True}}, {})] == [1]


def test_taken_gpus_mark_overlapping_offers_rented():
    two = offer(id=1, gpu_ids=[100, 101], num_gpus=2)
    one = offer(id=2, gpu_ids=[101])
    other = offer(id=3, machine_id=99, gpu_ids=[101])
    rows = catalog.search([two, one, other], {"rentable": {"eq": True}}, {10: {101}})
    assert [r["id"] for r in rows] == [3]
    # the `rented` filter is ignored, as vast.ai's backend does (vast-cli 52b515c); each row still says it
    rows = catalog.search([two, one, other], {"rented": {"eq": False}}, {10: {101}})
    assert {r["id"]: r["rented"] for r in rows} == {1: True, 2: True, 3: False}


def test_unknown_type_and_bad_order_are_refused():
    with pytest.raises(query.QueryError):
        catalog.search([offer()], {"type": "spot"}, {})
    with pytest.raises(query.QueryError):
        catalog.search([offer()], {"order": [["dph_total", "up"]]}, {})
    with pytest.raises(query.QueryError):
        catalog.search([offer()], ["not", "a", "dict"], {})
