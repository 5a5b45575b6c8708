"""The tree stays readable: no import cycle, no function over about a screen, a short
training story, and every setting's choices spelled once. Files are split by role, not by
size: a class stays whole in one file however long.

Read from the source with ``ast``: every import counts, those inside functions too (a
cycle broken only by a lazy import is still a cycle a reader has to hold in mind)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"inflight": "inflight", "engine_patches": "inflight.engine", "kernels": "inflight.kernels",
            "trainer": "inflight.trainer", "bench": "inflight.bench"}
"""Each top-level folder and the package name it imports as (one namespace: ``inflight/__init__.py``)."""
MAX_FUNCTION_LINES = 60
"""The longest function (signature and docstring included) in the library's folders; the
benchmark scripts in ``bench/`` read top to bottom and are exempt."""


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
    """The project modules ``path`` imports (``from a.b import c`` counts ``a.b.c`` when that is a
    module), and the packages above each: importing ``a.b.c`` runs ``a/__init__.py`` and
    ``a/b/__init__.py`` first, so a package that imports its importer is a cycle too."""
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
            while name:
                if name in modules:
                    found.add(name)
                name = name.rpartition(".")[0]
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


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports, less itself and its own packages (already
    importing when it runs)."""
    return {m: {n for n in _imports(p, modules) if n != m and not m.startswith(n + ".")} for m, p in modules.items()}


def test_no_import_cycle_among_the_project_modules() -> None:
    graph = _graph(_modules())
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def _shared_file_names(paths: list[Path]) -> dict[str, list[str]]:
    """File names that two or more modules carry (``__init__.py`` and ``conftest.py``, whose
    names are the language's and pytest's, aside)."""
    seen: dict[str, list[str]] = {}
    for p in paths:
        if p.name not in ("__init__.py", "conftest.py"):
            seen.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    return {name: where for name, where in seen.items() if len(where) > 1}


def test_no_two_modules_share_a_file_name() -> None:
    """A file name says its module's role once: ``config.py`` in two folders is two roles under one name."""
    paths = [*_modules().values(), *(ROOT / "tests").rglob("*.py")]
    assert not (shared := _shared_file_names(paths)), shared


def test_the_name_check_finds_a_shared_name() -> None:
    paths = [ROOT / "a" / "config.py", ROOT / "b" / "config.py", ROOT / "a" / "__init__.py", ROOT / "b" / "__init__.py"]
    assert _shared_file_names(paths) == {"config.py": ["a/config.py", "b/config.py"]}


def test_every_import_of_a_test_helper_names_a_file_that_exists() -> None:
    """``from tests.x import y`` in a test names a module of ``tests/`` (a test moved between
    tiers leaves no import of its old path behind: collection would fail on it)."""
    missing = []
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tests":
                target = ROOT.joinpath(*node.module.split("."))
                if not (target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}")
    assert not missing, missing


def test_a_package_that_imports_its_importer_is_a_cycle(tmp_path: Path) -> None:
    """``pkg/__init__.py`` imports ``other``, and ``other`` imports ``pkg.base``: importing
    ``other`` first fails at run time (the package is half initialised), so the check finds it."""
    (tmp_path / "pkg").mkdir()
    files = {"pkg/__init__.py": "from other import Thing\n", "pkg/base.py": "class Base: ...\n",
             "other.py": "from pkg.base import Base\n\nclass Thing(Base): ...\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    modules = {"pkg": tmp_path / "pkg" / "__init__.py", "pkg.base": tmp_path / "pkg" / "base.py",
               "other": tmp_path / "other.py"}
    assert _cycle(_graph(modules)) == ["other", "pkg", "other"]


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """Each function in ``source`` over ``limit`` lines (its nested functions count in it)."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_no_function_is_longer_than_a_screen() -> None:
    long = {f"{name}.{fn}": n for name, p in _modules().items() if not name.startswith("inflight.bench")
            for fn, n in _long_functions(p.read_text(), MAX_FUNCTION_LINES)}
    assert not long, long


def test_the_length_check_finds_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(f"def f():\n{body}\n", MAX_FUNCTION_LINES) == [("f", MAX_FUNCTION_LINES + 1)]
    assert _long_functions(f"def f():\n{body}\n", MAX_FUNCTION_LINES + 1) == []


def test_the_training_story_is_short() -> None:
    from inflight.trainer.train import train

    lines = inspect.getsource(train).splitlines()
    assert len(lines) <= 60, len(lines)


def _literals(source: str) -> list[tuple[frozenset[str], int]]:
    """The values spelled in each ``Literal[...]`` of ``source`` (not those it takes from
    another ``Literal`` by name) and its line."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            out.append((frozenset(str(e.value) for e in elts if isinstance(e, ast.Constant)), node.lineno))
    return out


