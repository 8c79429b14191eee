"""What a host of a profile loads, by the payload its engine reads (fleet/engines/base.py Payload): how big a
card and a pull it needs, how it is pulled and verified, found again on a standby host's disk, checked on the
card once loaded, and which chat template it carries. GGUF files are planned from their headers and pulled by
key; a repository snapshot from its safetensors headers and config.json, pulled whole.

Callers ask `payload_of(profile)` and never which engine they hold; a new engine that reads one of these
payloads needs nothing here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import asyncssh

from fleet.context import Context
from fleet.core.config import ConfigError, Profile
from fleet.core.models import Host
from fleet.engines.base import Payload
from fleet.engines.registry import engine_of
from fleet.host import ops as hostops
from fleet.host import profile as profiles
from fleet.host import snapshot as snapshots
from fleet.host.profile import CardNeed, file_url, header, hub_token
from fleet.plan.memory import MIB, Plan, card_problem
from fleet.plan.vllm import VllmPlan
from fleet.probes.gpu import GpuSample

# (connections, the phase's limit in seconds, a progress callback (name, done, total), the stall timeout)
PullLimits = tuple[int, float, Callable[[str, int, int], None], float]


class HostPayload(ABC):
    @abstractmethod
    async def card_need(self, ctx: Context, profile: Profile) -> CardNeed:
        """What an offer's card and link must carry for this profile, from its plan."""

    @abstractmethod
    async def plan(
        self, ctx: Context, profile: Profile, ctx_per_slot: int | None, slots: int | None, swa_full: bool | None
    ) -> Plan | VllmPlan:
        """The GPU memory plan, from the payload's headers (no download), at the given context and slots (None:
        the profile's); `swa_full` (llama.cpp's windowed layers keeping the whole context) where it applies."""

    @abstractmethod
    async def pull_bytes(self, ctx: Context, profile: Profile) -> int:
        """What a bring-up downloads of it."""

    @abstractmethod
    async def embedded_template(self, ctx: Context, profile: Profile) -> str | None:
        """The chat template the payload carries itself (None: it has none)."""

    @abstractmethod
    async def pull(
        self, ctx: Context, conn: asyncssh.SSHClientConnection, profile: Profile, limits: PullLimits
    ) -> dict[str, str]:
        """Pull it onto the host and verify it; its paths there by key ("main": what the server loads)."""

    @abstractmethod
    async def kept(self, ctx: Context, conn: asyncssh.SSHClientConnection, profile: Profile) -> dict[str, str]:
        """Its paths on a standby host's kept disk, each found the size it was pulled at."""

    @abstractmethod
    async def card_problem(self, ctx: Context, profile: Profile, samples: list[GpuSample]) -> str | None:
        """What nvidia-smi, with the server loaded, says is wrong against the plan; None when nothing is."""


class GgufFiles(HostPayload):
    async def plan(
        self, ctx: Context, profile: Profile, ctx_per_slot: int | None, slots: int | None, swa_full: bool | None
    ) -> Plan:
        return await profiles.plan(ctx, profile.name, ctx_per_slot, slots, swa_full)

    async def card_need(self, ctx: Context, profile: Profile) -> CardNeed:
        found = await profiles.plan(ctx, profile.name)
        return CardNeed(found.total_bytes(), found.file_bytes)

    async def pull_bytes(self, ctx: Context, profile: Profile) -> int:
        return (await profiles.plan(ctx, profile.name)).file_bytes

    async def embedded_template(self, ctx: Context, profile: Profile) -> str | None:
        main = next(f for f in profile.files if f.key == "main")
        found = await header(ctx, file_url(ctx, main.repo, main.revision, main.file))
        return found.metadata.get("tokenizer.chat_template")

    async def pull(
        self, ctx: Context, conn: asyncssh.SSHClientConnection, profile: Profile, limits: PullLimits
    ) -> dict[str, str]:
        return await hostops.pull_files(conn, profile, ctx.hub_url, hub_token(ctx), *limits)

    async def kept(self, ctx: Context, conn: asyncssh.SSHClientConnection, profile: Profile) -> dict[str, str]:
        return await hostops.kept_files(conn, profile, ctx.hub_url, hub_token(ctx))

    async def card_problem(self, ctx: Context, profile: Profile, samples: list[GpuSample]) -> str | None:
        total = sum(s.mem_total_mib or 0 for s in samples)
        used = sum(s.mem_used_mib or 0 for s in samples)
        planned = await profiles.plan(ctx, profile.name, slots=profile.slots)  # the host's slots
        return card_problem(planned, total, used)


class RepoSnapshot(HostPayload):
    async def plan(
        self, ctx: Context, profile: Profile, ctx_per_slot: int | None, slots: int | None, swa_full: bool | None
    ) -> VllmPlan:
        if swa_full is not None:
            server = engine_of(profile).server_name
            raise ConfigError(f"--swa-full is llama-server's: {server} keeps a window's tokens alone")
        update = {"ctx_per_slot": ctx_per_slot or profile.ctx_per_slot, "slots": slots or profile.slots}
        return await profiles.vllm_plan(ctx, profile.model_copy(update=update))

    async def card_need(self, ctx: Context, profile: Profile) -> CardNeed:
        planned = await profiles.vllm_plan(ctx, profile)
        return CardNeed(planned.card_bytes_needed(), await self.pull_bytes(ctx, profile))

    async def pull_bytes(self, ctx: Context, profile: Profile) -> int:
        return sum(f.size for f in (await profiles.snapshot(ctx, profile)).files)

    async def embedded_template(self, ctx: Context, profile: Profile) -> str | None:
        return await profiles.repo_template(ctx, profile)

    async def pull(
        self, ctx: Context, conn: asyncssh.SSHClientConnection, profile: Profile, limits: PullLimits
    ) -> dict[str, str]:
        repo = await profiles.snapshot(ctx, profile)
        return await snapshots.pull_snapshot(conn, repo, ctx.hub_url, hub_token(ctx), *limits)

    async def kept(self, ctx: Context, conn: asyncssh.SSHClientConnection, profile: Profile) -> dict[str, str]:
        return await snapshots.kept_snapshot(conn, await profiles.snapshot(ctx, profile))

    async def card_problem(self, ctx: Context, profile: Profile, samples: list[GpuSample]) -> str | None:
        # The server takes its share of the one card it serves from, whatever it needs: its plan says whether
        # that card fits
        card = min(s.mem_total_mib or 0 for s in samples)
        return (await profiles.vllm_plan(ctx, profile)).problem(int(card * MIB))


PAYLOADS: dict[Payload, HostPayload] = {Payload.GGUF_FILES: GgufFiles(), Payload.REPO_SNAPSHOT: RepoSnapshot()}


def payload_of(profile: Profile) -> HostPayload:
    """How a host of this profile gets and checks what its engine loads."""
    return PAYLOADS[engine_of(profile).payload]


async def card_need(ctx: Context, profile: Profile) -> CardNeed:
    """What an offer's card and link must carry for this profile, from its plan."""
    return await payload_of(profile).card_need(ctx, profile)


async def pull_deadline(ctx: Context, host: Host, profile: Profile) -> float:
    """How long the pull may take: timeouts.pull, or longer where the profile's payload needs longer at
    timeouts.pull_speed_share of the link the host's offer advertised (vast.ai: loading "can take hours
    with slow internet")."""
    t = ctx.settings.timeouts
    if host.inet_down_mbps <= 0:
        return t.pull
    size = await payload_of(profile).pull_bytes(ctx, profile)
    return max(t.pull, size / (host.inet_down_mbps * 1e6 / 8 * t.pull_speed_share))
