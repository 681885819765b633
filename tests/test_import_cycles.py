"""No import cycle inside ``kvtune/``: imports are read statically (``ast``), module-level and
function-level apart. Module-level cycles are forbidden everywhere; cycles through function-level
(lazy) imports are forbidden in the packages listed in ``NO_LAZY_CYCLES`` and are listed (not
failed) elsewhere."""
from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kvtune"
NO_LAZY_CYCLES = ("kvtune.sim", "kvtune.recommend")
"""Packages where even a lazy (function-level) import may not close a cycle."""


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST, mod: str, is_pkg: bool, known: set[str]
             ) -> Iterable[tuple[str, bool]]:
    """(imported kvtune module, at function level?) for every import in ``tree``; imports under
    ``if TYPE_CHECKING:`` are not imports at run time and are left out."""

    def target(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST, lazy: bool) -> Iterable[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    yield from visit(sub, lazy)
                continue
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == PACKAGE and (t := target(alias.name)):
                        yield t, lazy
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (child.level - 1)]
                    src = ".".join(base + ([child.module] if child.module else []))
                else:
                    src = child.module or ""
                if src.split(".")[0] != PACKAGE:
                    continue
                for alias in child.names:  # ``from pkg import submodule`` imports the submodule
                    t = target(f"{src}.{alias.name}")
                    if t:
                        yield t, lazy
            yield from visit(child, inner)

    yield from visit(tree, False)


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module-level edges, function-level edges) between kvtune's modules."""
    mods = modules(root)
    known = set(mods)
    top: dict[str, set[str]] = {m: set() for m in mods}
    lazy: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for dep, is_lazy in _imports(tree, mod, path.name == "__init__.py", known):
            # a package imported by its own submodule is already being imported: not an edge
            if dep != mod and not mod.startswith(dep + "."):
                (lazy if is_lazy else top)[mod].add(dep)
    return top, lazy


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def strong(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def merged(a: dict[str, set[str]], b: dict[str, set[str]]) -> dict[str, set[str]]:
    return {k: a.get(k, set()) | b.get(k, set()) for k in set(a) | set(b)}


def test_the_graph_sees_kvtunes_own_imports():
    top, lazy = import_graph()
    assert "kvtune.spans" in top["kvtune.sim.config"]
    assert "kvtune.sim.result" in top["kvtune.sim"]
    # a lazy import is noted as such (the CLI loads its subcommands on demand)
    assert not top["kvtune.cli"] & {"kvtune.sim.cli"}


def test_cycle_finder_finds_a_planted_cycle(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from kvtune.sub import a\n")
    (pkg / "sub" / "a.py").write_text("from kvtune.sub.b import x\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from kvtune.sub import c\n"
                                      "def f():\n    from . import a\n")
    (pkg / "sub" / "c.py").write_text("from kvtune.sub import b\n")
    top, lazy = import_graph(tmp_path)
    assert cycles(top) == []
    assert cycles(merged(top, lazy)) == [["kvtune.sub.a", "kvtune.sub.b"]]
    assert top["kvtune.sub.b"] == set()  # TYPE_CHECKING imports are not run-time imports


def test_no_module_level_import_cycle():
    top, _ = import_graph()
    found = cycles(top)
    assert not found, f"module-level import cycles in kvtune/: {found}"


@pytest.mark.parametrize("package", NO_LAZY_CYCLES)
def test_no_cycle_even_through_lazy_imports(package):
    top, lazy = import_graph()
    found = [c for c in cycles(merged(top, lazy)) if any(m == package or m.startswith(package + ".")
                                                        for m in c)]
    assert not found, f"import cycles through {package} (function-level imports included): {found}"
