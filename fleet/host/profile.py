"""What a profile resolves to for its hosts: where its files are, their GGUF headers (read over HTTP
ranges, once per process) or its repository's listing and chat template, the GPU memory plan they imply, and
the slots a host's card holds. fleet/host/payloads.py puts these to work by the payload the engine loads."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from fleet.context import Context
from fleet.core import paths
from fleet.core.config import Profile
from fleet.engines.registry import engine_of
from fleet.plan import gguf, hfconfig, safetensors
from fleet.plan import snapshot as snapshots
from fleet.plan.gguf import GgufHeader
from fleet.plan.memory import MIB, Plan, PlanSettings, cache_settings_from_args, make_plan
from fleet.plan.snapshot import Snapshot
from fleet.plan.vllm import VllmPlan, VllmSettings


def file_url(ctx: Context, repo: str, revision: str, filename: str) -> str:
    return f"{ctx.hub_url}/{repo}/resolve/{revision}/{filename}"


async def header(ctx: Context, url: str) -> GgufHeader:
    """The GGUF header at `url`: kept for the process, and on disk by the file's sha256 (a 16 MB header is
    read from the hub once per machine, not once per command)."""
    if url not in ctx.headers:
        token = os.environ.get(ctx.settings.hub.token_env, "")
        name = url.rsplit("/", 1)[-1]

        def progress(done: int) -> None:
            if done > gguf.FIRST_RANGE:
                ctx.reporter.info("plan", f"reading {name}'s GGUF header: {done / 1e6:.1f} MB so far")

        async with ctx.waits.on("hub"):
            ctx.headers[url] = await gguf.read_url(
                url,
                {"Authorization": f"Bearer {token}"} if token else None,
                cache=paths.cache_dir() / "gguf-headers",
                progress=progress,
            )
    return ctx.headers[url]


@dataclass(frozen=True)
class CardNeed:
    card_bytes: int  # the smallest card the profile's plan fits
    pull_bytes: int  # what a bring-up downloads


# llama.cpp's LLAMA_MAX_SEQ: the most sequences (slots) a context holds
MOST_SLOTS = 256


def sized(profile: Profile, slots: int) -> Profile:
    """The profile as one host runs it with `slots` slots, its engine's flags saying so (a profile that does not
    fill its card keeps its own)."""
    return profile if slots == profile.slots else engine_of(profile).with_slots(profile, slots)


async def slots_for(ctx: Context, profile: Profile, card_mb: int) -> int:
    """The slots a host of this profile gets on a card of `card_mb` MiB: the profile's, or with fill_card as
    many as its plan fits there (at least the profile's, which the offer filter made sure of; at most its
    max_slots and llama.cpp's 256)."""
    if not profile.fill_card:
        return profile.slots
    fits = (await plan(ctx, profile.name)).max_slots(card_mb * MIB)
    return max(profile.slots, min(fits, profile.max_slots or MOST_SLOTS, MOST_SLOTS))


def hub_token(ctx: Context) -> str:
    return os.environ.get(ctx.settings.hub.token_env, "")


async def snapshot(ctx: Context, profile: Profile) -> Snapshot:
    """The profile's repository as the hub lists it at its revision: read once per process."""
    assert profile.snapshot is not None
    key = f"{profile.snapshot.repo}@{profile.snapshot.revision}"
    if key not in ctx.snapshots:
        async with ctx.waits.on("hub"):
            ctx.snapshots[key] = await snapshots.listing(
                ctx.hub_url, profile.snapshot.repo, profile.snapshot.revision, hub_token(ctx)
            )
    return ctx.snapshots[key]


async def vllm_plan(ctx: Context, profile: Profile) -> VllmPlan:
    """What vLLM leaves each sequence, from the repository's headers alone: every safetensors file's JSON
    header by HTTP ranges, config.json for the KV cache per token, and the profile's settings."""
    repo = await snapshot(ctx, profile)
    token = hub_token(ctx)
    auth = {"Authorization": f"Bearer {token}"} if token else None
    config = next((f for f in repo.files if f.name == "config.json"), None)
    if config is None:
        raise hfconfig.ConfigJsonError(f"{repo.repo}: no config.json")
    async with ctx.waits.on("hub"):
        text = await snapshots.small_file(ctx.hub_url, repo, config, token)
        layout = hfconfig.parse(text, f"{repo.repo}/config.json")
        weights = 0
        for f in repo.files:
            if f.name.endswith(".safetensors"):
                header = await safetensors.read_url(repo.resolve_url(ctx.hub_url, f.name), auth)
                weights += header.data_bytes
    settings = VllmSettings(
        max_model_len=profile.ctx_per_slot,
        max_num_seqs=profile.slots,
        gpu_memory_utilization=engine_of(profile).card_share(profile),
        kv_bytes=engine_of(profile).kv_bytes(profile),
    )
    return VllmPlan(profile.name, weights, layout, settings, int(ctx.settings.plan.runtime_mib_for(profile) * MIB))


async def plan(
    ctx: Context, model: str, ctx_per_slot: int | None = None, slots: int | None = None, swa_full: bool | None = None
) -> Plan:
    """GPU memory for the profile (or the given overrides), from its GGUF headers over HTTP ranges."""
    profile = ctx.settings.profile(model)
    cache = cache_settings_from_args(profile.args, ctx_per_slot or profile.ctx_per_slot)
    if swa_full is not None:
        cache = dataclasses.replace(cache, swa_full=swa_full)
    files = {f.key: f for f in profile.files}
    main = await header(ctx, file_url(ctx, files["main"].repo, files["main"].revision, files["main"].file))
    draft = None
    if "draft" in files:
        d = files["draft"]
        draft = await header(ctx, file_url(ctx, d.repo, d.revision, d.file))
    p = ctx.settings.plan
    return make_plan(
        model,
        slots or profile.slots,
        cache,
        main,
        draft,
        PlanSettings(int(p.runtime_mib_for(profile) * MIB), int(p.headroom_mib * MIB)),
    )


async def repo_template(ctx: Context, profile: Profile) -> str | None:
    """The repository's own template: chat_template.jinja, else tokenizer_config.json's chat_template (a
    text, or the one named "default" of a list)."""
    repo = await snapshot(ctx, profile)
    files = {f.name: f for f in repo.files}
    token = hub_token(ctx)
    if "chat_template.jinja" in files:
        raw = await snapshots.small_file(ctx.hub_url, repo, files["chat_template.jinja"], token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise snapshots.SnapshotError(f"{repo.repo}/chat_template.jinja: not UTF-8 text") from None
    if "tokenizer_config.json" not in files:
        return None
    raw = await snapshots.small_file(ctx.hub_url, repo, files["tokenizer_config.json"], token)
    try:
        found = json.loads(raw).get("chat_template")
    except (ValueError, AttributeError, RecursionError):
        raise snapshots.SnapshotError(f"{repo.repo}/tokenizer_config.json: not a JSON object") from None
    if isinstance(found, list):
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
    return found if isinstance(found, str) else None
