"""llama.cpp's llama-server: the profile rules it holds, its argv from a profile, and the KV cache layout fleet
gives a multi-slot host. What its replies report is read in fleet/engines/replies.py, its /metrics in
fleet/engines/metrics.py."""

from __future__ import annotations

import re
from typing import ClassVar

from fleet.core.config import Profile
from fleet.engines import CACHE_SALT_HEADER, TEMPLATE_FILE, TLS_CERT_FILE, TLS_KEY_FILE
from fleet.engines.base import Engine, Payload

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
# A cached prompt is reused only for requests of the same salt, which the gateway sets per agent (patch 0005): no
# agent learns from a cache hit what another agent's prompt held. fleet's own probes send none.
CACHE_SALT = ["--cache-salt-header", CACHE_SALT_HEADER]


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
    idle-slot choice stands. With a stream per slot, --no-cache-idle-slots too: llama-server's default copies
    every idle slot's state into its RAM prompt cache at each launch (server-context.cpp), while the idle call's
    cells stay on the card; a slot another call takes is still saved then."""
    args = profile.args
    if profile.slots < 2 or any(a in NO_SHARED_CACHE for a in args):
        return []
    idle = [] if any(a in IDLE_SLOTS for a in args) else ["--no-cache-idle-slots"]
    if not any(a in SHARED_CACHE for a in args):
        return [NO_SHARED_CACHE[0], *idle]
    added = []
    if not any(a == PER_SLOT or a.startswith(PER_SLOT + "=") for a in args):
        added += [PER_SLOT, str(profile.ctx_per_slot)]
    return added + idle


# llama-server's flags of a draft model (common/arg.cpp: every --spec-* flag, and their older names); those in
# DRAFT_SWITCHES take no value, every other one takes the next argument
DRAFT_FLAGS = ("-md", "--model-draft", "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "-devd",
               "--device-draft", "-td", "--threads-draft", "-tbd", "--threads-batch-draft", "-ctkd",
               "--cache-type-k-draft", "-ctvd", "--cache-type-v-draft", "--draft-p-min", "--draft-p-split", "-hfd",
               "-hfrd", "--hf-repo-draft", "-otd", "--override-tensor-draft", "-ncmoed", "--n-cpu-moe-draft",
               "-cmoed", "--cpu-moe-draft")  # fmt: skip
DRAFT_SWITCHES = ("--spec-draft-cpu-moe", "-cmoed", "--cpu-moe-draft", "--spec-draft-backend-sampling",
                  "--no-spec-draft-backend-sampling")  # fmt: skip


def _is_draft_flag(arg: str) -> bool:
    flag = arg.split("=", 1)[0]
    return flag.startswith(("--spec-", "--no-spec-")) or flag in DRAFT_FLAGS


def without_draft(args: list[str]) -> list[str]:
    """The args with every draft model flag (and its value) left out."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif _is_draft_flag(arg):
            skip = "=" not in arg and arg not in DRAFT_SWITCHES
        else:
            kept.append(arg)
    return kept


def runs_draft(profile: Profile) -> bool:
    """Whether a host of the profile at its slots starts its draft model (the args name one, and the slots are
    at most draft_max_slots)."""
    names_one = any(_is_draft_flag(a) for a in profile.args)
    return names_one and (profile.draft_max_slots is None or profile.slots <= profile.draft_max_slots)


def profile_args(profile: Profile) -> list[str]:
    """The profile's flags as fleet runs them: its own (without its draft model's past draft_max_slots), then
    the cache layout and the bound on the RAM prompt cache fleet adds ({file.key} unfilled)."""
    own = profile.args if runs_draft(profile) else without_draft(profile.args)
    return [*own, *cache_args(profile), "--cache-ram", str(profile.cache_ram_mib)]


def host_ram_gb(profile: Profile) -> float:
    """The system RAM a host of this profile needs: the RAM prompt cache llama-server may fill, and the rest."""
    return profile.host_ram_gb + profile.cache_ram_mib * 2**20 / 1e9


