"""Run parsed TraceQL queries over a kvtune spans DataFrame (the ``kvtune.traces.load`` contract).

This is what proves the dashboards' names line up end to end: the same query text Grafana sends
to Tempo, run by kvtune over spans a kvtune producer emitted, must return rows.

Semantics follow Tempo's for the subset :mod:`kvtune.dashboards.traceql` parses:

- a spanset filter keeps the spans for which the expression is true; comparisons with an absent
  attribute, or between values of different types, are false (``!=`` included);
- ``{A} && {B}`` keeps the spans of A and B in traces that have both; ``{A} || {B}`` either;
- ``span.x`` reads span attributes, ``resource.x`` resource attributes (``service.name`` and
  ``host.name`` from the ``service``/``host`` columns), ``.x`` a span attribute, else a resource one;
- ``duration`` is in nanoseconds for comparisons and in **seconds** in metrics results (as Tempo
  returns it); ``status`` is ok/error/unset; ``kind`` needs a ``kind`` column (not in the contract,
  so ``kind`` comparisons are false on loader frames).

Results:

- search queries: one row per matched span with ``trace_id, span_id, name, service, start_ns,
  duration_ms`` and one column per ``select(...)`` field (named as written, e.g. ``span.kv.bytes``,
  typed as the convention types it). Every match is returned: Tempo also caps the traces at the
  panel's ``limit`` and the spans per trace at its ``spss``;
- metrics queries: one row per (series, time bucket) with one column per ``by(...)`` label (named
  as written), ``p`` for ``quantile_over_time``, then ``time_s`` (bucket start, s since epoch) and
  ``value``. Spans fall in buckets by start time; ``rate`` is per second of bucket. Quantiles are
  exact (numpy's linear interpolation); Tempo approximates them from log2 histograms, so values
  differ slightly, series and labels do not. Like Tempo, ``quantile_over_time`` skips values
  under 2 (zero-duration spans: see :data:`HISTOGRAM_MIN`), so a series of instants is absent.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import numpy as np
import pandas as pd

from kvtune.dashboards.templating import interpolate
from kvtune.dashboards.traceql import (
    Attribute, BoolOp, Comparison, Field, FieldExpr, Intrinsic, MetricsAggregate, Not, Query,
    Select, SpansetFilter, SpansetOp, Static, Truthy, parse,
)
from kvtune import spans as convention
from kvtune.errors import ConfigError
from kvtune.traces.columns import NULLABLE_DTYPES

SEARCH_COLUMNS: tuple[str, ...] = ("trace_id", "span_id", "name", "service", "start_ns", "duration_ms")
"""Leading columns of a search query's result."""
REQUIRED_COLUMNS: tuple[str, ...] = ("trace_id", "span_id", "name", "service", "host", "start_ns",
                                     "end_ns", "status", "attrs", "resource")
"""Columns of the spans DataFrame contract the evaluator reads."""

_STATUS_VALUES = {"UNSET": "unset", "OK": "ok", "ERROR": "error"}


def evaluate(query: Query | str, spans: pd.DataFrame, *,
             variables: Mapping[str, str | Sequence[str]] | None = None,
             all_values: Mapping[str, str] | None = None,
             step_s: float | None = None) -> pd.DataFrame:
    """Run one query over ``spans`` and return a new DataFrame (see the module doc for columns).

    A string query is interpolated with ``variables`` (Grafana semantics; a variable without a value
    is a :class:`ConfigError`) and parsed first. ``all_values`` maps variables to their custom "All"
    value. ``step_s`` is the metrics bucket width in seconds; None makes one bucket over all spans.
    """
    if isinstance(query, str):
        query = parse(interpolate(query, variables or {}, all_values=all_values))
    missing = [c for c in REQUIRED_COLUMNS if c not in spans.columns]
    if missing:
        raise ConfigError(f"spans DataFrame: missing columns {missing} (expected the "
                          "kvtune.traces.load contract, docs/contracts.md)")
    if step_s is not None and not step_s > 0:
        raise ConfigError(f"step_s: expected a positive number of seconds, got {step_s!r}")
    frame = spans.reset_index(drop=True)
    mask = _spanset(query.spanset, frame)
    selected: list[Field] = []
    metrics: MetricsAggregate | None = None
    for stage in query.stages:
        if isinstance(stage, Select):
            selected.extend(stage.fields)
        elif isinstance(stage, MetricsAggregate):
            metrics = stage
        else:
            mask &= _spanset(stage, frame)
    matched = frame[mask]
    if metrics is not None:
        return _metrics(metrics, matched, frame, step_s)
    out = matched.loc[:, list(SEARCH_COLUMNS)].copy()
    for f in selected:
        out[_label(f)] = _typed(f, _values(f, matched))
    return out.reset_index(drop=True)


