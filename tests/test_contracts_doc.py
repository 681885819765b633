"""docs/contracts.md matches the code: every type it lists as `module.Type`: `fields` has exactly
those fields, in that order."""
from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "contracts.md"
ENTRY = re.compile(r"^- `(kvtune(?:\.\w+)+)`: `([a-z_0-9, ]+)`", re.MULTILINE)


def doc_entries(text: str) -> list[tuple[str, list[str]]]:
    return [(name, [f.strip() for f in fields.split(",")]) for name, fields in ENTRY.findall(text)]


def resolve(dotted: str) -> type:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


ENTRIES = doc_entries(DOC.read_text(encoding="utf-8"))


def test_the_doc_lists_the_types_that_cross_packages():
    names = {n for n, _ in ENTRIES}
    assert {"kvtune.analysis.Workload", "kvtune.analysis.TracedRequest", "kvtune.recommend.Tuning",
            "kvtune.recommend.evidence.ModeEvidence", "kvtune.recommend.evidence.ThresholdEvidence",
            "kvtune.recommend.evidence.TtlEvidence", "kvtune.sim.SimResult",
            "kvtune.sim.Timeline"} <= names


def test_entry_parser_reads_a_line():
    assert doc_entries("- `kvtune.a.B`: `x, y_ms`.\n  more\n") == [("kvtune.a.B", ["x", "y_ms"])]


@pytest.mark.parametrize("name,fields", ENTRIES, ids=[n for n, _ in ENTRIES])
def test_doc_fields_match_the_dataclass(name, fields):
    cls = resolve(name)
    assert dataclasses.is_dataclass(cls), f"{name} is not a dataclass"
    assert [f.name for f in dataclasses.fields(cls)] == fields, f"docs/contracts.md: {name}"
