"""The filter funnel and ranking: pure functions on plain offers."""

import json
import time
from pathlib import Path

from fleet.core.config import Filters, Profile, Traffic
from fleet.economics.offers import Criteria, OfferQuery, effective_price_per_hour, funnel, query_for
from fleet.engines.llama_server import COMPUTE_CAPS
from fleet.localcloud import catalog
from fleet.market import Offer
from fleet.market.search import search_filters

NOW = time.time()


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
        compute_cap=860,
        end_date=NOW + 30 * 86400,
        inet_down_mbps=1000.0,
        cpu_arch="amd64",
        cpu_ram_gb=64.0,
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
CRITERIA = Criteria(
    countries=frozenset({"SE", "DE"}),
    filters=Filters(),
    min_gpu_ram_gb=24,
    compute_caps=COMPUTE_CAPS,
    contract_ends_after=NOW + 48 * 3600,
    min_cpu_ram_gb=10.2,
)


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
        offer(10, gpu_name="Tesla V100", compute_cap=700),  # the image's CUDA build has no sm_70
        offer(11, end_date=NOW + 3 * 3600),  # its contract ends in 3 hours
        offer(12, inet_down_mbps=50.0),  # a 15 GB pull would take 40 minutes
        offer(13, gpu_name="GH200", compute_cap=900, cpu_arch="arm64"),  # the image is amd64
        offer(14, cpu_ram_gb=8.0),  # a share of RAM below the server, its prompt cache and the pull
    ]
    result = funnel(offers, CRITERIA, PROFILE)
    assert [o.id for o in result.passed] == [1]
    assert [count for _, count in result.removed] == [1] * 13
    names = [name for name, _ in result.removed]
    assert names[7].startswith("compute capability 8/8.6/8.9/9/10/12")
    assert names[8] == "CPU amd64 (the image's)"
    assert names[9] == "RAM >= 10.2 GB (the profile's)"
    assert names[10] == "contract runs >= 48 h" and names[11] == "download >= 128 Mbit/s"
    assert result.seen == 14 and result.as_dict()["passed"] == 1


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


def test_the_search_carries_every_filter_and_a_full_answer_says_so():
    query = query_for(CRITERIA, PROFILE)
    assert query.limit == 1000 and not query.pool_only
    assert query.compute_caps == COMPUTE_CAPS and query.min_duration_s == 48 * 3600 and query.cpu_arch == "amd64"
    assert query.min_inet_down_mbps == 128 and query.min_reliability == 0.98 and query.verified_only
    full = funnel([offer(i) for i in range(1, 4)], CRITERIA, PROFILE, OfferQuery(["SE"], limit=3))
    assert full.truncated and full.as_dict()["truncated"] is True
    room = funnel([offer(1)], CRITERIA, PROFILE, OfferQuery(["SE"], limit=3))
    assert not room.truncated
    assert query_for(CRITERIA, PROFILE, pool_only=True).pool_only


def test_the_pull_moves_the_ranking_when_only_the_download_price_differs():
    no_serving_download = PROFILE.model_copy(update={"traffic_gb_per_hour": Traffic(up=10, down=0)})
    dear_download = offer(1, inet_down_usd_per_gb=0.04)
    cheap_download = offer(2, dph_total=offer(1).dph_total, inet_down_usd_per_gb=0.001)
    assert funnel([dear_download, cheap_download], CRITERIA, no_serving_download).passed == [
        dear_download,
        cheap_download,
    ]  # the same effective $/h: the offer id decides
    with_pull = Criteria(**{**CRITERIA.__dict__, "pull_gb": 15.0})  # a bring-up downloads 15 GB
    result = funnel([dear_download, cheap_download], with_pull, no_serving_download)
    assert result.passed == [cheap_download, dear_download]


