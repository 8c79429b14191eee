"""Building a Fleet for tests: the repo's fleet.toml with a private database and short timeouts,
pointed at the module's local cloud."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fleet.app import Fleet, open_fleet
from fleet.core import config
from fleet.engines import registry

ROOT = Path(__file__).resolve().parents[1]


def settings_for(tmp: Path, **sections: dict[str, Any]) -> config.Settings:
    """The repo's fleet.toml, with the database in `tmp` and any section's keys overridden."""
    base = registry.load(ROOT / "fleet.toml")
    update: dict[str, Any] = {
        "database": config.Database(path=str(tmp / "fleet.db")),
        "rotation": base.rotation.model_copy(
            update={"endpoints_file": str(tmp / "endpoints.json"), **sections.pop("rotation", {})}
        ),
    }
    for name, values in sections.items():
        current = getattr(base, name)
        update[name] = current.model_copy(update=values)
    update.setdefault(
        "timeouts",
        # a test bed's deadlines, with room for a busy machine (a second core hogged): dead hosts still fail
        # in seconds where it matters, by their own signs, not by these
        base.timeouts.model_copy(update={"create_to_running": 60, "ssh": 60, "pull": 60, "load": 30, "probes": 60}),
    )
    return base.model_copy(update=update)


@asynccontextmanager
async def fleet_for(settings: config.Settings) -> AsyncIterator[Fleet]:
    async with open_fleet(settings) as fleet:
        yield fleet


def with_variant(
    settings: config.Settings,
    name: str,
    *,
    file: str | None = None,
    extra_args: list[str] | None = None,
    args: list[str] | None = None,
    on_up: list[str] | None = None,
    **profile: object,
) -> config.Settings:
    """Add a profile made from `tiny`: another hub file, other llama-server flags (its slots follow `-np`),
    other probes on up, other profile keys (`chat_template`, `accept_template_breaks`)."""
    tiny = settings.models["tiny"]
    files = [tiny.files[0].model_copy(update={"file": file, "sha256": None})] if file else tiny.files
    probes = tiny.probes.model_copy(update={"on_up": on_up}) if on_up is not None else tiny.probes
    if args is not None and "-np" in args:
        profile.setdefault("slots", int(args[args.index("-np") + 1]))  # as a profile's validator holds them
    variant = tiny.model_copy(
        update={
            "name": name,
            "files": files,
            "probes": probes,
            "args": [*(args if args is not None else tiny.args), *(extra_args or [])],
            **profile,
        }
    )
    return settings.model_copy(update={"models": {**settings.models, name: variant}})


SHIPPED_SERVE = '[[serve]]\nmodel = "tiny"\nregion = "eu"\ncalls = 0\n'


def without_shipped_serve(text: str) -> str:
    """fleet.toml's text without its [[serve]] table (the demo's tiny target in the EU)."""
    assert SHIPPED_SERVE in text
    return text.replace(SHIPPED_SERVE, "", 1)


def write_config(tmp: Path, extra: str = "") -> Path:
    """The repo's fleet.toml with the database in `tmp` (and any extra TOML), for the CLI to read. Extra
    [[serve]] tables replace the shipped one."""
    text = (ROOT / "fleet.toml").read_text()
    if "[[serve]]" in extra:
        text = without_shipped_serve(text)
    text = text.replace("[database]\n", f'[database]\npath = "{tmp}/fleet.db"\n', 1)
    text = text.replace("[rotation]\n", f'[rotation]\nendpoints_file = "{tmp}/endpoints.json"\n', 1)
    assert f"{tmp}/endpoints.json" in text and f"{tmp}/fleet.db" in text
    path = tmp / "fleet.toml"
    path.write_text(text + extra)
    return path


async def ranked_offers(settings: config.Settings) -> list:
    """The offers `fleet up --model tiny --region eu` would try, in its order."""
    async with fleet_for(settings) as fleet:
        return (await fleet.offers("tiny", "eu", exclude_unusable=True)).passed


async def first_machine(settings: config.Settings) -> int:
    """The machine `fleet up` would rent first."""
    return (await ranked_offers(settings))[0].machine_id


def cli_env(cloud, tmp: Path) -> dict[str, str]:
    """The environment a `fleet` command runs with in a test: the repo's fleet.toml with its database in `tmp`,
    and the module's local cloud (its faults cleared)."""
    cloud.set_faults({})
    return {**os.environ, "FLEET_CONFIG": str(write_config(tmp)), "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir)}
