"""Which engine serves a profile, and fleet.toml loaded with every profile held to its engine's rules.

A new engine is a module beside fleet/engines/llama_server.py keeping fleet/engines/base.py's contract, and its
line in ENGINES; a profile then names it in `engine`. fleet/core/config.py checks what every profile shares and
cannot know the engines (they sit above it): `load` here is fleet.toml as the rest of fleet reads it."""

from __future__ import annotations

from pathlib import Path

from fleet.core.config import ConfigError, Profile, Settings
from fleet.core.config import load as load_toml
from fleet.engines.base import Engine
from fleet.engines.llama_server import LlamaServer
from fleet.engines.vllm import Vllm

ENGINES: dict[str, Engine] = {e.name: e for e in (LlamaServer(), Vllm())}
LLAMA_SERVER = ENGINES["llama-server"]  # a profile's engine when it names none


def engine_of(profile: Profile) -> Engine:
    """The engine the profile names; ConfigError (one line) for a name no module serves."""
    try:
        return ENGINES[profile.engine]
    except KeyError:
        raise ConfigError(
            f"models.{profile.name}: engine {profile.engine!r} is not one of {', '.join(ENGINES)}"
        ) from None


def check_profile(profile: Profile) -> Profile:
    """The profile, held to its engine's rules; ConfigError naming the profile and the rule it breaks."""
    engine = engine_of(profile)
    try:
        engine.check_profile(profile)
    except ValueError as e:
        raise ConfigError(f"models.{profile.name}: {e}") from None
    return profile


def checked(settings: Settings) -> Settings:
    """The settings, each profile held to its engine's rules and each engine given its image; ConfigError
    (one line, fleet.toml's path first) at the first that is not."""
    for name, profile in settings.models.items():
        try:
            engine = engine_of(profile)
            check_profile(profile)
        except ConfigError as e:
            raise ConfigError(f"{settings.source}: {e}") from None
        if not engine.image(settings.provider):
            raise ConfigError(
                f"{settings.source}: models.{name}: engine = {engine.name!r} needs provider.{engine.image_setting}"
                f" (images/{engine.name}/)"
            )
    return settings


def load(path: Path | str | None = None) -> Settings:
    """Read and validate fleet.toml (FLEET_CONFIG or ./fleet.toml when no path is given): config.load, then
    every profile by its engine."""
    return checked(load_toml(path))
