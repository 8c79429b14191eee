"""fleet.toml -> typed, validated settings. Every error names the file, the key and the problem."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator, model_validator

from fleet.core import paths
from fleet.core.countries import ISO_3166_ALPHA_2
from fleet.core.gatewaysettings import Gateway

# A profile's own models live in profiles.py; fleet.toml's settings hold them, so they are named here too.
from fleet.core.profiles import (
    NAME,
    TURN_SHAPES,
    ModelFile,
    Profile,
    ProfileProbes,
    Strict,
    Traffic,
    VoiceTarget,
)
from fleet.core.services import HUGGING_FACE, ConfigError, Database, Hub, Provider, verified_database_url

__all__ = [
    "TURN_SHAPES",
    "ConfigError",
    "Database",
    "Hub",
    "ModelFile",
    "Profile",
    "ProfileProbes",
    "Provider",
    "Settings",
    "Traffic",
    "VoiceTarget",
    "load",
    "verified_database_url",
]

DEFAULT_CONFIG = "fleet.toml"


class Filters(Strict):
    min_reliability: Annotated[float, Field(ge=0, le=1)] = 0.98
    min_cuda: Annotated[float, Field(ge=0)] = 12.8
    min_disk_gb: Annotated[float, Field(ge=0)] = 100
    min_direct_ports: Annotated[int, Field(ge=0)] = 2
    max_inet_usd_per_gb: Annotated[float, Field(ge=0)] = 0.05
    verified_only: bool = True
    # vast.ai's datacenter offers (hosting_type 1): machines in certified facilities, not someone's home.
    # Their operator still has root and sees what the GPU serves: this narrows whom you trust, no more.
    datacenter_only: bool = False
    # machines whose public address is fixed (vast.ai's static_ip): a dynamic address may change under a host,
    # which is then replaced (its machine not blamed). Off, such offers still rank after a static one of the same
    # expected price.
    static_ip_only: bool = False
    # vast.ai stops an instance when its machine's contract ends: an offer must run at least this long
    min_contract_hours: Annotated[float, Field(ge=0)] = 48
    # a 15-20 GB pull at 128 Mbit/s takes about 20 minutes (dstack asks for inet_down > 128)
    min_inet_down_mbps: Annotated[float, Field(ge=0)] = 128
    search_limit: Annotated[int, Field(ge=1, le=10_000)] = 1000  # offers one search may answer


class Timeouts(Strict):
    create_to_running: Annotated[float, Field(gt=0)] = 600
    # vast.ai's reads lag its create: how long a new instance may stay unlisted before it counts as gone.
    instance_visible: Annotated[float, Field(gt=0)] = 60
    # How long an instance may read `offline`/`unknown` (a late heartbeat) before it counts as failed.
    heartbeat_gap: Annotated[float, Field(gt=0)] = 120
    ssh: Annotated[float, Field(gt=0)] = 120
    host_key: Annotated[float, Field(gt=0)] = 180  # a new host's key announced in its logs, read till then
    port_check: Annotated[float, Field(gt=0)] = 30  # the listed service port answering the host's check
    pull: Annotated[float, Field(gt=0)] = 3600
    pull_stall: Annotated[float, Field(gt=0)] = 120  # a pull whose bytes stop growing this long fails then
    # On a slow link the pull may take longer than `pull`: as long as the files need at this share of the
    # download speed the offer advertised.
    pull_speed_share: Annotated[float, Field(gt=0, le=1)] = 0.25
    load: Annotated[float, Field(gt=0)] = 600
    probes: Annotated[float, Field(gt=0)] = 600
    stop: Annotated[float, Field(gt=0)] = 300  # a standby host's stop, until the marketplace reads `stopped`
    # A standby host's start, until it runs: past it (its machine's GPU taken by someone else, say) the
    # host is destroyed and a cold bring-up takes its place.
    standby_start: Annotated[float, Field(gt=0)] = 120


class Caps(Strict):
    max_hosts_total: Annotated[int, Field(ge=0)] = 8
    max_hosts_per_model: Annotated[int, Field(ge=0)] = 4
    max_usd_per_hour: Annotated[float, Field(ge=0)] = 5.0


class Up(Strict):
    max_attempts: Annotated[int, Field(ge=1, le=50)] = 5
    pull_connections: Annotated[int, Field(ge=1, le=16)] = 8
    blacklist_hours: Annotated[float, Field(ge=0)] = 72
    # A process working on a host (bringing it up, draining, destroying) holds it for this long and renews
    # it every third of it; housekeeping in other processes leaves it alone until it runs out.
    lease_s: Annotated[float, Field(ge=3, le=3600)] = 60


class PlanConfig(Strict):
    """What the VRAM planner adds beyond weights and cache (DOMAIN.md: ~570 MiB measured on a 3090)."""

    runtime_overhead_mib: Annotated[float, Field(ge=0)] = 570
    headroom_mib: Annotated[float, Field(ge=0)] = 512

    def runtime_mib_for(self, profile: Profile) -> float:
        """The profile's measured runtime, else the default."""
        return profile.runtime_mib if profile.runtime_mib is not None else self.runtime_overhead_mib


