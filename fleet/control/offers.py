"""The offers a bring-up may rent: searched with every filter the profile and region imply, each filter
re-checked here (economics/offers.py's funnel), what was seen recorded, and ranked by what fleet expects
of each machine (economics/selection.py)."""

from __future__ import annotations

import time

from fleet.context import Context
from fleet.control.status import machines
from fleet.core.config import Profile
from fleet.core.errors import BadInput
from fleet.core.models import LIVE_STATES, OfferSeen, utcnow
from fleet.economics import offers as offer_rules
from fleet.economics import selection
from fleet.economics.selection import Expectation
from fleet.engines.registry import engine_of
from fleet.host import payloads
from fleet.host import profile as profiles
from fleet.market import Offer
from fleet.plan.memory import GIB


def criteria(
    ctx: Context,
    profile: Profile,
    region: str,
    max_price: float | None,
    excluded: set[int] | None = None,
    need: profiles.CardNeed | None = None,
) -> offer_rules.Criteria:
    plan_gib = need.card_bytes / GIB if need else 0.0
    provider = ctx.settings.provider
    engine = engine_of(profile)
    return offer_rules.Criteria(
        countries=frozenset(ctx.settings.region(region)),
        filters=ctx.settings.filters,
        min_gpu_ram_gb=max(profile.gpu_ram_gb * 0.97, plan_gib),  # a "24 GB" card reports 23.99 GiB
        plan_gib=plan_gib,
        max_usd_per_hour=max_price,
        excluded_machines=frozenset(excluded or ()),
        # the image's builds, narrowed by the profile (NVFP4 wants Blackwell's own)
        compute_caps=tuple(c for c in engine.compute_caps if not profile.compute_caps or c in profile.compute_caps),
        contract_ends_after=time.time() + ctx.settings.filters.min_contract_hours * 3600,
        # every bring-up downloads the image and the profile's files, at the offer's $/GB
        pull_gb=(need.pull_bytes / offer_rules.GB if need else 0.0) + engine.image_gb(provider),
        one_card=engine.one_card,
        cpu_arch=provider.image_arch,
        min_cpu_ram_gb=engine.host_ram_gb(profile),
        min_cpu_ghz=profile.min_cpu_ghz,
        min_cpu_cores=profile.min_cpu_cores,
    )


DISK_SPARE = 1.1  # the image and the weights with a tenth to spare: logs, the server's files, a partial download


def disk_problem(profile: Profile, need: profiles.CardNeed, image_gb: float) -> str | None:
    """Why the profile's disk cannot hold a host, or None. vast.ai's allocation holds the image as well as what the
    host pulls, and cannot grow after create: a disk too small pulls the image (billed), then fails the weights
    with "No space left on device" on every machine."""
    weights_gb = need.pull_bytes / offer_rules.GB
    needed = (image_gb + weights_gb) * DISK_SPARE
    if profile.disk_gb >= needed:
        return None
    return (
        f"models.{profile.name}.disk_gb = {profile.disk_gb:g} is less than the image ({image_gb:g} GB) and the "
        f"weights ({weights_gb:.1f} GB) with a tenth to spare ({needed:.1f} GB): vast.ai's disk holds the image "
        "too, and cannot grow after create"
    )


async def search(
    ctx: Context,
    model: str,
    region: str,
    max_price: float | None = None,
    exclude_unusable: bool = False,
    record_seen: bool = True,
    explain: bool = False,
) -> offer_rules.Funnel:
    """Search with every filter the marketplace understands, re-check each here, rank by expected $/h;
    record what was seen (unless a dry run asks to write nothing). `explain`: ask for the region and the
    card alone, so that the funnel counts what each filter removes."""
    profile = ctx.settings.profile(model)
    excluded = unusable_machines(ctx) if exclude_unusable else set()
    need = await payloads.card_need(ctx, profile)
    if problem := disk_problem(profile, need, engine_of(profile).image_gb(ctx.settings.provider)):
        raise BadInput(problem)
    wanted = criteria(ctx, profile, region, max_price, excluded, need)
    query = offer_rules.query_for(wanted, profile, pool_only=explain)
    async with ctx.waits.on("market"):
        found = await ctx.market.search(query)
    if record_seen:  # one transaction for the whole answer (up to a thousand offers), not one an offer
        ctx.record.add_all([seen(ctx.market.url, o) for o in found])
    result = offer_rules.funnel(found, wanted, profile, query)
    # a machine its host will take down for maintenance before a host there has served its time: not rented
    async with ctx.waits.on("market"):
        windows = await ctx.market.maintenances(sorted({o.machine_id for o in result.passed}))
    return offer_rules.without_maintenance(result, windows, wanted.contract_ends_after)


def seen(provider_url: str, offer: Offer) -> OfferSeen:
    return OfferSeen(
        provider_url=provider_url,
        offer_id=offer.id,
        machine_id=offer.machine_id,
        gpu_name=offer.gpu_name,
        num_gpus=offer.num_gpus,
        geolocation=offer.geolocation,
        dph_total=offer.dph_total,
        inet_up_usd_per_gb=offer.inet_up_usd_per_gb,
        inet_down_usd_per_gb=offer.inet_down_usd_per_gb,
        reliability=offer.reliability,
    )


def unusable_machines(ctx: Context) -> set[int]:
    """Machines a new host may not go to: one of ours runs there, or it is blacklisted."""
    live = {h.machine_id for h in ctx.record.hosts(states=LIVE_STATES)}
    return live | ctx.record.blacklisted_machines(ctx.market.url, utcnow())


def rank(
    ctx: Context, profile: Profile, offers: list[Offer], by_price: bool = False, pull_gb: float = 0.0
) -> list[tuple[Offer, Expectation]]:
    """The offers with what fleet expects of each (economics/selection.py), best expected $/voice-minute
    first; `by_price` keeps the expected $/h order. `pull_gb`: what a bring-up downloads (the funnel's)."""
    known = {(m.provider_url, m.machine_id): m for m in machines(ctx)}
    if by_price:
        return [(o, selection.expect(o, profile, known, ctx.market.url, pull_gb)) for o in offers]
    return selection.rank(offers, profile, known, ctx.market.url, pull_gb)
