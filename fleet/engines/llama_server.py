"""llama.cpp's llama-server: its argv from a profile, and the KV cache layout fleet gives a multi-slot host.
What its replies report is read in fleet/engines/replies.py, its /metrics in fleet/engines/metrics.py."""

from __future__ import annotations

import re

from fleet.core.config import Profile
from fleet.engines import TEMPLATE_FILE, TLS_CERT_FILE, TLS_KEY_FILE

# The CUDA architectures the host image's llama-server is built for (images/llama-server/Dockerfile's
# CUDA_ARCHITECTURES; a test holds the two equal). An offer's card must be one of them: vast.ai gives its
# compute capability x 100 (`compute_cap`: 860 an RTX 3090, 900 an H100); a V100 (700) would fail at start
# after a pull paid at GPU price, and a card newer than the build runs only by JIT from PTX.
CUDA_ARCHITECTURES = (80, 86, 89, 90, 100, 120)
COMPUTE_CAPS = tuple(arch * 10 for arch in CUDA_ARCHITECTURES)


# On every host: /slots would hand every caller's transcript to any holder of the key, and the web UI serves
# nothing a voice agent needs; /metrics says how many requests are in flight (a drain reads it) and no more.
EXPOSURE = ["--no-slots", "--no-webui", "--metrics"]
# Every host serves HTTPS alone: a call's transcript crosses the internet (fleet/core/tls.py signs the cert).
TLS = ["--ssl-key-file", TLS_KEY_FILE, "--ssl-cert-file", TLS_CERT_FILE]


# The flags that choose the KV cache's layout, a slot's context in a shared cache, and whether an idle slot's
# cache leaves the card: a profile that says one keeps its word on that one.
SHARED_CACHE = ("-kvu", "--kv-unified")
NO_SHARED_CACHE = ("-no-kvu", "--no-kv-unified")
KV_LAYOUT = SHARED_CACHE + NO_SHARED_CACHE
PER_SLOT = "--kv-unified-per-slot"
IDLE_SLOTS = ("--cache-idle-slots", "--no-cache-idle-slots")


def cache_args(profile: Profile) -> list[str]:
    """A KV cache stream per slot on a multi-slot host (`-no-kvu`), unless the profile asks for one shared cache.

    A voice host always holds idle calls between their turns, and its speakers sit on whatever slots their
    calls landed on. With a stream per slot and fleet's patch 0003 (images/llama-server/patches), a decode step
    joins its speaking calls in one forward pass whatever their slots, and each call's attention reads its own
    cells alone: idle calls cost no decode. One shared cache (`-kvu`) also joins any slots, but every call's
    attention then reads every cached cell, idle calls' too: on the a4b shape with four speakers, 0.64-0.78 of a
    stream per slot's rate (bench/gpu/results/2026-12-03-slots.md). A profile that says `-kvu` keeps it, with each
    slot held to its planned context and an idle slot's cells kept on the card (--cache-idle-slots would clear
    them when another call starts: a voice call's next turn must find its own); its own per-slot context or
    idle-slot choice stands."""
    args = profile.args
    if profile.slots < 2 or any(a in NO_SHARED_CACHE for a in args):
        return []
    if not any(a in SHARED_CACHE for a in args):
        return [NO_SHARED_CACHE[0]]
    added = []
    if not any(a == PER_SLOT or a.startswith(PER_SLOT + "=") for a in args):
        added += [PER_SLOT, str(profile.ctx_per_slot)]
    if not any(a in IDLE_SLOTS for a in args):
        added.append("--no-cache-idle-slots")
    return added


def profile_args(profile: Profile) -> list[str]:
    """The profile's flags as fleet runs them: its own, then the cache layout and the bound on the RAM prompt
    cache fleet adds ({file.key} unfilled)."""
    return [*profile.args, *cache_args(profile), "--cache-ram", str(profile.cache_ram_mib)]


def host_ram_gb(profile: Profile) -> float:
    """The system RAM a host of this profile needs: the RAM prompt cache llama-server may fill, and the rest."""
    return profile.host_ram_gb + profile.cache_ram_mib * 2**20 / 1e9


def server_argv(profile: Profile, port: int, files: dict[str, str]) -> list[str]:
    """llama-server's arguments: the model, the profile's flags ({file.key} filled in) and its cache layout, the
    chat template fleet put on the host when the profile names one, what it exposes, its TLS key and
    certificate, port, alias."""
    args = [re.sub(r"\{file\.([a-z0-9_]+)\}", lambda m: files[m.group(1)], a) for a in profile_args(profile)]
    template = ["--chat-template-file", TEMPLATE_FILE] if profile.chat_template else []
    return ["-m", files["main"], *args, *template, *EXPOSURE, *TLS, "--port", str(port), "-a", profile.name]
