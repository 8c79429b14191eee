"""A model's profile in fleet.toml: its files, the flags its server runs with, the slots and context it is
sized for, the probes it must pass and the voice target its capacity is measured against."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The turn shapes of a voice call the renderings check renders (fleet/probes/renderings.py builds each).
TURN_SHAPES = ("plain", "tool call", "tool result", "text before call", "whitespace", "multi-call")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Traffic(Strict):
    up: Annotated[float, Field(ge=0)] = 0.0
    down: Annotated[float, Field(ge=0)] = 0.0


# Names that end up in URLs, file paths on hosts, labels and host names: plain ASCII words that start with a
# letter, a digit or "_", so never "." or ".." (a path that climbs out).
NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"
PATH_PART = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,95}"


class ModelFile(Strict):
    key: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")]
    repo: Annotated[str, Field(pattern=rf"^{PATH_PART}/{PATH_PART}$")]
    file: Annotated[str, Field(pattern=rf"^{PATH_PART}$")]
    revision: Annotated[str, Field(pattern=rf"^{PATH_PART}(?:/{PATH_PART})*$")] = "main"
    # The file's sha256 as you checked it: the hub's own (its etag) proves the transfer, not the origin. With
    # it, a hub that serves other bytes under this name fails the pull (pin `revision` to a commit too).
    sha256: Annotated[str | None, Field(pattern=r"^[0-9a-f]{64}$")] = None


class Snapshot(Strict):
    """A Hugging Face repository a vLLM host serves whole: its config, tokenizer, chat template and safetensors
    shards, listed by the hub's API at `revision` (pin a commit: a branch moves)."""

    repo: Annotated[str, Field(pattern=rf"^{PATH_PART}/{PATH_PART}$")]
    revision: Annotated[str, Field(pattern=rf"^{PATH_PART}$")] = "main"


ENGINES = ("llama-server", "vllm")


class ProfileProbes(Strict):
    """How big the probes' conversations are for this model (a real card vs the tiny CPU model)."""

    on_up: list[Literal["smoke", "cache", "keepalive", "thermal"]] = ["smoke", "cache", "keepalive", "thermal"]
    system_chars: Annotated[int, Field(ge=0)] = 28000  # ~7k tokens of system prompt, as a voice agent sends
    turns: Annotated[int, Field(ge=2)] = 4
    reply_tokens: Annotated[int, Field(ge=1)] = 32
    rewrite_reply_tokens: Annotated[int, Field(ge=0)] = 300  # 0: skip the rewritten-turn check
    thermal_seconds: Annotated[float, Field(gt=0)] = 300
    thermal_interval_s: Annotated[float, Field(gt=0)] = 5
    thermal_tokens: Annotated[int, Field(ge=8)] = 256
    # one-caller rates measured at least, however long they take on a busy card: a share needs several
    thermal_min_samples: Annotated[int, Field(ge=2)] = 3


class VoiceTarget(Strict):
    """What a voice caller needs from a warm turn (DOMAIN.md, the workload): first content well under a
    second, and decode comfortably faster than speech (~4.5 tok/s). `fleet bench` finds how many
    concurrent callers a host holds while meeting it, speaking at once (its speakers) and in conversation
    (its calls: each waits `turn_gap_s` on average after a reply before its next turn)."""

    first_content_p95_ms: Annotated[float, Field(gt=0)] = 500
    decode_tok_s: Annotated[float, Field(gt=0)] = 15
    # The mean seconds from a reply to the call's next turn: the agent's reply spoken, the caller's answer and
    # the turn transitions (README, "Capacity in calls", says where 8 s comes from)
    turn_gap_s: Annotated[float, Field(ge=0, le=600)] = 8.0


