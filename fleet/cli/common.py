"""What every command shares: its options, reading fleet.toml, running one library call with its errors
mapped to one line and an exit code (0 ok, 1 failed, 2 bad input), and progress for people on stderr."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, NoReturn, TypeVar

import httpx
import typer

from fleet.cli.render import print_json, warn
from fleet.core import config
from fleet.core.errors import BadInput, FleetError
from fleet.engines import registry

T = TypeVar("T")

ConfigPath = Annotated[
    Path | None, typer.Option("--config", "-c", help="fleet.toml to use (default: $FLEET_CONFIG or ./fleet.toml).")
]
Model = Annotated[str, typer.Option("--model", "-m", help="Model profile from fleet.toml.")]
Region = Annotated[str, typer.Option("--region", "-r", help="Region from fleet.toml, or a country code.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
ByPrice = Annotated[
    bool, typer.Option("--by-price", help="Rank by effective $/h alone, not by expected $/voice-minute.")
]
StateDir = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        help="The local cloud's state directory (default: $FLEET_LOCALCLOUD_DIR or ~/.local/state/fleet/localcloud).",
    ),
]


def one_line(error: FleetError) -> str:
    """A fleet error as the one line a user reads: its area (marketplace, plan, ...) or its kind, then why."""
    if error.prefix:
        return f"{error.prefix}: {error}"
    return str(error) if isinstance(error, BadInput) else f"{type(error).__name__}: {error}"


def fail(message: str, code: int = 1) -> NoReturn:
    """One line and the exit code; under --json the line is `{"error": ...}` on stdout, for scripts."""
    if "--json" in sys.argv[1:]:
        print_json({"error": message})
    else:
        warn(("error:", "red"), f" {message}")
    raise typer.Exit(code)


def load_settings(path: Path | None) -> config.Settings:
    try:
        return registry.load(path)
    except config.ConfigError as e:
        fail(str(e), 2)


def run_async(make: Callable[[], Awaitable[T]]) -> T:
    """Run one library call; map its errors to one-line messages and exit codes."""
    try:
        return asyncio.run(make())  # type: ignore[arg-type]
    except FleetError as e:
        fail(one_line(e), e.exit_code)
    except (httpx.HTTPError, OSError) as e:
        fail(f"{type(e).__name__}: {e}")
    except KeyboardInterrupt:
        fail("interrupted (what was being created has been destroyed)", 130)


def checked_model_and_region(
    settings: config.Settings, model: str, region: str, max_price: float | None = None
) -> tuple[config.Profile, str]:
    """The profile and the region as fleet records it (a country code in capitals), after the arguments:
    one line and exit 2 for bad input."""
    if max_price is not None and max_price <= 0:
        fail("--max-price must be positive", 2)
    try:
        return settings.profile(model), settings.region_name(region)
    except config.ConfigError as e:
        fail(str(e), 2)


def checked_bring_up(
    settings: config.Settings, model: str, region: str, count: int, max_price: float | None
) -> tuple[config.Profile, str]:
    """The profile and region of an `up` or `standby`, after its arguments: one line and exit 2 for bad input."""
    if count < 1:
        fail("--count must be at least 1", 2)
    return checked_model_and_region(settings, model, region, max_price)


class ConsoleReporter:
    """Progress for people, on stderr: one line per step, pull progress at most every few seconds."""

    def __init__(self) -> None:
        self._shown: dict[tuple[str, str], float] = {}

    def info(self, host: str, message: str) -> None:
        warn((host, "bold"), f" {message}")  # a host's words: never markup, never an escape sequence

    def progress(self, host: str, what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._shown.get((host, what), 0.0) < 3.0:
            return
        self._shown[(host, what)] = now
        pct = 100.0 * done / total if total else 100.0
        warn((host, "bold"), f" pull {what}: {pct:5.1f}% of {total / 1e6:,.1f} MB")


def reporter(json_output: bool) -> ConsoleReporter | None:
    """Progress on stderr for people; none under --json."""
    return None if json_output else ConsoleReporter()
