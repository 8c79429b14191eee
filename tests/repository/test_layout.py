"""The house's rules, checked on every run: the folders are the layers (import-linter's contracts in
pyproject.toml), no import cycle, no module that has grown past one idea, and no module outside
fleet/engines/ that asks which engine it holds."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from fleet.core.config import TURN_SHAPES
from fleet.engines import registry
from fleet.engines.base import Engine
from fleet.probes.renderings import TURN_SHAPES as RENDERED_SHAPES

ROOT = Path(__file__).resolve().parents[2]
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


# The engines' own modules, and the local cloud: the marketplace's machines and the images' stand-in, which
# fleet's engines never reach (its contract forbids the import) and whose hosts run what their image holds.
ENGINE_FREE_EXEMPT = ("engines", "localcloud")
# The memory planners read their engine's cache flags and file sets (plan/memory.py llama.cpp's, plan/vllm.py
# and plan/snapshot.py vLLM's): they may import an engine's module; they still never compare engine names.
PLANNERS = ("plan",)


def engine_questions(path: Path, engine_modules: set[str], engine_classes: set[str], planner: bool) -> list[str]:
    """Where a module asks which engine it holds: a comparison with an engine's name or with anything called
    `engine`, a `match` on one, an engine's class named, or an engine's own module imported."""
    names = set(registry.ENGINES)
    found = []
    tree = ast.parse(path.read_text(), str(path))

    def called_engine(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "engine") or (
            isinstance(node, ast.Name) and node.id == "engine"
        )

    def compares_engine(node: ast.Compare) -> bool:
        """An engine's name on either side, or something called `engine` against a name (a database's
        `engine is None` is no question of which server)."""
        sides = (node.left, *node.comparators)
        if any(isinstance(n, ast.Constant) and n.value in names for n in sides):
            return True
        named = any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in sides)
        return named and any(called_engine(n) for n in sides)

    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Compare) and compares_engine(node):
            found.append(f"{where} compares an engine")
        elif isinstance(node, ast.Match) and called_engine(node.subject):
            found.append(f"{where} matches on an engine")
        elif isinstance(node, ast.Name) and node.id in engine_classes:
            found.append(f"{where} names {node.id}")
        elif isinstance(node, ast.ImportFrom) and not planner:
            module = node.module or ""
            imported = {module} | {f"{module}.{a.name}" for a in node.names}
            if imported & engine_modules:
                found.append(f"{where} imports an engine's module")
        elif isinstance(node, ast.Import) and not planner and {a.name for a in node.names} & engine_modules:
            found.append(f"{where} imports an engine's module")
    return found


def test_no_module_outside_the_engines_asks_which_engine_it_holds() -> None:
    """Issue 37: an engine is one module in fleet/engines/ behind base.py's contract; every other layer asks the
    engine (registry.engine_of) what to do, and a new engine adds no branch anywhere else."""
    engines = list(registry.ENGINES.values())
    modules = {type(e).__module__ for e in engines}
    classes = {type(e).__name__ for e in engines}
    assert all(isinstance(e, Engine) for e in engines) and modules == {
        "fleet.engines.llama_server",
        "fleet.engines.vllm",
    }
    found = [
        question
        for path in sorted((ROOT / "fleet").rglob("*.py"))
        if path.relative_to(ROOT).parts[1] not in ENGINE_FREE_EXEMPT
        for question in engine_questions(path, modules, classes, path.relative_to(ROOT).parts[1] in PLANNERS)
    ]
    assert found == [], found


def test_the_engine_test_finds_each_way_of_asking(tmp_path: Path) -> None:
    """The rule above, shown to catch what it forbids."""
    sample = tmp_path / "sample.py"
    text = (
        "from fleet.engines.vllm import block_tokens\n"
        "import fleet.engines.llama_server\n"
        "def f(profile, engine):\n"
        "    if profile.engine == 'vllm':\n"
        "        return 1\n"
        "    if engine != 'x':\n"
        "        return 2\n"
        "    match profile.engine:\n"
        "        case _:\n"
        "            return isinstance(engine, LlamaServer)\n"
    )
    sample.write_text(text)
    found = engine_questions(sample, {"fleet.engines.vllm", "fleet.engines.llama_server"}, {"LlamaServer"}, False)
    assert sorted(found) == [
        "sample.py:1 imports an engine's module",
        "sample.py:10 names LlamaServer",
        "sample.py:2 imports an engine's module",
        "sample.py:4 compares an engine",
        "sample.py:6 compares an engine",
        "sample.py:8 matches on an engine",
    ], found
    planner = engine_questions(sample, {"fleet.engines.vllm", "fleet.engines.llama_server"}, {"LlamaServer"}, True)
    assert not any("imports" in f for f in planner) and len(planner) == 4