def _spelled_twice(sources: dict[str, str]) -> list[tuple[list[str], str, str]]:
    """Pairs of ``Literal``s that spell two or more of the same values: one list of choices
    written twice, or a part of one (a subset, an overlap) that should be built from it."""
    found = [(values, f"{name}:{line}") for name, src in sources.items() for values, line in _literals(src)]
    return [(sorted(a & b), wa, wb) for i, (a, wa) in enumerate(found) for b, wb in found[i + 1:] if len(a & b) >= 2]


def test_each_settings_choice_list_is_declared_once() -> None:
    sources = {name: path.read_text() for name, path in _modules().items()}
    assert not (twice := _spelled_twice(sources)), twice


def test_the_choice_check_finds_a_list_spelled_twice() -> None:
    assert (_spelled_twice({"a": 'X = Literal["p", "q", "r"]', "b": 'Y = Literal["q", "r"]'})
            == [(["q", "r"], "a:1", "b:1")])
    assert _spelled_twice({"a": 'X = Literal["p", "q"]\nY = Literal["r", X]'}) == []  # built from X: one spelling
    assert _spelled_twice({"a": 'X = Literal["p", "q"]', "b": 'Y = Literal["p", "s"]'}) == []  # one value alike


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


def _cited_tests(text: str) -> list[tuple[str, str | None]]:
    """The tests a document cites: ``tests/<tier>/test_x.py`` (name None) and ``tests/<tier>/test_x.py::name``,
    a bare ``::name`` meaning one more test of the file cited last."""
    cited, last = [], None
    for m in re.finditer(r"tests/((?:unit|engine)/\w+\.py)(?:::(\w+))?|::(\w+)", text):
        if m.group(1):
            last = m.group(1)
            cited.append((last, m.group(2)))
        elif last is not None:
            cited.append((last, m.group(3)))
    return cited


def test_the_docs_cite_tests_that_exist() -> None:
    """A guarantee names the test that shows it: a renamed or deleted test leaves it unproven."""
    stale = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        stale += [f"{doc.name}: tests/{f} (not in a tier: tests/unit/ or tests/engine/)"
                  for f in re.findall(r"tests/(test_\w+\.py)", doc.read_text())]
        for file, name in _cited_tests(doc.read_text()):
            path = ROOT / "tests" / file
            if not path.exists():
                stale.append(f"{doc.name}: tests/{file}")
            elif name is not None and name not in {n.name for n in ast.walk(ast.parse(path.read_text()))
                                                   if isinstance(n, (ast.FunctionDef, ast.ClassDef))}:
                stale.append(f"{doc.name}: tests/{file}::{name}")
    assert not stale, stale


def test_the_citation_reader_follows_the_last_file() -> None:
    text = "`tests/unit/test_a.py::test_one`, `::test_two`; `tests/engine/test_b.py`, `::test_three`"
    assert _cited_tests(text) == [("unit/test_a.py", "test_one"), ("unit/test_a.py", "test_two"),
                                  ("engine/test_b.py", None), ("engine/test_b.py", "test_three")]


def _defined(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level (in ``if``/``try``/``with``/``for`` blocks
    too): functions, classes and assigned names, not the names it imports."""
    names: set[str] = set()

    def targets(node: ast.AST) -> None:
        names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name))

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    targets(t)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
                targets(node.target)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if item.optional_vars is not None:
                        targets(item.optional_vars)
            for field in ("body", "orelse", "finalbody"):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                visit(handler.body)

    visit(tree.body)
    return names


def _imported_through(paths: list[Path], modules: dict[str, Path]) -> list[str]:
    """Each ``from <project module> import name`` in ``paths`` where ``name`` is neither
    defined in that module nor a module of its own: a name taken from a module it only passes
    through. Package ``__init__``s, which gather names on purpose, are exempt."""
    defined: dict[str, set[str]] = {}
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules):
                continue
            home = modules[node.module]
            if home.name == "__init__.py":
                continue
            if node.module not in defined:
                defined[node.module] = _defined(ast.parse(home.read_text()))
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                      if a.name not in defined[node.module] and f"{node.module}.{a.name}" not in modules]
    return found


def test_every_import_names_what_its_module_defines() -> None:
    """``from a import X`` takes ``X`` from the module that defines it, not from one that
    imports it for its own use: moving ``X`` (or that use) then breaks no importer silently."""
    modules = _modules()
    paths = [*modules.values(), *(ROOT / "tests").rglob("*.py")]
    assert not (stray := _imported_through(paths, modules)), stray
