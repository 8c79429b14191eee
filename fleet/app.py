"""The library's one object: a Fleet is a Context (fleet/context.py) with the verbs of the commands as
methods, each one call into the controller or host step that does it. The CLI, the tests and scripts use
it; the controllers themselves only ever take a Context."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import fleet.control.destroy
import fleet.control.gateway
import fleet.control.offers
import fleet.control.reconcile
import fleet.control.sizing
import fleet.control.status
import fleet.control.up
import fleet.host.endpoints
import fleet.host.measure
import fleet.host.payloads
import fleet.host.profile
import fleet.host.teardown
import fleet.host.templates
from fleet.context import Context, Reporter, open_context
from fleet.control.destroy import DestroyReport
from fleet.control.up import UpRequest, UpResult
from fleet.core import installrecord
from fleet.core.config import Profile
from fleet.core.models import Host
from fleet.economics import offers as offer_rules
from fleet.economics.machines import MachineRecord
from fleet.economics.report import Session
from fleet.economics.selection import Expectation
from fleet.host.measure import BenchOptions, BenchReport
from fleet.market import Offer
from fleet.plan.memory import Plan
from fleet.plan.vllm import VllmPlan
from fleet.probes import ProbeResult
from fleet.probes.renderings import Renderings


class Fleet(Context):
    async def plan(
        self, model: str, ctx_per_slot: int | None = None, slots: int | None = None, swa_full: bool | None = None
    ) -> Plan:
        return await fleet.host.profile.plan(self, model, ctx_per_slot, slots, swa_full)

    async def card_plan(
        self, model: str, ctx_per_slot: int | None = None, slots: int | None = None, swa_full: bool | None = None
    ) -> Plan | VllmPlan:
        """The plan of what the model's engine loads: GGUF files' (`plan`), or a repository snapshot's."""
        profile = self.settings.profile(model)
        return await fleet.host.payloads.payload_of(profile).plan(self, profile, ctx_per_slot, slots, swa_full)

    async def check_template(self, model: Profile) -> Renderings | None:
        return await fleet.host.templates.check_template(self, model)

    async def offers(
        self,
        model: str,
        region: str,
        max_price: float | None = None,
        exclude_unusable: bool = False,
        record_seen: bool = True,
        explain: bool = False,
    ) -> offer_rules.Funnel:
        return await fleet.control.offers.search(self, model, region, max_price, exclude_unusable, record_seen, explain)

    def rank(
        self, model: Profile, found: list[Offer], by_price: bool = False, pull_gb: float = 0.0
    ) -> list[tuple[Offer, Expectation]]:
        return fleet.control.offers.rank(self, model, found, by_price, pull_gb)

    async def up(self, request: UpRequest) -> UpResult:
        return await fleet.control.up.up(self, request)

    async def probe(self, name: str, only: list[str] | None = None, plot_path: Path | None = None) -> list[ProbeResult]:
        return await fleet.host.measure.probe(self, name, only, plot_path)

    async def bench(self, name: str, options: BenchOptions | None = None, **fields: Any) -> BenchReport:
        """`fleet bench`: `options`, or the BenchOptions its `fields` make."""
        return await fleet.host.measure.bench(self, name, options or BenchOptions(**fields))

    def blacklist_machine(self, host: Host, phase: str, reason: str) -> None:
        fleet.host.teardown.blacklist_machine(self, host, phase, reason)

    def endpoints(self) -> list[dict[str, Any]]:
        return fleet.host.endpoints.endpoints(self)

    def pause_serving(self, paused: bool) -> datetime | None:
        return installrecord.pause_serving(self.record, paused)

    async def destroy(self, names: list[str] | None, keep_gateway: bool = False) -> DestroyReport:
        return await fleet.control.destroy.destroy(self, names, keep_gateway)

    def status(self, include_ended: bool = False) -> list[dict[str, Any]]:
        return fleet.control.status.status(self, include_ended)

    def machines(self) -> list[MachineRecord]:
        return fleet.control.status.machines(self)

    def session(self, since: datetime) -> Session:
        sizings = [fleet.control.sizing.observe(self, target) for target in self.settings.serve]
        return fleet.control.status.session(self, since, sizings)

    async def reconcile(self) -> dict[str, Any]:
        return await fleet.control.reconcile.reconcile(self)


@asynccontextmanager
async def open_fleet(settings: Any, reporter: Reporter | None = None) -> AsyncIterator[Fleet]:
    """A Fleet for these settings (fleet.toml's), closed with everything it opened."""
    async with open_context(settings, reporter, Fleet) as opened:
        fleet.control.gateway.hang(opened)
        yield opened
