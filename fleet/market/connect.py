"""From settings to a marketplace client: the local cloud (started on demand) or vast.ai."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fleet.config import ConfigError, Settings
from fleet.localcloud import control
from fleet.market.vast import VastMarket


@dataclass(frozen=True)
class Endpoint:
    url: str
    api_key: str
    local_cloud_url: str | None  # the local cloud's own URL (its hub too), when the provider is local


def resolve(settings: Settings) -> Endpoint:
    """Where the marketplace is and the key for it. Starts the local cloud when the provider is local."""
    if settings.provider.is_local:
        info = control.start(control.default_state_dir())
        return Endpoint(info.url, info.api_key(), info.url)
    key = os.environ.get(settings.provider.api_key_env)
    if not key:
        path = Path(os.path.expanduser(settings.provider.api_key_file))
        if path.exists():
            key = path.read_text().strip()
    if not key:
        raise ConfigError(
            f"{settings.source}: provider.api_key_env: no API key in ${settings.provider.api_key_env} "
            f"nor in {settings.provider.api_key_file}"
        )
    return Endpoint(settings.provider.url, key, None)


def open_market(endpoint: Endpoint, settings: Settings) -> VastMarket:
    return VastMarket(endpoint.url, endpoint.api_key, timeout_s=settings.provider.request_timeout_s)
