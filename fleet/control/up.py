"""`fleet up`: N bring-ups at once, each on the best offer no sibling holds (fleet/host/bringup.py's phases
each), the standby pool drawn on first.

Every call that creates or destroys is recorded as an intent before it is made and as an answer after, so
a process killed at any point leaves a record that `reconcile` can finish: nothing orphaned, nothing bought
twice. The caps are checked with the intent in one transaction. A host that fails a phase is destroyed, its
machine blacklisted, and the next offer is tried; an interrupted `up` destroys what every sibling created
before it lets go of the marketplace.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from fleet.context import Context
from fleet.control import offers
from fleet.control.standby import from_pool
from fleet.core import failpoints
from fleet.core.config import Profile
from fleet.core.models import Host, HostState, utcnow
from fleet.core.record import CapReached
from fleet.economics import offers as offer_rules
from fleet.engines.registry import engine_of
from fleet.host import profile as profiles
from fleet.host import templates
from fleet.host.attempts import AttemptReport, attempt_row, end_attempt
from fleet.host.bringup import BringUp, image_login
from fleet.host.endpoints import publish
from fleet.host.phase import DiskFull, PhaseFailed
from fleet.host.teardown import contained_fail, to_the_end
from fleet.market import AuthError, CreditSpent, Offer, OfferGone


@dataclass(frozen=True)
class UpRequest:
    model: str
    region: str
    count: int = 1
    max_price: float | None = None
    dry_run: bool = False
    # only offers whose effective $/h (price plus the profile's traffic) stays under this (a reprice's bound)
    max_effective_price: float | None = None
    # rank by effective $/h alone, not by the expected cost of a voice-minute (fleet/economics/selection.py)
    by_price: bool = False
    # for the standby pool: brought up and probed, then stopped (STANDBY), never published
    standby: bool = False


@dataclass
class UpResult:
    run_id: str
    ready: list[Host] = field(default_factory=list)
    attempts: list[AttemptReport] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # why a requested host did not come up
    planned: list[Offer] = field(default_factory=list)  # --dry-run: the offers that would be tried


class OfferPicker:
    """Hands each concurrent bring-up the best offer no sibling holds, never the same machine twice."""

    def __init__(self, ranked: list[Offer], excluded_machines: set[int]) -> None:
        self._ranked = ranked
        self._held: set[int] = set(excluded_machines)
        self._lock = asyncio.Lock()

    async def claim(self, tried: set[int]) -> Offer | None:
        async with self._lock:
            for offer in self._ranked:
                if offer.id not in tried and offer.machine_id not in self._held:
                    self._held.add(offer.machine_id)
                    return offer
            return None

    def release(self, offer: Offer) -> None:
        """The machine may be offered again (the offer vanished; the machine itself did nothing wrong)."""
        self._held.discard(offer.machine_id)


def warn_account_env(ctx: Context, names: list[str] | None) -> None:
    """The account's environment variables reach every host it rents, whatever fleet keeps from its hosts: say
    so once per `up` (a Hugging Face token kept there breaks "the token goes to no host")."""
    if names:
        ctx.reporter.info(
            "fleet",
            f"the account's environment variables reach every host it rents ({', '.join(names[:10])}"
            f"{', ...' if len(names) > 10 else ''}): keep no secret there (`vastai delete env-var NAME`)",
        )


async def up(ctx: Context, request: UpRequest) -> UpResult:
    profile = ctx.settings.profile(request.model)
    ctx.settings.region(request.region)
    run_id = secrets.token_hex(4)
    result = UpResult(run_id=run_id)
    await templates.check_template(ctx, profile)
    image_login(ctx.settings.provider)  # a private image's token is at hand before anything is rented
    await check_permissions(ctx)
    try:
        funnel = await offers.search(ctx, request.model, request.region, request.max_price, exclude_unusable=True)
    except AuthError as e:
        raise await explain_refusal(ctx, e) from None
    ranked = [offer for offer, _ in offers.rank(ctx, profile, funnel.passed, request.by_price, funnel.pull_gb)]
    if request.dry_run:
        result.planned = ranked[: max(request.count, 1) * ctx.settings.up.max_attempts]
        return result
    async with ctx.waits.on("market"):
        try:
            credit = await ctx.market.credit()
        except AuthError as e:
            raise await explain_refusal(ctx, e) from None
        if credit is not None and credit <= 0:
            raise CreditSpent(
                f"the account's credit is spent (${credit:.2f}): vast.ai rents nothing and stops every instance "
                "until it is topped up; nothing was created"
            )
        warn_account_env(ctx, await ctx.market.account_env_names())
        try:
            await ctx.market.ensure_ssh_key(ctx.ssh_key.public)
        except AuthError as e:
            # a scoped key without user_write (POST /ssh/) may still attach a key to an instance it made
            ctx.key_per_instance = True
            ctx.reporter.info(
                "fleet",
                f"the API key may not add an SSH key to the account (it needs user_write: {e}); "
                "fleet's key goes to each instance instead (instance_write)",
            )
    if request.max_effective_price is not None:
        cap = request.max_effective_price
        ranked = [o for o in ranked if offer_rules.effective_price_per_hour(o, profile) <= cap]
    picker = OfferPicker(ranked, set())
    tasks = [
        asyncio.get_running_loop().create_task(bring_up_one(ctx, run_id, profile, request, picker, result))
        for _ in range(request.count)
    ]
    try:
        outcomes = await asyncio.gather(*tasks)
    except BaseException:
        # Interrupted: every sibling destroys what it created before this returns (and the market closes).
        for task in tasks:
            task.cancel()
        await to_the_end(asyncio.gather(*tasks, return_exceptions=True))
        raise
    for outcome in outcomes:
        if isinstance(outcome, Host):
            result.ready.append(outcome)
        else:
            result.failures.append(outcome)
    return result


async def bring_up_one(
    ctx: Context, run_id: str, profile: Profile, request: UpRequest, picker: OfferPicker, result: UpResult
) -> Host | str:
    if not request.standby:
        resumed = await from_pool(
            ctx, run_id, profile, request.region, request.max_price, request.max_effective_price, result.attempts
        )
        if resumed is not None:
            return resumed
    tried: set[int] = set()
    filled: set[int] = set()  # machines whose disk filled: two say it is the profile's
    last_reason = "no offer passed the filters"
    for _ in range(ctx.settings.up.max_attempts):
        offer = await picker.claim(tried)
        if offer is None:
            return f"no offer left to try ({last_reason})"
        tried.add(offer.id)
        started = time.monotonic()
        # the slots this card holds (the profile's, or with fill_card as many as its plan fits there)
        card_mb = offer.gpu_ram_mb * max(offer.num_gpus, 1)
        on_card = profiles.sized(profile, await profiles.slots_for(ctx, profile, card_mb))
        try:
            host = await intent_to_create(ctx, run_id, on_card, request, offer)
        except CapReached as e:
            picker.release(offer)
            return str(e)
        report = AttemptReport.of(host)
        result.attempts.append(report)
        try:
            await BringUp(ctx, host, on_card, offer, standby=request.standby).run()
            end_attempt(ctx, host, None, None)
            await publish(ctx)
            if request.standby:
                disk = f"${host.storage_usd_per_hour:.4f}/h for its disk"
                ctx.reporter.info(host.name, f"STANDBY: stopped with its weights ({disk})")
            else:
                ctx.reporter.info(host.name, f"READY at {host.api_url} (${host.dph_total:.4f}/h)")
            report.seconds = time.monotonic() - started
            return host
        except OfferGone as e:
            picker.release(offer)
            report.outcome, report.phase, report.reason = "failed", "create", f"offer gone: {e}"
            end_attempt(ctx, host, "create", report.reason)
            ctx.record.close(host, HostState.DESTROYED, 0.0, failed_phase="create", failure_reason=report.reason)
        except PhaseFailed as e:
            report.outcome, report.phase, report.reason = "failed", e.phase, e.reason
            if not await contained_fail(ctx, host, e.phase, e.reason, e.blacklist):
                report.seconds = time.monotonic() - started
                return f"stopped: the instance of {host.name} could not be destroyed; `fleet reconcile` will"
            if isinstance(e, DiskFull):
                filled.add(offer.machine_id)
            if not e.retry or len(filled) >= 2:
                report.seconds = time.monotonic() - started
                alike = " (the disks of two machines filled alike)" if len(filled) >= 2 else ""
                return f"stopped: {e.phase}: {e.reason}{alike}"
        except Exception as e:  # anything else: this host's instance goes, its siblings carry on
            report.outcome, report.phase, report.reason = "failed", host.state, f"{type(e).__name__}: {e}"
            await contained_fail(ctx, host, host.state, report.reason, False)
            report.seconds = time.monotonic() - started
            return f"stopped after an unexpected error: {report.reason}"
        except BaseException:
            await to_the_end(contained_fail(ctx, host, host.state, "interrupted", False))
            raise
        report.seconds = time.monotonic() - started
        last_reason = report.reason or last_reason
        ctx.reporter.info(host.name, f"failed in {report.phase}: {report.reason}; trying the next offer")
    return f"gave up after {ctx.settings.up.max_attempts} attempts (last: {last_reason})"


async def check_permissions(ctx: Context) -> None:
    """Once a process, before anything is rented: the key may read its instances (a create it could not watch
    would leak). Searching and reading the credit prove `misc` and `user_read` as they run; an AuthError from
    either is explained by `explain_refusal`, so a good key costs one read, not a probe of each."""
    if ctx.permissions_checked:
        return
    async with ctx.waits.on("market"):
        missing = await ctx.market.missing_permissions(only=("instance_read",))
    if missing:
        raise lacking(missing)
    ctx.permissions_checked = True


async def explain_refusal(ctx: Context, refused: AuthError) -> AuthError:
    """One line naming every permission the key lacks (a scoped key's search fails without `misc`, which the
    permissions page lists apart from the instance ones), or the marketplace's own words if it lacks none."""
    async with ctx.waits.on("market"):
        missing = await ctx.market.missing_permissions()
    return lacking(missing) if missing else refused