# --- Spansets -----------------------------------------------------------------------------------


def _spanset(node: SpansetFilter | SpansetOp, frame: pd.DataFrame) -> np.ndarray:
    if isinstance(node, SpansetFilter):
        if node.expr is None:
            return np.ones(len(frame), dtype=bool)
        return _expr(node.expr, frame)
    left, right = _spanset(node.left, frame), _spanset(node.right, frame)
    traces = frame["trace_id"].to_numpy()
    if node.op == "||":
        return left | right
    both = set(traces[left]) & set(traces[right])
    in_both = np.fromiter((t in both for t in traces), dtype=bool, count=len(traces))
    return (left | right) & in_both


def _expr(node: FieldExpr, frame: pd.DataFrame) -> np.ndarray:
    if isinstance(node, BoolOp):
        left, right = _expr(node.left, frame), _expr(node.right, frame)
        return left & right if node.op == "&&" else left | right
    if isinstance(node, Not):
        return ~_expr(node.operand, frame)
    if isinstance(node, Truthy):
        vals = _operand(node.operand, frame)
        return np.array([v is True for v in vals], dtype=bool)
    return _compare(node, frame)


def _compare(c: Comparison, frame: pd.DataFrame) -> np.ndarray:
    left, right = _operand(c.left, frame), _operand(c.right, frame)
    if c.op in ("=~", "!~"):
        try:
            pattern = re.compile(str(right[0]))
        except re.error as exc:
            raise ConfigError(f"regex {right[0]!r} at position {c.pos}: {exc}") from exc
        # Tempo (2.7+) anchors regex matchers fully: span.foo =~ "bar" means "^bar$".
        hit = np.array([isinstance(v, str) and pattern.fullmatch(v) is not None for v in left], dtype=bool)
        present = np.array([isinstance(v, str) for v in left], dtype=bool)
        return hit if c.op == "=~" else present & ~hit
    compare = _OPS[c.op]
    return np.array([_comparable(a, b) and compare(a, b) for a, b in zip(left, right)], dtype=bool)


_OPS: dict[str, Callable[[object, object], bool]] = {
    "=": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
}


def _comparable(a: object, b: object) -> bool:
    if a is None or b is None:
        return False
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return not (isinstance(a, float) and math.isnan(a)) and not (isinstance(b, float) and math.isnan(b))
    return type(a) is type(b)


def _operand(op: Field | Static, frame: pd.DataFrame) -> list[object]:
    if isinstance(op, Static):
        return [op.value] * len(frame)
    return _values(op, frame, for_compare=True)


# --- Field values -------------------------------------------------------------------------------


def _values(f: Field, frame: pd.DataFrame, *, for_compare: bool = False) -> list[object]:
    """Python values of a field per row (None when absent); duration in ns for comparisons."""
    if isinstance(f, Intrinsic):
        if f.name == "name":
            return [_py(v) for v in frame["name"]]
        if f.name == "duration":
            ns = (frame["end_ns"].astype("int64") - frame["start_ns"].astype("int64")).to_numpy()
            return [float(v) for v in ns] if for_compare else [float(v) / 1e9 for v in ns]
        if f.name == "status":
            return [_STATUS_VALUES.get(str(v).upper()) for v in frame["status"]]
        if f.name == "statusMessage":
            col = frame["status_message"] if "status_message" in frame.columns else None
            return [None] * len(frame) if col is None else [_py(v) for v in col]
        if f.name == "kind":
            if "kind" not in frame.columns:
                return [None] * len(frame)
            return [_kind(v) for v in frame["kind"]]
    assert isinstance(f, Attribute)
    if f.scope == "resource":
        return _resource_values(f.name, frame)
    if f.scope == "parent":
        return [None] * len(frame)  # parent attributes are outside the subset the evaluator runs
    span_vals = _span_values(f.name, frame)
    if f.scope == "span":
        return span_vals
    res_vals = _resource_values(f.name, frame)
    return [s if s is not None else r for s, r in zip(span_vals, res_vals)]


def _span_values(name: str, frame: pd.DataFrame) -> list[object]:
    if name in frame.columns and name not in REQUIRED_COLUMNS:
        return [_py(v) for v in frame[name]]
    return [_py(a.get(name)) if isinstance(a, dict) else None for a in frame["attrs"]]


def _resource_values(name: str, frame: pd.DataFrame) -> list[object]:
    if name == "service.name":
        return [_py(v) or None for v in frame["service"]]
    if name == "host.name":
        return [_py(v) or None for v in frame["host"]]
    return [_py(r.get(name)) if isinstance(r, dict) else None for r in frame["resource"]]


def _py(v: object) -> object:
    """A plain Python value (None for NA) from a pandas/numpy cell."""
    if v is None or v is pd.NA or v is pd.NaT:
        return None
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return None if np.isnan(v) else float(v)
    return v


