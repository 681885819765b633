"""The model name written into the exported files (``vllm serve NAME``, REPORT.md, the report).

In order: a name the user gave (``--model`` / ``-p model_name``), the spans' ``kv.model`` resource
attribute, the directory of a local ``config.json`` given as the geometry; only when none of these
is known, the placeholder ``MODEL`` — and then every file that carries it says so.
"""
from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune import spans as sc

PLACEHOLDER = "MODEL"
"""Written when no model name is known; REPORT.md and the report tell the user to replace it."""


@dataclass(frozen=True)
class ModelName:
    """The model name to write and where it came from (``source`` is shown to the user)."""

    name: str
    source: str

    @property
    def known(self) -> bool:
        return self.name != PLACEHOLDER


_CONTROL_CATEGORIES = frozenset({"Cc", "Cf", "Cs"})
"""Unicode categories refused in a model name: control characters (NUL, ESC, newlines ...),
format characters (zero-width, bidirectional overrides that make a name read as another) and
lone surrogates."""


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot be written as ``vllm serve``'s model argument (one line of the args
    file), or None: it must be a non-empty string without whitespace or control characters."""
    if not isinstance(name, str) or not name:
        return f"(a non-empty string), got {name!r:.80}"
    for i, c in enumerate(name):
        if c.isspace():
            return f"without whitespace, got {name!r:.120} (whitespace at character {i})"
        if unicodedata.category(c) in _CONTROL_CATEGORIES:
            return (f"without control characters, got {name!r:.120} (U+{ord(c):04X}, "
                    f"{unicodedata.name(c, unicodedata.category(c))}, at character {i})")
    return None


def servable(name: str) -> bool:
    """A name ``vllm serve`` takes as one argument (non-empty, no whitespace, no control
    characters: :func:`name_problem`)."""
    return name_problem(name) is None


def names_in_spans(spans: Any) -> dict[str, int]:
    """``kv.model`` values in the spans' resources (and span attributes), with span counts."""
    counts: dict[str, int] = {}
    if spans is None or len(spans) == 0:
        return counts
    for col in ("resource", "attrs"):
        if col not in getattr(spans, "columns", ()):
            continue
        seen: dict[int, str | None] = {}  # resources are shared dicts: look each one up once
        for d in spans[col]:
            key = id(d)
            if key not in seen:
                v = d.get(sc.MODEL) if isinstance(d, dict) else None
                seen[key] = str(v) if v not in (None, "") else None
            name = seen[key]
            if name is not None:
                counts[name] = counts.get(name, 0) + 1
    return counts


def resolve(explicit: str | None = None, *, spans: Any = None, geometry_model: str = "") -> ModelName:
    """The model name to write (see module doc). ``geometry_model`` is the notebooks' ``model``
    parameter (a preset name or a local ``config.json``); only a path names a servable model."""
    if explicit:
        return ModelName(explicit, "given (--model / -p model_name)")
    found = names_in_spans(spans)
    ok = {n: c for n, c in found.items() if servable(n)}
    if len(ok) == 1:
        return ModelName(next(iter(ok)), f"spans ({sc.MODEL})")
    if geometry_model and (geometry_model.endswith(".json") or os.path.sep in geometry_model):
        p = Path(geometry_model)
        d = p.parent if p.name.endswith(".json") else p
        return ModelName(str(d), "the geometry's config.json directory (-p model)")
    if len(ok) > 1:
        why = f"spans name {len(ok)} models ({', '.join(sorted(ok))}); pass --model to choose"
    elif found:
        why = f"spans' {sc.MODEL} ({', '.join(sorted(found))}) is not a servable name"
    else:
        why = f"no --model given and the spans carry no {sc.MODEL}"
    return ModelName(PLACEHOLDER, f"unknown: {why}; replace {PLACEHOLDER} in the args files")
