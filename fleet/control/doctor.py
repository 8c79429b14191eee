"""`fleet doctor --live`: what no source settles about vast.ai, read once with the user's own key.

fleet's readings of vast.ai come from its documents, its CLI and SDK, and other projects' code
(docs/vast-fidelity.md); where those disagree or say nothing, fleet takes the harder reading. This check asks
the marketplace itself: it reads the account's answer, the search's `rented` filter and the maintenance
windows as a renter, then rents the cheapest offer it can afford within the budget, with the image fleet
boots, and watches it: how long a new instance's reads lag its create, whether an SSH key attaches at once,
what `status_msg` says of a digest-pinned image, which statuses the listing shows, and whether a host's
key, announced on its console by onstart, reaches the instance's logs (fleet pins it from there). The instance
is destroyed on every path, Ctrl-C included, and the report says what it cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import signal
import time
from dataclasses import asdict, dataclass, field

from fleet.context import Context
from fleet.core.errors import BadInput
from fleet.engines.registry import engine_of
from fleet.host import hostkey
from fleet.host.bringup import image_login
from fleet.market import CreateFailed, InstanceSpec, MarketError, NotFound, Offer, OfferQuery

LABEL = "fleet-doctor"
WATCH_MAX_S = 900.0  # the longest an instance is held, whatever the budget allows
DISK_GB = 16.0
CALL_S = 40.0  # the longest one call of the destroy may take, 429s waited out included


@dataclass(frozen=True)
class Finding:
    name: str
    assumption: str  # what fleet assumes, in a line
    held: bool | None  # None: the run could not tell
    seen: str  # what the marketplace did

    def line(self) -> str:
        verdict = {True: "held", False: "DID NOT HOLD", None: "unknown"}[self.held]
        return f"{self.name}: {verdict}: {self.seen}"


@dataclass
class DoctorReport:
    findings: list[Finding] = field(default_factory=list)
    offer_id: int | None = None
    instance_id: int | None = None
    held_s: float = 0.0
    cost_usd: float = 0.0  # at most: the offer's $/h over the time the instance existed, its disk included
    destroyed: bool = True
    interrupted: bool = False  # Ctrl-C ended the watch (the rental destroyed all the same)

    def as_dict(self) -> dict:
        return {**asdict(self), "findings": [asdict(f) for f in self.findings]}


async def live(ctx: Context, budget_usd: float, profile_name: str) -> DoctorReport:
    """Every check, the rental's last; the instance it made is destroyed before this returns or raises."""
    if not math.isfinite(budget_usd) or budget_usd <= 0:
        raise BadInput("--budget-usd must be a positive number of dollars")
    profile = ctx.settings.profile(profile_name)
    report = DoctorReport()
    report.findings.append(await _account(ctx))
    report.findings.append(await _rented_filter(ctx))
    countries = sorted({c for region in ctx.settings.regions.values() for c in region})
    query = OfferQuery(countries, limit=64, allocated_disk_gb=DISK_GB, cpu_arch=ctx.settings.provider.image_arch)
    offers = await ctx.market.search(query)
    report.findings.append(await _maintenances(ctx, [o.machine_id for o in offers][:20]))
    offer = _affordable(offers, budget_usd)
    if offer is None:
        cheapest = min((o.dph_total for o in offers), default=None)
        least = "none" if cheapest is None else f"${cheapest:.3f}/h"
        seen = f"no offer affordable for 5 minutes within ${budget_usd:.2f} (cheapest: {least})"
        report.findings.append(Finding("rental", "an instance can be rented and watched", None, seen))
        return report
    report.offer_id = offer.id
    watch_s = min(WATCH_MAX_S, budget_usd / offer.dph_total * 3600.0)
    image = engine_of(profile).image(ctx.settings.provider)
    await _rent_and_watch(ctx, report, offer, image, watch_s)
    return report


def _affordable(offers: list[Offer], budget_usd: float) -> Offer | None:
    """The cheapest offer whose five minutes fit the budget."""
    fits = [o for o in offers if o.dph_total > 0 and o.dph_total * 5 / 60 <= budget_usd]
    return min(fits, key=lambda o: o.dph_total, default=None)


async def _account(ctx: Context) -> Finding:
    fields = await ctx.market.account_fields()
    named = [f for f in ("credit", "balance") if f in fields]
    return Finding(
        "account_credit",
        "users/current names the credit left as `credit`, else `balance`",
        bool(named),
        f"fields: {', '.join(fields) or 'none'}",
    )


async def _rented_filter(ctx: Context) -> Finding:
    applies = await ctx.market.rented_filter_applies()
    seen = {
        True: "every offer answered for rented=true was rented",
        False: "offers not rented were answered",
        None: "no offer answered",
    }[applies]
    # fleet never relies on it (it asks rentable=true as well): the reading is recorded
    held = None if applies is None else not applies
    return Finding("search_rented_filter", "the search ignores `rented` (fleet asks `rentable` too)", held, seen)


async def _maintenances(ctx: Context, machine_ids: list[int]) -> Finding:
    windows = await ctx.market.maintenances(sorted(set(machine_ids))) if machine_ids else None
    seen = "refused or unreadable: fleet goes on without them" if windows is None else f"answered {len(windows)}"
    return Finding("maintenances_as_renter", "a renter's key may not read maintenance windows", windows is None, seen)


