"""The contract every engine keeps: what fleet asks of the server a profile names, whatever it is.

An engine is one module beside this one and one line in fleet/engines/registry.py. It says, as pure facts and
functions of a profile (no I/O: the layers above do that, asking the engine what to do):
- what a host of it needs: its image (a field of [provider]), the payload it loads (GGUF files pulled by key,
  or a repository snapshot), the one card or several it serves from, the system RAM beside the card;
- how it runs: its argv from a profile, the files its host script keeps its PID and log in, the profile
  rules it holds at load (flags fleet sets itself, values fleet reads);
- how it says what it does: whether it reports its slots and context (/props), whether it renders a chat
  template for a client (/apply-template), how /tokenize is asked, in what blocks its prompt cache keeps a
  warm turn; its replies' timings and its /metrics are read in replies.py and metrics.py for every engine;
- for a payload planned from its headers (safetensors + config.json), the share of the card it takes and the
  bytes of a KV cache element.

dstack's `Compute` and SkyPilot's `sky/provision/` are the shape: one contract, one module per
implementation, callers that never ask which one they hold."""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Any, ClassVar

from fleet.core.config import Profile
from fleet.core.services import Provider


class Payload(Enum):
    """What a host of the engine loads, and so how it is pulled, kept and planned (fleet/host/payloads.py)."""

    GGUF_FILES = "files"  # the profile's [[files]] by key, each one GGUF file: planned from its header
    REPO_SNAPSHOT = "snapshot"  # the profile's snapshot: a repository's config, tokenizer and safetensors


class Engine(ABC):
    """One server fleet runs on a host. Subclasses set the class facts and implement the abstract methods."""

    name: ClassVar[str]  # the profile's `engine`
    server_name: ClassVar[str]  # how a message names its server ("llama-server up at ...")
    payload: ClassVar[Payload]
    image_setting: ClassVar[str]  # the [provider] field naming the image its hosts boot (and `<it>_gb` its size)
    one_card: ClassVar[bool]  # serves from one card: an offer of several cards pays for cards it leaves idle
    reports_slots: ClassVar[bool]  # GET /props says its slots and context; else they are what fleet started
    renders_templates: ClassVar[bool]  # POST /apply-template renders a conversation with its own template
    pid_file: ClassVar[str]  # in RUN_DIR on the host, as the image's fleet-serve writes them
    log_file: ClassVar[str]
    compute_caps: ClassVar[tuple[int, ...]]  # the compute capabilities (x 100) its image is built for

    @abstractmethod
    def check_profile(self, profile: Profile) -> None:
        """The engine's own rules on a profile, run when fleet.toml loads (registry.load): ValueError, with the
        field and what is wrong, for a profile it cannot serve as written."""

    @abstractmethod
    def server_argv(self, profile: Profile, port: int, files: dict[str, str]) -> list[str]:
        """The server's arguments on a host: `files` maps the payload's keys to their paths there ("main": the
        GGUF file, or the repository's directory). Never a secret: the key reaches the server another way."""

    def with_slots(self, profile: Profile, slots: int) -> Profile:
        """The profile as a host runs it with `slots` slots of its ctx_per_slot (fill_card)."""
        return profile.model_copy(update={"slots": slots})

    def image(self, provider: Provider) -> str:
        """The image a host of this engine boots ("" when fleet.toml names none)."""
        return str(getattr(provider, self.image_setting))

    def image_proof(self, provider: Provider) -> str:
        """The sha256 of that image's manifest which its hosts must show before a pull ("" when none is pinned)."""
        return str(getattr(provider, f"{self.image_setting}_proof"))

    def image_gb(self, provider: Provider) -> float:
        """What pulling that image downloads (GB)."""
        return float(getattr(provider, f"{self.image_setting}_gb"))

    def host_ram_gb(self, profile: Profile) -> float:
        """The system RAM (GB) an offer must give a host of this profile."""
        return profile.host_ram_gb

    def tokenize_body(self, text: str) -> dict[str, Any]:
        """POST /tokenize's body for `text`, without the special tokens a whole prompt starts with."""
        return {"content": text, "add_special": False}

    def cache_block_tokens(self, profile: Profile) -> int:
        """The tokens of one block of its prompt cache: a warm turn finds whole blocks alone (1: any token)."""
        return 1

    def card_share(self, profile: Profile) -> float:
        """The share of its card's memory the server takes, whatever it needs (a REPO_SNAPSHOT plan's card)."""
        return 1.0

    def kv_bytes(self, profile: Profile) -> int | None:
        """Bytes per KV cache element when the profile sets them; None: the weights' dtype."""
        return None
