"""The test beds (`kvtune.testing`) stay out of the runtime path: no module of kvtune outside
``kvtune/testing`` imports them, and they are importable from the installed package."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import kvtune

PACKAGE = Path(kvtune.__file__).resolve().parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_no_runtime_module_imports_the_test_beds():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "testing":
            continue
        bad = sorted(m for m in _imports(path) if m == "kvtune.testing"
                     or m.startswith("kvtune.testing."))
        if bad:
            offenders[str(rel)] = bad
    assert not offenders, offenders


def test_the_test_beds_import_from_kvtune_testing():
    for name in ("synthetic", "standin", "reference"):
        mod = importlib.import_module(f"kvtune.testing.{name}")
        assert Path(mod.__file__).resolve().parent == PACKAGE / "testing"
    from kvtune.testing import synthetic
    spans = synthetic.SyntheticCase().spans(mode="pull")
    assert len(spans) and spans.attrs["sources"] == ["synthetic"]
