"""`fleet cloud start|stop|status`: the local cloud, a vast.ai-compatible marketplace on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from fleet.app import open_fleet
from fleet.cli import render
from fleet.cli.common import ConfigPath, JsonFlag, StateDir, fail, reporter, run_async
from fleet.control.destroy import destroy_all_on
from fleet.core import config
from fleet.engines import registry
from fleet.localcloud import control


def cloud_start(
    state_dir: StateDir = None,
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1 (0: any free port).")] = 0,
    json_output: JsonFlag = False,
) -> None:
    """Start the local cloud (no-op when it already runs)."""
    directory = state_dir or control.default_state_dir()
    try:
        info = control.start(directory, port=port)
    except control.CloudControlError as e:
        fail(str(e))
    status = control.status(directory)
    if json_output:
        render.print_json(status)
    else:
        render.line(f"local cloud at {info.url} (pid {info.pid}); API key in {info.api_key_file}")


def cloud_stop(state_dir: StateDir = None, json_output: JsonFlag = False, config_path: ConfigPath = None) -> None:
    """Stop the local cloud. Its hosts go with it: those fleet.toml's record holds are destroyed first (their
    bills closed), so no host stays `ready` in the record once the cloud that ran it is gone."""
    directory = state_dir or control.default_state_dir()
    running = control.find(directory)
    settled: list[str] = []
    if running is not None:
        settings = _settings_of(config_path, directory)
        if settings is not None:

            async def go() -> Any:
                async with open_fleet(settings, reporter(json_output)) as fleet:
                    return await destroy_all_on(fleet, running.url)

            settled = [h.name for h in run_async(go).done]
    stopped = control.stop(directory)
    if json_output:
        render.print_json({"stopped": stopped, "destroyed": settled})
    else:
        for name in settled:
            render.line(f"{name}: destroyed (its cloud is stopping)")
        render.line("local cloud stopped" if stopped else "local cloud was not running")


def _settings_of(config_path: Path | None, directory: Path) -> config.Settings | None:
    """fleet.toml's settings when its provider is this local cloud; None when there is none to read, or it
    rents elsewhere."""
    try:
        settings = registry.load(config_path)
    except config.ConfigError as e:
        if config_path is not None:
            fail(str(e), 2)
        return None
    if not settings.provider.is_local or control.default_state_dir() != directory:
        return None
    return settings


def cloud_status(state_dir: StateDir = None, json_output: JsonFlag = False) -> None:
    """Where the local cloud listens, where its API key is, and how many instances it has."""
    status = control.status(state_dir or control.default_state_dir())
    if json_output:
        render.print_json(status)
        return
    render.pairs(status)