async def _rent_and_watch(ctx: Context, report: DoctorReport, offer: Offer, image: str, watch_s: float) -> None:
    token = secrets.token_hex(8)
    spec = InstanceSpec(
        image=image,
        disk_gb=DISK_GB,
        # the install's prefix: were this process killed, `fleet reconcile` (the daemon's too) destroys it as a stray
        label=f"{ctx.label_prefix}{LABEL}-{token}",
        env={},
        ports=[],
        onstart=hostkey.onstart(),  # a fleet host's own: its key announced as fleet reads it
        image_login=image_login(ctx.settings.provider),
    )
    ctx.reporter.info(LABEL, f"renting offer {offer.id} (${offer.dph_total:.3f}/h) for at most {watch_s:.0f} s")
    created = time.monotonic()
    try:
        instance_id = await ctx.market.create(offer.id, spec)
    except CreateFailed as e:
        if e.new_contract is None:
            raise
        instance_id = e.new_contract  # vast.ai may make the contract all the same: it is destroyed below
        report.findings.append(Finding("create", "a create that answers an error may have made its contract",
                                       True, f"{e}; contract {instance_id}"[:300]))  # fmt: skip
    report.instance_id = instance_id
    report.destroyed = False
    # Ctrl-C ends the watch between two reads, and the rental is destroyed as on any other path: a cancellation
    # landing anywhere in the market's pacing (a turn claimed, never given back) could hold the destroy up
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, stop.set)
        caught = True
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread: Ctrl-C cancels as usual
        caught = False
    try:
        await _watch(ctx, report, instance_id, watch_s, stop)
    finally:
        if caught:
            loop.remove_signal_handler(signal.SIGINT)
        await asyncio.shield(_destroy(ctx, report, instance_id, created, offer))
    report.interrupted = stop.is_set()


async def _watch(ctx: Context, report: DoctorReport, instance_id: int, watch_s: float, stop: asyncio.Event) -> None:
    started = time.monotonic()
    held, seen = True, "attached"
    try:
        await ctx.market.attach_ssh_key(instance_id, ctx.ssh_key.public)
    except NotFound as e:  # what fleet's bring-up expects, and waits out
        seen = f"not found yet: {e}"
    except MarketError as e:
        held, seen = False, f"{type(e).__name__}: {e}"
    report.findings.append(
        Finding("attach_key_after_create", "a key attached at once may meet a not-found", held, seen[:200])
    )
    visible_s: float | None = None
    statuses: list[str] = []
    messages: list[str] = []
    running = False
    deadline = started + watch_s
    while time.monotonic() < deadline and not stop.is_set():
        instance = await ctx.market.get(instance_id)
        if instance is not None:
            if visible_s is None:
                visible_s = time.monotonic() - started
            status = instance.status or "null"
            if status not in statuses:
                statuses.append(status)
            if instance.status_msg and instance.status_msg not in messages:
                messages.append(instance.status_msg[:200])
            if status == "running":
                running = True
                break
            if instance.image_error() or instance.boot_error() or instance.down:
                break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 3.0)
    lag = "never readable" if visible_s is None else f"readable after {visible_s:.1f} s"
    report.findings.append(
        Finding("reads_lag_create", "a new instance may be unreadable after its create", visible_s is not None, lag)
    )
    path = " -> ".join(statuses) or "none"
    said = " | ".join(messages) or "none"
    report.findings.append(
        Finding(
            "image_pulls",
            "the image, pinned as fleet pins it, pulls and runs",
            running,
            f"statuses {path}; status_msg: {said}"[:400],
        )
    )
    report.findings.append(
        Finding(
            "listing_offline",
            "a running instance may read `offline` or `unknown` for a while",
            None,
            f"statuses seen: {', '.join(statuses) or 'none'}",
        )
    )
    logs_finding = "a host's key, announced on its console by onstart, reaches the instance's logs"
    if not running or stop.is_set():
        report.findings.append(Finding("host_key_in_logs", logs_finding, None, "the instance never ran"))
        return
    await asyncio.sleep(5.0)  # onstart runs once the container is up
    text = await ctx.market.logs(instance_id, tail=hostkey.LOG_LINES)
    keys = hostkey.announced(text or "")
    seen = "no logs answered" if text is None else (f"announced: {keys[0]}" if keys else "no key announced")
    report.findings.append(Finding("host_key_in_logs", logs_finding, None if text is None else bool(keys), seen))


async def _destroy(ctx: Context, report: DoctorReport, instance_id: int, created: float, offer: Offer) -> None:
    """Destroy, confirm the instance gone, and count what it cost at most."""
    deadline = time.monotonic() + 120.0
    destroyed = False  # a destroy answered that it destroyed it: inside the create's lag, "no such" is no proof
    while True:
        try:
            # each call bounded: a marketplace refusing calls (429s) must not hold a Ctrl-C past the deadline
            destroyed = await asyncio.wait_for(ctx.market.destroy(instance_id), CALL_S) or destroyed
            known = destroyed or time.monotonic() - created >= ctx.settings.timeouts.instance_visible
            if known and await asyncio.wait_for(ctx.market.get(instance_id), CALL_S) is None:
                report.destroyed = True
                break
        except (MarketError, TimeoutError) as e:
            ctx.reporter.info(LABEL, f"destroy of instance {instance_id}: {e or 'no answer'}; trying again")
        if time.monotonic() > deadline:
            ctx.reporter.info(LABEL, f"instance {instance_id} NOT confirmed destroyed: destroy it by hand")
            break
        await asyncio.sleep(3.0)
    report.held_s = time.monotonic() - created
    report.cost_usd = offer.dph_total * report.held_s / 3600.0
