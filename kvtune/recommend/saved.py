"""A `Tuning` saved as JSON with the inputs it was computed from, so it is computed once and read
many times: `kvtune tune` runs ``recommend()`` once and hands the file to every notebook, which
only draws it (see `kvtune.nb.tuning`).

File shape::

    {"kvtune_tuning": 1, "inputs": {"traces": ..., "model": ..., ...}, "tuning": Tuning.as_dict()}

A reader that states its own inputs gets a `ConfigError` naming the file and the first input that
differs, so a notebook never draws a tuning of other spans or other parameters.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from kvtune.errors import ConfigError
from kvtune.recommend.results import Tuning

FORMAT_KEY = "kvtune_tuning"
FORMAT_VERSION = 1
MAX_FILE_BYTES = 32 * 1024 * 1024
"""A tuning file is a few kB to a few MB (evidence tables); larger input is refused unread."""
INPUT_NAMES: tuple[str, ...] = ("traces", "model", "tp_size", "hbm_budget_gb", "early_decode_ok",
                                "seed")
"""The parameters a tuning depends on (the notebooks' names, `kvtune.tune.params`)."""


def source_key(traces: str) -> str:
    """``traces`` with each comma-separated local path made absolute (URLs as they are): the same
    source named from two working directories compares equal."""
    if "://" in traces:
        return traces
    return ",".join(os.path.abspath(p) if p else p for p in traces.split(","))


def tuning_inputs(**inputs: Any) -> dict[str, Any]:
    """The recorded inputs: exactly :data:`INPUT_NAMES`, the trace source normalised."""
    missing = [n for n in INPUT_NAMES if n not in inputs]
    extra = [n for n in inputs if n not in INPUT_NAMES]
    if missing or extra:
        raise TypeError(f"tuning_inputs: expected {INPUT_NAMES}, missing {missing}, unknown {extra}")
    out = dict(inputs)
    out["traces"] = source_key(str(out["traces"]))
    return {n: out[n] for n in INPUT_NAMES}


def write_tuning(tuning: Tuning, path: str | os.PathLike[str], inputs: dict[str, Any]) -> Path:
    """Write ``tuning`` with its ``inputs`` (from :func:`tuning_inputs`) to ``path``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {FORMAT_KEY: FORMAT_VERSION, "inputs": inputs, "tuning": tuning.as_dict()}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False))
    tmp.replace(out)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


def read_tuning(path: str | os.PathLike[str], expect: dict[str, Any] | None = None) -> Tuning:
    """The `Tuning` saved at ``path``. With ``expect`` (from :func:`tuning_inputs`), every recorded
    input must equal it. Raises `ConfigError` naming the file and what was expected."""
    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError as exc:
        raise ConfigError(f"tuning file {p}: cannot read it ({exc.strerror or exc})") from None
    if size > MAX_FILE_BYTES:
        raise ConfigError(f"tuning file {p}: {size} bytes, over the {MAX_FILE_BYTES}-byte limit "
                          f"for a tuning written by `kvtune tune`")
    try:
        doc = json.loads(p.read_text())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"tuning file {p}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get(FORMAT_KEY) != FORMAT_VERSION:
        raise ConfigError(f"tuning file {p}: expected an object with \"{FORMAT_KEY}\": "
                          f"{FORMAT_VERSION} (written by `kvtune tune`), got "
                          f"{type(doc).__name__ if not isinstance(doc, dict) else doc.get(FORMAT_KEY)!r}")
    inputs, body = doc.get("inputs"), doc.get("tuning")
    if not isinstance(inputs, dict) or not isinstance(body, dict):
        raise ConfigError(f"tuning file {p}: expected objects under \"inputs\" and \"tuning\"")
    if expect is not None:
        for name, want in expect.items():
            if name not in inputs:
                raise ConfigError(f"tuning file {p}: inputs.{name} missing; expected {want!r}")
            if not _same(inputs[name], want):
                raise ConfigError(f"tuning file {p} was computed with {name}={inputs[name]!r}, "
                                  f"not {want!r}: rerun `kvtune tune` or leave tuning_json empty "
                                  f"to compute the tuning here")
    try:
        return Tuning.from_dict(body)
    except KeyError as exc:
        raise ConfigError(f"tuning file {p}: tuning.{exc.args[0]} missing") from None
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ConfigError(f"tuning file {p}: tuning has a field of the wrong shape ({exc})") from None