class Profile(Strict):
    name: str = ""
    description: str = ""
    # What serves it: llama.cpp's llama-server from GGUF `files`, or vLLM from a repository `snapshot`
    engine: Literal["llama-server", "vllm"] = "llama-server"
    gpu_ram_gb: Annotated[float, Field(ge=0)]
    disk_gb: Annotated[float, Field(ge=8)]
    slots: Annotated[int, Field(ge=1)]
    ctx_per_slot: Annotated[int, Field(ge=256)]
    # As many slots of ctx_per_slot as the rented card holds by the plan (never fewer than `slots`, the least
    # an offer must hold; at most `max_slots`, and llama.cpp's 256 sequences): a big card serves many calls,
    # each keeping its cache. -np and -c follow on each host; `fleet status` shows its slots.
    fill_card: bool = False
    max_slots: Annotated[int | None, Field(ge=1, le=256)] = None
    traffic_gb_per_hour: Traffic = Traffic()
    files: list[ModelFile] = []  # llama-server: the GGUF files, one of them key "main"
    snapshot: Snapshot | None = None  # vllm: the repository
    args: list[str] = []
    # The chat template llama-server uses (--chat-template-file): a file fleet ships (fleet/templates/),
    # named by file name, or a path (relative to fleet.toml); none: the one in the model file
    chat_template: str | None = None
    # turn shapes (fleet/probes/renderings.py) whose prompt-cache break this profile lives with
    accept_template_breaks: list[str] = []
    probes: ProfileProbes = ProfileProbes()
    voice: VoiceTarget = VoiceTarget()
    # Compute capabilities the profile runs on, as vast.ai gives them (x 100: 1200 is 12.0); none: every one
    # the image is built for. NVFP4 weights need Blackwell's (1000, 1200).
    compute_caps: list[Annotated[int, Field(ge=300, le=2000)]] = []
    # GPU memory llama.cpp takes beyond weights and cache with this profile's flags (the CUDA context and its
    # libraries, the compute buffers of the target and any draft), as `bench/gpu/run plan` measured it; its
    # compute buffers follow ggml's allocator, not the header. Unset: [plan] runtime_overhead_mib.
    runtime_mib: Annotated[float | None, Field(ge=0)] = None
    # llama-server's prompt cache in the host's RAM (--cache-ram, MiB; 0: none): where a slot's cached prompt
    # goes when another call takes the slot, so that its call finds it again. Unset, llama-server lets it grow
    # to 8 GiB over a day of calls on a rented machine's finite RAM; fleet bounds it here.
    cache_ram_mib: Annotated[int, Field(ge=0, le=1_048_576)] = 2048
    # The RAM a host needs beside that cache (the server process, aria2c's pull, sshd): an offer whose system
    # RAM (vast.ai's cpu_ram: the instance's share of the machine's) holds less than both is filtered out.
    host_ram_gb: Annotated[float, Field(ge=0, le=4096)] = 8.0

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, v: str | None) -> str | None:
        if v is not None and (not v or any(c in v for c in "\0\n\r")):
            raise ValueError("an empty name, a NUL or a line break")
        if v is not None and "/" not in v and not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}\.jinja", v):
            raise ValueError(f"{v!r}: a file fleet ships is named NAME.jinja (a path of yours holds a '/')")
        return v

    @field_validator("accept_template_breaks")
    @classmethod
    def _accepted_shapes(cls, v: list[str]) -> list[str]:
        unknown = [s for s in v if s not in TURN_SHAPES]
        if unknown:
            raise ValueError(f"{unknown}: the turn shapes are {', '.join(TURN_SHAPES)}")
        return v

    @model_validator(mode="after")
    def _files(self) -> Profile:
        if self.engine == "vllm":
            return self._vllm()
        if self.snapshot is not None:
            raise ValueError("snapshot: a repository snapshot is what a vllm profile serves (engine = 'vllm')")
        keys = [f.key for f in self.files]
        if "main" not in keys:
            raise ValueError("files: one file must have key = 'main'")
        if len(set(keys)) != len(keys):
            raise ValueError("files: keys must be unique")
        for arg in self.args:
            if any(c in arg for c in "\0\n\r"):
                raise ValueError(f"args: {arg!r} holds a NUL or a line break")
            for ref in re.findall(r"\{file\.([^}]*)\}", arg):
                if ref not in keys:
                    raise ValueError(f"args: {{file.{ref}}} names no file")
        for forbidden in ("--api-key", "--port", "--host", "-m", "--model", "--chat-template-file", "--chat-template"):
            if forbidden in self.args:
                raise ValueError(
                    f"args: {forbidden} is set by fleet, not the profile"
                    + (" (name the template in chat_template)" if forbidden.startswith("--chat-template") else "")
                )
        for flag in ("--cache-ram", "-cram"):
            if any(a == flag or a.startswith(flag + "=") for a in self.args):
                raise ValueError(f"args: {flag} is set by fleet from the profile's cache_ram_mib")
        if self.fill_card and not ("-np" in self.args and "-c" in self.args):
            raise ValueError("fill_card: the args must give -np and -c, which fleet sets for each host's card")
        if self.max_slots is not None and self.max_slots < self.slots:
            raise ValueError(f"max_slots ({self.max_slots}) is fewer than slots ({self.slots})")
        # slots and ctx_per_slot are what -np and -c say; where the args say it, they must agree
        if "-np" in self.args and self.args[self.args.index("-np") + 1 :][:1] != [str(self.slots)]:
            raise ValueError(f"args: -np must equal slots ({self.slots})")
        if "-c" in self.args and self.args[self.args.index("-c") + 1 :][:1] != [str(self.slots * self.ctx_per_slot)]:
            raise ValueError(f"args: -c must equal slots x ctx_per_slot ({self.slots * self.ctx_per_slot})")
        return self

    def _vllm(self) -> Profile:
        if self.fill_card:
            raise ValueError("fill_card: a vllm profile's sequences are --max-num-seqs at its slots")
        if self.snapshot is None or self.files:
            raise ValueError("engine = 'vllm' serves a repository: give snapshot = { repo, revision }, not files")
        for i, arg in enumerate(self.args):
            if any(c in arg for c in "\0\n\r"):
                raise ValueError(f"args: {arg!r} holds a NUL or a line break")
            flag = arg.split("=", 1)[0]
            if flag.startswith("--"):
                flag = "--" + flag[2:].replace("_", "-")  # vLLM reads --max_num_seqs as --max-num-seqs
            if flag in VLLM_SET_BY_FLEET:
                raise ValueError(f"args: {flag} is not the profile's to give ({VLLM_SET_BY_FLEET[flag]})")
            if flag in VLLM_NUMBERS:
                value = arg.partition("=")[2] if "=" in arg else (self.args[i + 1 : i + 2] or [""])[0]
                if not VLLM_NUMBERS[flag](value):
                    raise ValueError(f"args: {flag} {value[:20]!r}: {VLLM_NUMBER_RULES[flag]}")
        return self


