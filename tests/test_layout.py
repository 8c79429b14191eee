"""The house's rules, checked on every run: the folders are the layers (import-linter's contracts in
pyproject.toml), no import cycle, and no module that has grown past one idea."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fleet.core.config import TURN_SHAPES
from fleet.probes.renderings import TURN_SHAPES as RENDERED_SHAPES

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400


def test_imports_keep_the_layers_and_close_no_cycle(tmp_path: Path) -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    run = subprocess.run(
        [str(lint), "--no-logo", "--cache-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 kept, 0 broken" in run.stdout


def test_no_module_over_400_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / "fleet").rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these along their ideas: {long}"


def test_fleet_toml_knows_the_turn_shapes_the_renderings_check_renders() -> None:
    assert tuple(RENDERED_SHAPES) == TURN_SHAPES