class Rotation(Strict):
    """Health sweeps, repricing and replacement (make-before-break)."""

    unhealthy_after_sweeps: Annotated[int, Field(ge=1)] = 2
    health_timeout_s: Annotated[float, Field(gt=0)] = 10
    max_concurrent_replacements: Annotated[int, Field(ge=1)] = 1
    drain_timeout_s: Annotated[float, Field(ge=0)] = 120
    reprice_min_percent: Annotated[float, Field(ge=0)] = 10
    reprice_min_usd_per_month: Annotated[float, Field(ge=0)] = 10
    endpoints_file: str | None = None  # default: endpoints.json in fleet's state directory
    health_every_s: Annotated[float, Field(gt=0)] = 60
    reconcile_every_s: Annotated[float, Field(gt=0)] = 600
    thermal_every_s: Annotated[float, Field(ge=0)] = 21600  # thermal re-probes of READY hosts (0: never)
    reprice_cron: str = "0 3 * * *"
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 9464
    # a host whose machine's contract (vast.ai stops it at the end) or whose certificate ends within this many
    # hours is replaced, make-before-break
    contract_margin_hours: Annotated[float, Field(ge=0)] = 6
    # the daemon warns when the account's credit lasts fewer hours than this at the current spend
    credit_warn_hours: Annotated[float, Field(ge=0)] = 48
    # what housekeeping wrote (the daemon's ticks, events no host owns, the offers each search saw) is kept this
    # many days, then pruned by the daemon (0: kept for good); hosts, their events and their bills stay
    retention_days: Annotated[float, Field(ge=0)] = 28

    @property
    def endpoints_path(self) -> Path:
        if self.endpoints_file:
            return Path(os.path.expanduser(self.endpoints_file))
        return paths.state_dir() / "endpoints.json"


class Probes(Strict):
    """The probes' thresholds (which probes `fleet up` runs is per profile)."""

    keepalive_gate: bool = True  # a server that closes after every streamed reply fails READY
    prompt_allowance_tokens: Annotated[int, Field(ge=0)] = 24  # template glue beyond the appended text
    thermal_min_share: Annotated[float, Field(gt=0, le=1)] = 0.8  # one-caller rate now / cold
    thermal_max_gpu_c: Annotated[float, Field(gt=0)] = 87
    thermal_max_memory_c: Annotated[float, Field(gt=0)] = 95


class Serve(Strict):
    """What the daemon keeps for one profile in one region: READY capacity for `calls` concurrent calls with
    `headroom` on top, and `standby` stopped hosts in the pool. Capacity is each READY host's measured
    callers at the voice target (`fleet bench`), or its profile's slots until measured."""

    model: str
    region: str
    calls: Annotated[int, Field(ge=0)] = 0  # 0: no sizing, only the pool
    headroom: Annotated[float, Field(ge=0, le=10)] = 0.2
    standby: Annotated[int, Field(ge=0, le=64)] = 0
    port: Annotated[int, Field(ge=1, le=65535)] | None = None  # its gateway endpoint (default: gateway.port + index)