def server_argv(profile: Profile, port: int, files: dict[str, str]) -> list[str]:
    """llama-server's arguments: the model, the profile's flags ({file.key} filled in) and its cache layout, the
    chat template fleet put on the host when the profile names one, what it exposes, its TLS key and
    certificate, port, alias."""
    args = [re.sub(r"\{file\.([a-z0-9_]+)\}", lambda m: files[m.group(1)], a) for a in profile_args(profile)]
    template = ["--chat-template-file", TEMPLATE_FILE] if profile.chat_template else []
    fleets = [*EXPOSURE, *TLS, *CACHE_SALT, "--port", str(port), "-a", profile.name]
    return ["-m", files["main"], *args, *template, *fleets]


# What fleet sets on every host: a profile that gives one is refused at load
SET_BY_FLEET = (
    "--api-key", "--cache-salt-header", "--port", "--host", "-m", "--model", "--chat-template-file", "--chat-template"
)  # fmt: skip
CACHE_RAM = ("--cache-ram", "-cram")


class LlamaServer(Engine):
    """llama-server from GGUF files pulled by key; -np slots of -c / -np context, or as many as the card holds."""

    name = "llama-server"
    server_name = "llama-server"
    payload = Payload.GGUF_FILES
    image_setting = "image"
    one_card = False  # llama.cpp splits layers over every card of the host
    reports_slots = True
    renders_templates = True
    pid_file = "llama-server.pid"
    log_file = "llama-server.log"
    compute_caps: ClassVar[tuple[int, ...]] = COMPUTE_CAPS

    def check_profile(self, profile: Profile) -> None:
        args = profile.args
        if profile.snapshot is not None:
            raise ValueError("snapshot: a repository snapshot is what a vllm profile serves (engine = 'vllm')")
        keys = [f.key for f in profile.files]
        if "main" not in keys:
            raise ValueError("files: one file must have key = 'main'")
        if len(set(keys)) != len(keys):
            raise ValueError("files: keys must be unique")
        for arg in args:
            for ref in re.findall(r"\{file\.([^}]*)\}", arg):
                if ref not in keys:
                    raise ValueError(f"args: {{file.{ref}}} names no file")
        for forbidden in SET_BY_FLEET:
            if forbidden in args:
                raise ValueError(
                    f"args: {forbidden} is set by fleet, not the profile"
                    + (" (name the template in chat_template)" if forbidden.startswith("--chat-template") else "")
                )
        for flag in CACHE_RAM:
            if any(a == flag or a.startswith(flag + "=") for a in args):
                raise ValueError(f"args: {flag} is set by fleet from the profile's cache_ram_mib")
        if profile.draft_max_slots is not None and not any(_is_draft_flag(a) for a in args):
            raise ValueError("draft_max_slots: the args name no draft model (-md, --spec-draft-model)")
        if profile.fill_card and not ("-np" in args and "-c" in args):
            raise ValueError("fill_card: the args must give -np and -c, which fleet sets for each host's card")
        # slots and ctx_per_slot are what -np and -c say; where the args say it, they must agree
        if "-np" in args and args[args.index("-np") + 1 :][:1] != [str(profile.slots)]:
            raise ValueError(f"args: -np must equal slots ({profile.slots})")
        if "-c" in args and args[args.index("-c") + 1 :][:1] != [str(profile.slots * profile.ctx_per_slot)]:
            raise ValueError(f"args: -c must equal slots x ctx_per_slot ({profile.slots * profile.ctx_per_slot})")

    def server_argv(self, profile: Profile, port: int, files: dict[str, str]) -> list[str]:
        return server_argv(profile, port, files)

    def host_ram_gb(self, profile: Profile) -> float:
        return host_ram_gb(profile)

    def with_slots(self, profile: Profile, slots: int) -> Profile:
        """-np and -c set to the slots (check_profile made sure a fill_card profile gives both)."""
        args = list(profile.args)
        for flag, value in (("-np", slots), ("-c", slots * profile.ctx_per_slot)):
            args[args.index(flag) + 1] = str(value)
        return profile.model_copy(update={"slots": slots, "args": args})
