"""Where fleet reaches what it works with, as fleet.toml names them: the marketplace and the images its
hosts boot, the model hub, the database. Every address is checked to cross no network in clear, and every
image off the local cloud to be pinned by digest."""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import SplitResult, parse_qs, urlsplit

from pydantic import Field, field_validator, model_validator

from fleet.core import paths
from fleet.core.errors import BadInput
from fleet.core.profiles import Strict

LOCAL = "local"
HUGGING_FACE = "https://huggingface.co"


class ConfigError(BadInput, ValueError):
    """A config problem: one line that names the file and the key."""


PROOF = r"^(sha256:[0-9a-f]{64})?$"
IMAGE = re.compile(r"[a-z0-9][a-z0-9._/-]{0,254}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?")


class Provider(Strict):
    url: str = LOCAL
    api_key_env: str = "VAST_API_KEY"
    api_key_file: str = "~/.config/vastai/vast_api_key"
    image: str
    # The image a vLLM profile's hosts boot (images/vllm/Dockerfile), under the same rules; "" when none is used
    vllm_image: str = ""
    # Instances in flight are read in one listing, at first every second, then less often as they age,
    # down to once per this many seconds (vast.ai's docs: boot takes minutes; poll every 10 s).
    poll_max_interval_s: Annotated[float, Field(ge=1, le=120)] = 10
    # How long one request to the marketplace may take. A create that times out is never sent again: its
    # instance, if any, is found by its label.
    request_timeout_s: Annotated[float, Field(gt=0, le=600)] = 30
    # How long a create may take: vast.ai's SDK waits 120 s for any request. A create that gave up sooner finds
    # its instance, if any, by its label after `timeouts.instance_visible`, having waited less than the SDK would.
    create_timeout_s: Annotated[float, Field(gt=0, le=600)] = 120
    # how long one request waits out the marketplace's 429s (Retry-After honoured) before it fails; a bring-up
    # phase's own deadline ends the wait sooner, and blames no machine for it
    rate_limited_wait_s: Annotated[float, Field(gt=0, le=3600)] = 600
    # how many times a request the marketplace answered 5xx (or whose connection broke) is sent, waiting 0.5 s
    # and twice as long each time after, up to 30 s: 8 tries give up after about a minute
    error_attempts: Annotated[int, Field(ge=1, le=20)] = 8
    # the images' compressed sizes: every new instance pulls its image at its machine's link (vast.ai: loading
    # "can take hours with slow internet/large images") and pays for the bytes; the boot's deadline grows with it
    image_gb: Annotated[float, Field(ge=0, le=200)] = 5.0
    vllm_image_gb: Annotated[float, Field(ge=0, le=200)] = 12.0
    # An image rented by its tag proves itself instead: "sha256:<64 hex>" of the manifest its build wrote (the
    # build prints it), which each new host shows over SSH before it pulls (fleet-image-proof). vast.ai may
    # turn a digest reference into a tag of its own; a machine may boot a stale copy of a tag.
    image_proof: Annotated[str, Field(pattern=PROOF)] = ""
    vllm_image_proof: Annotated[str, Field(pattern=PROOF)] = ""
    # the CPU architecture fleet's images are built for (images/*/Dockerfile: amd64): vast.ai lists arm64 machines
    # too (a GH200 passes every GPU filter), where an amd64 image cannot start
    image_arch: Literal["amd64", "arm64"] = "amd64"
    # A private image: the registry user, and the environment variable holding its token (vast.ai pulls
    # with `-u USER -p TOKEN REGISTRY`; the token goes only into the create call, never into a log).
    registry_user: Annotated[str, Field(pattern=r"^[^\s]*$", max_length=256)] = ""
    registry_token_env: str = "FLEET_REGISTRY_TOKEN"

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return v if v == LOCAL else encrypted_url(v)

    @model_validator(mode="after")
    def _image_by_digest(self) -> Provider:
        # A tag names whatever its registry says today: a host on vast.ai boots the image its digest names.
        for key, image in (("image", self.image), ("vllm_image", self.vllm_image)):
            if key == "vllm_image" and not image:
                continue
            if not IMAGE.fullmatch(image):
                raise ValueError(f"{key}: {image[:80]!r} is not an image reference (NAME[:TAG][@sha256:DIGEST])")
            if not self.is_local and "@sha256:" not in image and not getattr(self, f"{key}_proof"):
                raise ValueError(
                    f"{key}: pin it off the local cloud, by digest (NAME:TAG@sha256:<64 hex>) or by its manifest"
                    f' ({key}_proof = "sha256:<64 hex>", printed by the image\'s build): a tag can be moved to'
                    " other contents"
                )
        return self

    @property
    def is_local(self) -> bool:
        return self.url == LOCAL