def _kind(v: object) -> str | None:
    v = _py(v)
    if v is None:
        return None
    s = str(v).lower().removeprefix("span_kind_")
    return {"0": "unspecified", "1": "internal", "2": "server", "3": "client", "4": "producer",
            "5": "consumer"}.get(s, s)




def _typed(f: Field, values: list[object]) -> pd.api.extensions.ExtensionArray | list[object]:
    """A selected field's values: the convention's nullable dtype for its attributes, seconds for
    ``duration``, plain objects otherwise."""
    if isinstance(f, Attribute) and f.name in convention.ATTRIBUTE_TYPES:
        typ = convention.ATTRIBUTE_TYPES[f.name]
        if all(v is None or (isinstance(v, typ) and not (typ is int and isinstance(v, bool))) for v in values):
            return pd.array([pd.NA if v is None else v for v in values], dtype=NULLABLE_DTYPES[typ])
    if isinstance(f, Intrinsic) and f.name == "duration":
        return pd.array(values, dtype="Float64")
    return values


def _label(f: Field) -> str:
    return str(f)


# --- Metrics ------------------------------------------------------------------------------------


def _metrics(m: MetricsAggregate, matched: pd.DataFrame, frame: pd.DataFrame,
             step_s: float | None) -> pd.DataFrame:
    labels = [_label(f) for f in m.by]
    columns = labels + (["p"] if m.function == "quantile_over_time" else []) + ["time_s", "value"]
    if matched.empty:
        return pd.DataFrame({c: pd.Series([], dtype="float64" if c in ("time_s", "value") else "object")
                             for c in columns})
    start_all = int(frame["start_ns"].min())
    end_all = int(max(frame["end_ns"].max(), frame["start_ns"].max()))
    if step_s is None:
        width_ns = max(end_all - start_all, 1)
    else:
        width_ns = int(step_s * 1e9)
    bucket = ((matched["start_ns"].astype("int64") - start_all) // width_ns).to_numpy()
    data = {lab: [_label_value(v) for v in _values(f, matched)] for lab, f in zip(labels, m.by)}
    values = _values(m.field, matched) if m.field is not None else [1.0] * len(matched)
    if m.function == "quantile_over_time" and m.field is not None:
        values = _histogram_values(m.field, matched, values)
    work = pd.DataFrame({**data, "_bucket": bucket,
                         "_v": [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool)
                                else np.nan for v in values]})
    rows: list[dict[str, object]] = []
    for key, group in work.groupby(labels + ["_bucket"], dropna=False, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        base = dict(zip(labels, key[:-1]))
        time_s = (start_all + int(key[-1]) * width_ns) / 1e9
        vals = group["_v"].dropna().to_numpy(dtype=float)
        if m.function == "quantile_over_time":
            for q in m.quantiles:
                if len(vals):
                    rows.append({**base, "p": _quantile_label(q), "time_s": time_s,
                                 "value": float(np.quantile(vals, q))})
            continue
        if m.function == "rate":
            value = len(group) / (width_ns / 1e9)
        elif m.function == "count_over_time":
            value = float(len(group))
        elif not len(vals):
            continue
        elif m.function == "sum_over_time":
            value = float(vals.sum())
        elif m.function == "avg_over_time":
            value = float(vals.mean())
        elif m.function == "min_over_time":
            value = float(vals.min())
        else:  # max_over_time
            value = float(vals.max())
        rows.append({**base, "time_s": time_s, "value": value})
    return pd.DataFrame(rows, columns=columns)


HISTOGRAM_MIN: Final = 2
"""Tempo's ``quantile_over_time`` puts each value in a power-of-two bucket and skips values under 2
(ns for ``duration``, the number itself for integer attributes): a series of zero-duration spans
(instants such as ``kv.notify``) has no samples, and so no series."""


def _histogram_values(f: Field, matched: pd.DataFrame, values: list[object]) -> list[object]:
    """``values`` with what Tempo's quantile histogram skips set to None: durations under
    :data:`HISTOGRAM_MIN` ns, integers under it, and every non-integer attribute value (Tempo
    2.10 buckets only durations and integers)."""
    if isinstance(f, Intrinsic) and f.name == "duration":
        ns = _values(f, matched, for_compare=True)
        return [v if isinstance(n, float) and n >= HISTOGRAM_MIN else None
                for v, n in zip(values, ns)]
    return [v if isinstance(v, int) and not isinstance(v, bool) and v >= HISTOGRAM_MIN else None
            for v in values]


def _label_value(v: object) -> str:
    """Series label as Tempo prints it; absent attributes group under ``nil``."""
    if v is None:
        return "nil"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _quantile_label(q: float) -> str:
    return f"{q:g}"