def lacking(missing: dict[str, str]) -> AuthError:
    lacks = "; ".join(f"{name} ({why})" for name, why in missing.items())
    return AuthError(
        f"the API key lacks {lacks}: give it misc, instance_read, instance_write and user_read (user_write too,"
        " to register fleet's SSH key on the account); nothing was created"
    )


async def intent_to_create(ctx: Context, run_id: str, profile: Profile, request: UpRequest, offer: Offer) -> Host:
    """Check the caps and write the host row (owned by this process) before the create call, in one
    transaction no other process can interleave (Record.reserve)."""
    caps = ctx.settings.caps

    def check(open_hosts: list[Host]) -> None:
        same_model = [h for h in open_hosts if h.model == profile.name]
        spend = sum(h.storage_usd_per_hour if h.state == HostState.STANDBY else h.dph_total for h in open_hosts)
        if len(open_hosts) + 1 > caps.max_hosts_total:
            raise CapReached(
                f"cap reached: {len(open_hosts)} live hosts, caps.max_hosts_total = {caps.max_hosts_total}"
            )
        if len(same_model) + 1 > caps.max_hosts_per_model:
            raise CapReached(
                f"cap reached: {len(same_model)} live {profile.name} hosts, "
                f"caps.max_hosts_per_model = {caps.max_hosts_per_model}"
            )
        if spend + offer.dph_total > caps.max_usd_per_hour:
            raise CapReached(
                f"cap reached: ${spend:.3f}/h live + ${offer.dph_total:.3f}/h would exceed "
                f"caps.max_usd_per_hour = {caps.max_usd_per_hour}"
            )

    name = f"{profile.name}-{request.region}-{secrets.token_hex(3)}"
    host = Host(
        name=name,
        run_id=run_id,
        model=profile.name,
        region=request.region,
        state=HostState.CREATING,
        provider_url=ctx.market.url,
        label=f"{ctx.label_prefix}{name}",
        offer_id=offer.id,
        machine_id=offer.machine_id,
        gpu_name=offer.gpu_name,
        num_gpus=offer.num_gpus,
        gpu_ram_mb=offer.gpu_ram_mb,
        geolocation=offer.geolocation,
        dph_total=offer.dph_total,
        inet_up_usd_per_gb=offer.inet_up_usd_per_gb,
        inet_down_usd_per_gb=offer.inet_down_usd_per_gb,
        effective_usd_per_hour=offer_rules.effective_price_per_hour(offer, profile),
        storage_usd_per_hour=offer_rules.storage_price_per_hour(offer),
        contract_end_at=datetime.fromtimestamp(offer.end_date, UTC) if offer.end_date else None,
        inet_down_mbps=offer.inet_down_mbps,
        image_bytes=int(engine_of(profile).image_gb(ctx.settings.provider) * 1e9),
        slots=profile.slots,
        owner=ctx.owner,
        lease_until=utcnow() + timedelta(seconds=ctx.settings.up.lease_s),
    )
    ctx.record.reserve(host, attempt_row(run_id, host), check)
    ctx.leases.claim(host)  # starts the lease renewal
    failpoints.reach("after_intent")
    return host
