"""Building a Fleet for tests: the repo's fleet.toml with a private database and short timeouts,
pointed at the module's local cloud."""

from __future__ import annotations

import math
import os
import re
import tomllib
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


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` laid over it, table by table: a table's keys are merged, any other value (a list
    of [[serve]] tables among them) replaces the base's, and None removes the key."""
    out = dict(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _key(key: str) -> str:
    return key if BARE_KEY.fullmatch(key) else _string(key)


def _string(s: str) -> str:
    return '"' + "".join(ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 32 or ord(c) == 127 else c) for c in s) + '"'


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        assert math.isfinite(value), value
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    raise TypeError(f"no TOML for {type(value).__name__}: fleet.toml holds none")


def toml_text(data: dict[str, Any], prefix: str = "") -> str:
    """TOML for the types fleet.toml uses: each table a [section] (its keys first, then its sub-tables), lists
    (of tables too) and tables within them inline."""
    lines = [f"{_key(k)} = {_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            name = f"{prefix}.{_key(k)}" if prefix else _key(k)
            lines += ["", f"[{name}]", toml_text(v, name).rstrip("\n")]
    return "\n".join(lines).strip("\n") + "\n"


def write_toml(path: Path, data: dict[str, Any]) -> Path:
    """`data` written to `path` as TOML, checked to read back as the same."""
    text = toml_text(data)
    assert tomllib.loads(text) == data, f"{path}: the TOML written does not read back as what was meant"
    path.write_text(text)
    return path


def config_data(tmp: Path, extra: str = "", **sections: Any) -> dict[str, Any]:
    """The repo's fleet.toml as data, with the database and the endpoints file in `tmp`; then `extra` (TOML
    text) and each section's keys laid over it (`merged`: [[serve]] tables given replace the shipped one)."""
    data = merged(
        tomllib.loads((ROOT / "fleet.toml").read_text()),
        {"database": {"path": f"{tmp}/fleet.db"}, "rotation": {"endpoints_file": f"{tmp}/endpoints.json"}},
    )
    return merged(merged(data, tomllib.loads(extra)), sections)


def write_config(tmp: Path, extra: str = "", *, file: str = "fleet.toml", **sections: Any) -> Path:
    """`config_data` written to `tmp/file`, for the CLI to read: `caps={"max_hosts_total": 1}` sets one key,
    `serve=None` drops the shipped [[serve]] table (the demo's tiny target in the EU)."""
    return write_toml(tmp / file, config_data(tmp, extra, **sections))


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
