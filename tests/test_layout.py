"""The tree stays readable: no import cycle, no oversized file, a short training story,
and every setting's choices spelled once.

Read from the source with ``ast``: every import counts, those inside functions too (a
cycle broken only by a lazy import is still a cycle a reader has to hold in mind)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"inflight": "inflight", "engine_patches": "inflight.engine", "kernels": "inflight.kernels",
            "trainer": "inflight.trainer", "bench": "inflight.bench"}
"""Each top-level folder and the package name it imports as (one namespace: ``inflight/__init__.py``)."""
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports (``from a.b import c`` counts ``a.b.c`` when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)) is not None:
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_no_import_cycle_among_the_project_modules() -> None:
    modules = _modules()
    graph = {m: {n for n in _imports(p, modules) if n != m and not m.startswith(n + ".")} for m, p in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_source_file_is_over_the_limit() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules().values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_training_story_is_short() -> None:
    from inflight.trainer.train import train

    lines = inspect.getsource(train).splitlines()
    assert len(lines) <= 60, len(lines)


def test_each_settings_choice_list_is_declared_once() -> None:
    """A ``Literal`` of the same values in two places is one setting spelled twice."""
    seen: dict[tuple[str, ...], str] = {}
    twice = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
                elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                values = tuple(sorted(str(e.value) for e in elts if isinstance(e, ast.Constant)))
                if len(values) < 2:
                    continue
                where = f"{name}:{node.lineno}"
                if values in seen:
                    twice.append((values, seen[values], where))
                seen.setdefault(values, where)
    assert not twice, twice


def test_the_code_imports_one_namespace() -> None:
    """The folders import as ``inflight.*`` only: a module imported under its folder's own name
    too (``trainer.config`` beside ``inflight.trainer.config``) would be loaded twice, with two
    copies of its state, and the wheel has no such top-level name."""
    folders = set(PACKAGES) - {"inflight"}
    stray = []
    for path in [*_modules().values(), *(ROOT / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            stray += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in folders]
    assert not stray, stray