class Settings(Strict):
    source: Path = Path(DEFAULT_CONFIG)
    provider: Provider
    hub: Hub = Hub()
    database: Database = Database()
    regions: dict[str, Annotated[list[str], Field(min_length=1)]]
    filters: Filters = Filters()
    timeouts: Timeouts = Timeouts()
    caps: Caps = Caps()
    up: Up = Up()
    probes: Probes = Probes()
    plan: PlanConfig = PlanConfig()
    rotation: Rotation = Rotation()
    models: dict[str, Profile]
    serve: list[Serve] = []
    gateway: Gateway = Gateway()

    @field_validator("models")
    @classmethod
    def _model_names(cls, v: dict[str, Profile]) -> dict[str, Profile]:
        for name in v:
            if not re.fullmatch(NAME, name):
                raise ValueError(f"{name!r}: a profile name is letters, digits, '_', '.' and '-' (at most 64)")
        return v

    @field_validator("regions")
    @classmethod
    def _regions(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, codes in v.items():
            if not re.fullmatch(NAME, name):
                raise ValueError(f"{name!r}: a region name is letters, digits, '_', '.' and '-' (at most 64)")
            bad = [c for c in codes if c not in ISO_3166_ALPHA_2]
            if bad:
                raise ValueError(f"{name}: not ISO 3166 country codes (two capital letters): {bad}")
        return v

    @model_validator(mode="after")
    def _serve(self) -> Settings:
        seen: set[tuple[str, str]] = set()
        for i, target in enumerate(self.serve):
            if target.model not in self.models:
                raise ValueError(f"serve.{i}.model: no model profile {target.model!r}")
            if target.region not in self.regions and not re.fullmatch(r"[A-Z]{2}", target.region):
                raise ValueError(f"serve.{i}.region: no region {target.region!r}")
            if (target.model, target.region) in seen:
                raise ValueError(f"serve.{i}: {target.model} in {target.region} is named twice")
            seen.add((target.model, target.region))
        ports = [t.port or self.gateway.port + i for i, t in enumerate(self.serve)]  # each gateway endpoint's
        for i, port in enumerate(ports):
            if port in ports[:i] or port == self.gateway.metrics_port:
                raise ValueError(f"serve.{i}.port: {port} is taken by another gateway endpoint or its metrics")
        peers = [p.split("=", 1)[0] for p in self.gateway.peers]
        if peers and self.gateway.peer_name not in peers:
            raise ValueError("gateway.peer_name: name this instance among gateway.peers")
        return self

    def profile(self, name: str) -> Profile:
        if name not in self.models:
            raise ConfigError(f"{self.source}: no model profile {name!r} (have: {', '.join(sorted(self.models))})")
        return self.models[name]

    def region(self, name: str) -> list[str]:
        """The country codes of a region of fleet.toml, or of one country code (any case)."""
        return self.regions.get(name) or [self.region_name(name)]

    def region_name(self, name: str) -> str:
        """The region as fleet records it: a name of fleet.toml's, or an ISO 3166 country code in capitals."""
        if name in self.regions:
            return name
        if name.upper() in ISO_3166_ALPHA_2:
            return name.upper()
        raise ConfigError(
            f"{self.source}: no region {name!r} (have: {', '.join(sorted(self.regions))}, or an ISO 3166 country "
            "code such as DE)"
        )

    def hub_url(self, local_cloud_url: str | None) -> str:
        if self.hub.url == "auto":
            return local_cloud_url if (self.provider.is_local and local_cloud_url) else HUGGING_FACE
        return self.hub.url.rstrip("/")


def _describe(error: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in error["loc"] if p not in ("function-after",))
    msg = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        msg = "unknown key"
    elif error["type"] == "missing":
        msg = "missing"
    return f"{loc}: {msg}" if loc else msg


def load(path: Path | str | None = None) -> Settings:
    """Read and validate fleet.toml (FLEET_CONFIG or ./fleet.toml when no path is given) as far as what every
    profile shares: fleet/engines/registry.py's load holds each profile to its engine's rules too."""
    path = Path(path or os.environ.get("FLEET_CONFIG") or DEFAULT_CONFIG)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file (pass --config or set FLEET_CONFIG)") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: a folder, not a config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    models = raw.get("models")
    if isinstance(models, dict):
        raw["models"] = {k: {**v, "name": k} if isinstance(v, dict) else v for k, v in models.items()}
    try:
        return Settings(source=path, **raw)
    except ValidationError as e:
        errors = e.errors()
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(f"{path}: {_describe(errors[0])}{more}") from None
    except TypeError as e:
        raise ConfigError(f"{path}: {e}") from None
