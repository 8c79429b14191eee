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
    # What serves it (fleet/engines/registry.py ENGINES): llama.cpp's llama-server from GGUF `files`, or vLLM
    # from a repository `snapshot`
    engine: Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,31}$")] = "llama-server"
    gpu_ram_gb: Annotated[float, Field(ge=0)]
    disk_gb: Annotated[float, Field(ge=8)]
    slots: Annotated[int, Field(ge=1)]
    ctx_per_slot: Annotated[int, Field(ge=256)]
    # As many slots of ctx_per_slot as the rented card holds by the plan (never fewer than `slots`, the least
    # an offer must hold; at most `max_slots`, and llama.cpp's 256 sequences): a big card serves many calls,
    # each keeping its cache. -np and -c follow on each host; `fleet status` shows its slots.
    fill_card: bool = False
    max_slots: Annotated[int | None, Field(ge=1, le=256)] = None
    # The most slots at which a host runs the draft model its args name: a host with more (fill_card on a big
    # card) starts without the draft's flags. A draft pays at N calls only while its acceptance (`fleet bench`:
    # draft accepted) beats what its check costs the pass there (README, "A draft model at many calls").
    draft_max_slots: Annotated[int | None, Field(ge=1, le=256)] = None
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
    # The host's CPU: llama-server samples every call's next token on one thread between the card's passes, so
    # at many calls a slow core caps the card (vast.ai lists cpu_ghz and cpu_cores_effective, the instance's
    # share of the cores). Offers below a floor are filtered out; 0: none. `fleet machines` keeps what each
    # machine measured, which ranks them once benched.
    min_cpu_ghz: Annotated[float, Field(ge=0, le=10)] = 0.0
    min_cpu_cores: Annotated[float, Field(ge=0, le=1024)] = 0.0

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
    def _shared_rules(self) -> Profile:
        """What every engine's profile keeps; each engine's own rules are its check_profile
        (fleet/engines/registry.py runs them when fleet.toml loads)."""
        for arg in self.args:
            if any(c in arg for c in "\0\n\r"):
                raise ValueError(f"args: {arg!r} holds a NUL or a line break")
        if self.max_slots is not None and self.max_slots < self.slots:
            raise ValueError(f"max_slots ({self.max_slots}) is fewer than slots ({self.slots})")
        return self