class Hub(Strict):
    url: str = "auto"
    token_env: str = "HF_TOKEN"

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return v if v == "auto" else encrypted_url(v)


def encrypted_url(url: str) -> str:
    """An https:// URL; plain http:// only to this machine's loopback, where no one is on the path."""
    m = re.match(r"^(https?)://(\[[0-9a-fA-F:]+\]|[^\s/:]+)(:\d+)?(/\S*)?$", url)
    if not m:
        raise ValueError(f"must be an https:// URL, not {url!r}")
    host = m.group(2).strip("[]")
    if m.group(1) == "http" and not (host == "localhost" or _loopback(host)):
        raise ValueError(f"{url!r}: plain http crosses the network in clear; use https://")
    return url.rstrip("/")


def verified_database_url(url: str) -> str:
    """A PostgreSQL URL that reaches a server off this machine only with its certificate verified
    (sslmode=verify-full): the record holds every host's address, bill and nonce. A Unix socket or loopback
    needs none. The URL is never echoed: it may carry a password."""
    parts = urlsplit(url)
    if not parts.scheme.startswith("postgresql"):
        raise ValueError("must be a postgresql:// URL (SQLite is set with path)")
    remote = [h for h in _libpq_targets(parts) if not (h.startswith("/") or h == "localhost" or _loopback(h))]
    query = parse_qs(parts.query)
    if remote and query.get("sslmode") != ["verify-full"]:
        raise ValueError(
            f"PostgreSQL at {remote[0][:100]} is off this machine: add sslmode=verify-full to the URL "
            "(with sslrootcert= for a private CA), so that the server's certificate is checked"
        )
    return url


def _libpq_targets(parts: SplitResult) -> list[str]:
    """Where libpq will connect: each `hostaddr` when given (the `host` then only names the server for its
    certificate), else each `host` of the query, else the URL's hosts; a list in any of them is comma-separated."""
    query = parse_qs(parts.query)
    for key in ("hostaddr", "host"):
        found = [h.strip() for value in query.get(key, []) for h in value.split(",") if h.strip()]
        if found:
            return found
    netloc = parts.netloc.rpartition("@")[2]
    return [h[1 : h.index("]")] if h.startswith("[") else h.partition(":")[0] for h in netloc.split(",") if h]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Database(Strict):
    path: str | None = None  # the SQLite file; default: fleet.db in fleet's state directory (core/paths.py)
    # PostgreSQL instead of SQLite, for several daemons: postgresql+psycopg://user@host:port/db.
    # FLEET_DATABASE_URL overrides it (a password belongs in the environment, not in this file).
    url: str | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return verified_database_url(v) if v is not None else None

    @property
    def file(self) -> Path:
        return Path(os.path.expanduser(self.path)) if self.path else paths.state_dir() / "fleet.db"

    @property
    def target(self) -> Path | str:
        """The PostgreSQL URL when one is set, else the SQLite file."""
        if env := os.environ.get("FLEET_DATABASE_URL"):
            try:
                return verified_database_url(env)
            except ValueError as e:
                raise ConfigError(f"FLEET_DATABASE_URL: {e}") from None
        return self.url or self.file
