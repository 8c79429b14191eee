"""The filter funnel and ranking: pure functions on plain offers."""

from fleet.core.config import Filters, Profile
from fleet.economics.offers import Criteria, effective_price_per_hour, funnel
from fleet.market import Offer


def offer(i: int, **kw) -> Offer:
    base = dict(
        id=i,
        machine_id=100 + i,
        gpu_name="RTX 3090",
        num_gpus=1,
        gpu_ram_mb=24576,
        geolocation="Sweden, SE",
        dph_total=0.2 + i / 100,
        inet_up_usd_per_gb=0.01,
        inet_down_usd_per_gb=0.01,
        reliability=0.99,
        cuda_max_good=12.8,
        disk_space_gb=200,
        direct_port_count=4,
        verified=True,
    )
    return Offer(**{**base, **kw})


PROFILE = Profile(
    name="p",
    gpu_ram_gb=24,
    disk_gb=20,
    slots=1,
    ctx_per_slot=4096,
    traffic_gb_per_hour={"up": 10, "down": 1},
    files=[{"key": "main", "repo": "a/b", "file": "m.gguf"}],
)
CRITERIA = Criteria(countries=frozenset({"SE", "DE"}), filters=Filters(), min_gpu_ram_gb=24)


def test_each_filter_removes_its_offer_and_says_so():
    offers = [
        offer(1),
        offer(2, geolocation="Texas, US"),
        offer(3, reliability=0.98),  # not strictly greater
        offer(4, cuda_max_good=12.4),
        offer(5, disk_space_gb=99),
        offer(6, direct_port_count=1),
        offer(7, inet_up_usd_per_gb=0.06),
        offer(8, verified=False),
        offer(9, gpu_ram_mb=16384),
    ]
    result = funnel(offers, CRITERIA, PROFILE)
    assert [o.id for o in result.passed] == [1]
    assert [count for _, count in result.removed] == [1, 1, 1, 1, 1, 1, 1, 1]
    assert result.seen == 9 and result.as_dict()["passed"] == 1


def test_ranking_is_by_effective_price_including_traffic():
    cheap_but_costly_traffic = offer(1, dph_total=0.20, inet_up_usd_per_gb=0.05)
    dearer_but_free_traffic = offer(2, dph_total=0.30, inet_up_usd_per_gb=0.0, inet_down_usd_per_gb=0.0)
    assert effective_price_per_hour(cheap_but_costly_traffic, PROFILE) == 0.20 + 10 * 0.05 + 1 * 0.01
    result = funnel([cheap_but_costly_traffic, dearer_but_free_traffic], CRITERIA, PROFILE)
    assert [o.id for o in result.passed] == [2, 1]


def test_excluded_machines_and_price_cap():
    criteria = Criteria(
        countries=frozenset({"SE"}),
        filters=Filters(),
        min_gpu_ram_gb=0,
        max_usd_per_hour=0.25,
        excluded_machines=frozenset({101}),
    )
    result = funnel([offer(1), offer(2), offer(9)], criteria, PROFILE)
    assert [o.id for o in result.passed] == [2]
    assert ("machine blacklisted or taken", 1) in result.removed


def test_empty_input_gives_an_empty_explained_funnel():
    result = funnel([], CRITERIA, PROFILE)
    assert result.passed == [] and result.seen == 0 and all(c == 0 for _, c in result.removed)
