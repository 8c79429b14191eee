"""Running a set of probes against one host with the settings that size and judge them."""

from __future__ import annotations

from pathlib import Path

import asyncssh

from fleet.core.config import Profile, Settings
from fleet.engines.registry import engine_of
from fleet.probes import ProbeResult
from fleet.probes.cache import run_cache
from fleet.probes.call import load_call
from fleet.probes.keepalive import run_keepalive
from fleet.probes.server import Server
from fleet.probes.smoke import run_smoke
from fleet.probes.thermal import plot, run_thermal

PROBES = ("smoke", "cache", "keepalive", "thermal")


async def run_probes(
    names: list[str],
    server: Server,
    profile: Profile,
    settings: Settings,
    ssh: asyncssh.SSHClientConnection | None,
    plot_path: Path | None = None,
    template_text: str | None = None,
) -> list[ProbeResult]:
    """Run `names` in order; every result is returned, passed or not. `template_text`: a vLLM model's chat
    template, which the cache probe renders here."""
    p, limits = profile.probes, settings.probes
    results = []
    for name in names:
        if name == "smoke":
            results.append(await run_smoke(server))
        elif name == "cache":
            call = load_call().with_system_chars(p.system_chars)
            results.append(
                await run_cache(
                    server,
                    call,
                    p.turns,
                    p.reply_tokens,
                    p.rewrite_reply_tokens,
                    limits.prompt_allowance_tokens,
                    profile.accept_template_breaks,
                    engine_of(profile),
                    template_text,
                    engine_of(profile).cache_block_tokens(profile),
                )
            )
        elif name == "keepalive":
            results.append(await run_keepalive(server, limits.keepalive_gate))
        elif name == "thermal":
            result, rates, cards = await run_thermal(
                server,
                ssh,
                slots=profile.slots,
                seconds=p.thermal_seconds,
                interval_s=p.thermal_interval_s,
                tokens=p.thermal_tokens,
                min_samples=p.thermal_min_samples,
                min_share=limits.thermal_min_share,
                max_gpu_c=limits.thermal_max_gpu_c,
                max_memory_c=limits.thermal_max_memory_c,
            )
            if plot_path is not None:
                plot(rates, cards, plot_path, f"{profile.name}: thermal baseline")
            results.append(result)
        else:
            raise ValueError(f"unknown probe {name!r} (have: {', '.join(PROBES)})")
    return results