def test_datacenter_only_asks_the_marketplace_for_datacenter_machines_and_checks_each_again():
    dump = json.loads((Path(__file__).parents[2] / "offers" / "real-vast-a100-sxm4-2026.json").read_text())
    rows = dump["offers"] if isinstance(dump, dict) else dump
    parsed = [Offer.from_raw(row) for row in rows]
    assert sum(o.datacenter for o in parsed) == sum(row.get("hosting_type") == 1 for row in rows) > 0
    strict = Criteria(**{**CRITERIA.__dict__, "filters": Filters(datacenter_only=True)})
    query = query_for(strict, PROFILE)
    assert query.datacenter_only and search_filters(query)["datacenter"] == {"eq": True}
    assert not query_for(CRITERIA, PROFILE).datacenter_only  # off unless asked
    # the local cloud answers that search as vast.ai does: datacenter machines alone
    answered = catalog.search(rows, {"datacenter": {"eq": True}, "limit": 1000}, {})
    assert answered and all(row["hosting_type"] == 1 for row in answered)
    # and fleet checks every offer again: a home machine among the answer is removed and counted
    result = funnel([offer(1, datacenter=True), offer(2, datacenter=False)], strict, PROFILE)
    assert [o.id for o in result.passed] == [1]
    assert ("datacenter (hosting_type 1)", 1) in result.removed


def test_an_engine_that_serves_from_one_card_is_rented_by_one_cards_memory():
    two_halves = offer(1, gpu_ram_mb=49152, num_gpus=2)  # 96 GB between two cards
    one_card = offer(2, gpu_ram_mb=98304)
    needs = Criteria(**{**CRITERIA.__dict__, "min_gpu_ram_gb": 94})
    assert [o.id for o in funnel([two_halves, one_card], needs, PROFILE).passed] == [1, 2]  # llama-server splits
    vllm = Criteria(**{**needs.__dict__, "one_card": True})
    result = funnel([two_halves, one_card], vllm, PROFILE)
    assert [o.id for o in result.passed] == [2] and (
        "GPU memory >= 94.00 GiB (the profile's card; the plan needs 0.00 GiB)",
        1,
    ) in result.removed
    assert query_for(vllm, PROFILE).min_gpu_ram_mb == 94 * 1024 and query_for(needs, PROFILE).min_gpu_ram_mb == 12032


def test_a_profiles_cpu_floors_filter_offers_and_go_with_the_search():
    """Issue 43: llama-server samples every call's token on one thread between the card's passes, so a
    profile may set floors on the host's CPU; vast.ai lists cpu_ghz and cpu_cores_effective on every offer."""
    dump = json.loads((Path(__file__).parents[2] / "offers" / "real-vast-a100-sxm4-2026.json").read_text())
    rows = dump["offers"] if isinstance(dump, dict) else dump
    parsed = [Offer.from_raw(row) for row in rows]
    assert all(
        o.cpu_ghz == row["cpu_ghz"] and o.cpu_cores == row["cpu_cores_effective"]
        for o, row in zip(parsed, rows, strict=True)
    )
    floors = Criteria(**{**CRITERIA.__dict__, "min_cpu_ghz": 2.5, "min_cpu_cores": 8})
    offers = [
        offer(1, cpu_ghz=3.0, cpu_cores=16),
        offer(2, cpu_ghz=2.2, cpu_cores=16),
        offer(3, cpu_ghz=3.5, cpu_cores=4),
    ]
    result = funnel(offers, floors, PROFILE)
    assert [o.id for o in result.passed] == [1]
    assert ("CPU >= 2.5 GHz (the profile's)", 1) in result.removed
    assert ("CPU cores >= 8 (the profile's)", 1) in result.removed
    # an offer that lists no CPU passes no floor, and none is asked for without one
    assert [o.id for o in funnel([offer(4)], floors, PROFILE).passed] == []
    assert [o.id for o in funnel([offer(4)], CRITERIA, PROFILE).passed] == [4]
    asked = search_filters(query_for(floors, PROFILE))
    assert asked["cpu_ghz"] == {"gte": 2.5} and asked["cpu_cores_effective"] == {"gte": 8}
    assert "cpu_ghz" not in search_filters(query_for(CRITERIA, PROFILE))
    # the local cloud answers that search as vast.ai does
    cpu = {k: asked[k] for k in ("cpu_ghz", "cpu_cores_effective")}
    answered = catalog.search(rows, {**cpu, "limit": 1000}, {})
    assert answered and all(r["cpu_ghz"] >= 2.5 and r["cpu_cores_effective"] >= 8 for r in answered)
    assert len(answered) < len(rows)