# vLLM's flags fleet sets itself, and from what
VLLM_SET_BY_FLEET = {
    "--api-key": "the host's key, in the server's environment",
    "--port": "the service port",
    "--host": "the image's listen address",
    "--model": "snapshot",
    "--served-model-name": "the profile's name",
    "--max-num-seqs": "slots",
    "--max-model-len": "ctx_per_slot",
    "--chat-template": "chat_template",
    "--ssl-keyfile": "the host's TLS key",
    "--ssl-certfile": "the certificate fleet's CA signs",
    "--enable-prompt-tokens-details": "always on: a warm turn reports its cached tokens",
    "--middleware": "fleet-serve's key check on every path",
    "--config": "a file of flags would pass the rest of this list by",
    "--uds": "the service port",
    "--root-path": "the paths the gateway and the probes use",
    "--tensor-parallel-size": "fleet serves a vLLM profile from one card, and rents by one card's memory",
    "-tp": "fleet serves a vLLM profile from one card, and rents by one card's memory",
}


def _share(value: str) -> bool:
    try:
        return 0 < float(value) <= 1
    except ValueError:
        return False


# vLLM's flags whose value fleet reads too (the planner, the cache probe): checked at load
VLLM_NUMBERS = {"--gpu-memory-utilization": _share, "--block-size": lambda v: v.isdigit() and 0 < int(v) <= 4096}
VLLM_NUMBER_RULES = {
    "--gpu-memory-utilization": "a share of the card above 0, at most 1",
    "--block-size": "tokens, 1-4096",
}
