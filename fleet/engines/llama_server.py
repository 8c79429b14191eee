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
    """One KV cache shared by a multi-slot host's slots, each slot held to its planned context.

    With a stream per slot (llama-server's layout when -np is given), a decode step joins its speaking calls
    in one forward pass only while their slot ids are consecutive (llama.cpp's split_equal): calls on slots 4
    and 6 cost two passes a token, each reading every weight; an H200 served each of two callers 64 tok/s
    instead of 137. Which slots a host's calls hold is its history's doing, so only a shared cache puts every
    step in one pass. Its price: each step's attention reads the idle calls' cells too, small beside the
    split for the shipped profiles (bench/gpu/results/2026-12-02-slots.md). In a shared cache an idle slot's
    cells would be cleared when another call starts (--cache-idle-slots): a voice call's next turn must find
    its own still on the card. A profile that says -no-kvu keeps a stream per slot; one that gives its own
    per-slot context or idle-slot choice keeps that."""
    args = profile.args
    if profile.slots < 2 or any(a in NO_SHARED_CACHE for a in args):
        return []
    added = [] if any(a in SHARED_CACHE for a in args) else ["-kvu"]
    if not any(a == PER_SLOT or a.startswith(PER_SLOT + "=") for a in args):
        added += [PER_SLOT, str(profile.ctx_per_slot)]
    if not any(a in IDLE_SLOTS for a in args):
        added.append("--no-cache-idle-slots")
    return added


def profile_args(profile: Profile) -> list[str]:
    """The profile's flags as fleet runs them: its own, then the cache layout fleet adds ({file.key} unfilled)."""
    return [*profile.args, *cache_args(profile)]


def server_argv(profile: Profile, port: int, files: dict[str, str]) -> list[str]:
    """llama-server's arguments: the model, the profile's flags ({file.key} filled in) and its cache layout, the
    chat template fleet put on the host when the profile names one, what it exposes, its TLS key and
    certificate, port, alias."""
    args = [re.sub(r"\{file\.([a-z0-9_]+)\}", lambda m: files[m.group(1)], a) for a in profile_args(profile)]
    template = ["--chat-template-file", TEMPLATE_FILE] if profile.chat_template else []
    return ["-m", files["main"], *args, *template, *EXPOSURE, *TLS, "--port", str(port), "-a", profile.name]
