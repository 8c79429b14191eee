"""Where fleet keeps what it writes, one rule for every file: state (the database, fleet's SSH key, the
endpoints file, the local cloud, reports, saved offers) under $FLEET_STATE_DIR, else $XDG_STATE_HOME/fleet,
else ~/.local/state/fleet; what can be made again (builds, GGUF headers read) under $FLEET_CACHE_DIR, else
$XDG_CACHE_HOME/fleet, else ~/.cache/fleet."""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    explicit = os.environ.get("FLEET_STATE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")) / "fleet"


def cache_dir() -> Path:
    explicit = os.environ.get("FLEET_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "fleet"
