"""The spans DataFrame's column contract and the columnar accumulator that builds it.

Decoded documents are appended span by span into plain lists (one per column, plus (row, value)
lists per convention attribute); the frame is built once at the end with numpy, so loading costs
one pass in Python per span and attribute, not per column.
"""
from __future__ import annotations

import base64
import binascii
import bisect
from array import array
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from kvtune import spans
from kvtune.errors import TraceFormatError
from kvtune.traces import otlp_json

SPAN_COLUMNS: tuple[str, ...] = (
    "trace_id", "span_id", "parent_span_id", "name", "service", "host", "start_ns", "end_ns",
    "duration_ms", "status", "status_message", "attrs", "resource",
)
"""The spans DataFrame's fixed columns, in order; one typed column per convention attribute follows."""

STR_DTYPE = "str"
"""pandas' default string dtype (missing = NaN) for ids, names, hosts, status."""
NULLABLE_DTYPES: dict[type, str] = {int: "Int64", float: "Float64", str: "string", bool: "boolean"}
"""pandas nullable dtype of each convention attribute type (missing = pd.NA)."""

SPAN_DTYPES: dict[str, str] = {
    "trace_id": STR_DTYPE, "span_id": STR_DTYPE, "parent_span_id": "string", "name": STR_DTYPE,
    "service": STR_DTYPE, "host": STR_DTYPE, "start_ns": "int64", "end_ns": "int64",
    "duration_ms": "float64", "status": STR_DTYPE, "status_message": STR_DTYPE,
    "attrs": "object", "resource": "object",
}
"""dtype of each fixed column (``parent_span_id`` is nullable ``string``: pd.NA for roots)."""

NS_PER_MS = 1e6
SHARED_STR_MAX_CHARS = 24
"""String attribute values up to this length (enum values, engine ids, backends) are interned:
they repeat on every span, and one shared object each saves about a quarter of the memory."""
TRACE_ID_BYTES = 16
SPAN_ID_BYTES = 8
_HEX = b"0123456789abcdef"


def attribute_columns() -> tuple[str, ...]:
    """The typed attribute columns, in ``spans.ATTRIBUTE_TYPES`` order."""
    return tuple(spans.ATTRIBUTE_TYPES)


def all_columns() -> tuple[str, ...]:
    """Every column of the spans DataFrame, in order."""
    return SPAN_COLUMNS + attribute_columns()


@dataclass(frozen=True)
class Skipped:
    """A record left out by ``skip_bad``: where it was and why."""

    source: str
    line: int | None
    reason: str

    def as_tuple(self) -> tuple[str, int | None, str]:
        return (self.source, self.line, self.reason)


class SpanRows:
    """Columnar accumulator of decoded spans; ``frame()`` builds the DataFrame."""

    def __init__(self) -> None:
        self.trace_id: list[str] = []
        self.span_id: list[str] = []
        self.parent: list[str | None] = []
        self.name: list[str] = []
        self.service: list[str] = []
        self.host: list[str] = []
        self.start: list[int] = []
        self.end: list[int] = []
        self.status: list[Any] = []
        self.message: list[str] = []
        self.attrs: list[dict[str, Any]] = []
        self.resource: list[dict[str, Any]] = []
        self.conv: dict[str, tuple[array, list[Any]]] = {
            k: (array("q"), []) for k in spans.ATTRIBUTE_TYPES}
        """Per convention attribute: rows where it is set, and its values there."""
        self._key_info: dict[str, tuple[str, Any, Any]] = {}
        self.sources: list[str] = []
        self._block_rows: list[int] = []  # first row of each decoded document
        self._block_where: list[tuple[int, int | None]] = []  # (source index, line)
        self.skipped: list[Skipped] = []
        self.bad_values: list[tuple[int, str, str]] = []
        """(row, field, what was expected) of values found bad while appending (reported, or
        their rows dropped under ``skip_bad``, when the frame is built)."""
        self.tempo_reads: list[Any] = []
        """One ``kvtune.traces.tempo.TempoRead`` per Tempo source read."""

    def __len__(self) -> int:
        return len(self.trace_id)

    # --- where rows came from ----------------------------------------------------------------
    def source_index(self, source: str) -> int:
        self.sources.append(source)
        return len(self.sources) - 1

    def where(self, row: int) -> tuple[str, int | None]:
        i = bisect.bisect_right(self._block_rows, row) - 1
        src, line = self._block_where[i]
        return self.sources[src], line

    # --- appending ---------------------------------------------------------------------------
    def add_document(self, doc: otlp_json.TraceDocument, source_index: int, line: int | None) -> None:
        """Appends every span of one decoded document."""
        resource_spans = doc.resource_spans_list()
        if resource_spans is None:
            raise TraceFormatError(self.sources[source_index], "resourceSpans",
                                   otlp_json.DOCUMENT_EXPECTED, line=line)
        self._block_rows.append(len(self.trace_id))
        self._block_where.append((source_index, line))
        intern = sys.intern
        any_value = otlp_json.any_value
        key_info = self._key_info
        known = key_info.get
        row = len(self.trace_id)
        attrs_append = self.attrs.append
        for rs in resource_spans:
            res = rs.resource
            bad_resource: tuple[str, str] | None = None
            rattrs = {}
            for kv in (res.attributes if res is not None else ()):
                try:
                    rattrs[intern(kv.key)] = any_value(kv.value)
                except otlp_json.ValueNestingError as exc:
                    rattrs[intern(kv.key)] = None
                    bad_resource = bad_resource or (f"resource.attributes[{kv.key}]", str(exc))
            service = rattrs.get(spans.SERVICE_NAME)
            service = "" if service is None else str(service)
            host = rattrs.get(spans.HOST_NAME)
            host = "" if host is None else str(host)
            for ss in rs.scope_spans or rs.instrumentation_library_spans:
                sl = ss.spans
                k = len(sl)
                if not k:
                    continue
                self.trace_id.extend([s.trace_id for s in sl])
                self.span_id.extend([s.span_id for s in sl])
                self.parent.extend([s.parent_span_id for s in sl])
                self.name.extend([intern(s.name) for s in sl])
                self.start.extend([s.start_time_unix_nano for s in sl])
                self.end.extend([s.end_time_unix_nano for s in sl])
                self.status.extend([s.status for s in sl])
                self.service.extend([service] * k)
                self.host.extend([host] * k)
                self.resource.extend([rattrs] * k)
                if bad_resource is not None:
                    self.bad_values.extend((r, *bad_resource) for r in range(row, row + k))
                for s in sl:
                    d: dict[str, Any] = {}
                    for kv in s.attributes:
                        info = known(kv.key)
                        if info is None:
                            info = self._new_key(kv.key)
                        key, add_row, add_value = info
                        v = kv.value
                        if v is None:
                            d[key] = None
                            continue
                        val = v.string_value
                        if val is not None:
                            if len(val) <= SHARED_STR_MAX_CHARS:
                                val = intern(val)
                        else:
                            val = v.int_value
                            if val is None:
                                val = v.double_value
                                if val is None:
                                    val = v.bool_value
                                    if val is None:
                                        try:
                                            val = any_value(v)
                                        except otlp_json.ValueNestingError as exc:
                                            self.bad_values.append(
                                                (row, f"attributes[{kv.key}]", str(exc)))
                                            d[key] = None
                                            continue
                        d[key] = val
                        if add_row is not None and val is not None:
                            add_row(row)
                            add_value(val)
                    attrs_append(d)
                    row += 1

    def _new_key(self, key: str) -> tuple[str, Any, Any]:
        """(shared key, row adder, value adder) for an attribute key seen for the first time;
        the adders are None for keys outside the convention."""
        key = sys.intern(key)
        conv = self.conv.get(key)
        info = (key, conv[0].append, conv[1].append) if conv is not None else (key, None, None)
        self._key_info[key] = info
        return info

    # --- building the frame ------------------------------------------------------------------
    def frame(self, *, skip_bad: bool = False) -> pd.DataFrame:
        """The spans DataFrame (columns per :data:`SPAN_COLUMNS` + attribute columns).

        Consumes the accumulated lists (each is released once its column is built); call once.
        """
        n = len(self.trace_id)
        bad: dict[int, str] = {}

        def fail(row: int, field: str, expected: str, got: Any) -> None:
            if not skip_bad:
                src, line = self.where(row)
                raise TraceFormatError(src, field, expected, line=line, got=got)
            bad.setdefault(row, f"field {field!r}: expected {expected}, got {got!r}"[:300])

        for row, field, expected in self.bad_values:
            fail(row, field, expected, "deeper")
        self.bad_values = []
        # Each list is released as soon as its column is built, to keep the peak memory low.
        self._key_info = {}  # holds the attribute lists' append methods (and so the lists)
        data: dict[str, Any] = {}
        data["trace_id"] = pd.array(_normalize_ids(self.trace_id, TRACE_ID_BYTES, "traceId", fail,
                                                   allow_empty=False), dtype=STR_DTYPE)
        self.trace_id = []
        data["span_id"] = pd.array(_normalize_ids(self.span_id, SPAN_ID_BYTES, "spanId", fail,
                                                  allow_empty=False), dtype=STR_DTYPE)
        self.span_id = []
        data["parent_span_id"] = pd.array(_normalize_ids(self.parent, SPAN_ID_BYTES, "parentSpanId",
                                                         fail, allow_empty=True), dtype="string")
        self.parent = []
        for col in ("name", "service", "host"):
            data[col] = pd.array(getattr(self, col), dtype=STR_DTYPE)
            setattr(self, col, [])
        start = np.array(self.start, dtype=np.int64) if n else np.zeros(0, np.int64)
        end = np.array(self.end, dtype=np.int64) if n else np.zeros(0, np.int64)
        self.start, self.end = [], []
        data["start_ns"], data["end_ns"] = start, end
        data["duration_ms"] = (end - start) / NS_PER_MS
        codes = np.zeros(n, dtype=np.int8)
        messages: list[str] = [""] * n
        for i, st in enumerate(self.status):
            if st is None:
                continue
            if st.code != 0:
                c = otlp_json.status_code(st.code)
                if c is None:
                    fail(i, "status.code", "0, 1, 2 or STATUS_CODE_UNSET|OK|ERROR", st.code)
                    c = 0
                codes[i] = c
            if st.message:
                messages[i] = st.message
        self.status = []
        data["status"] = pd.array(np.array(otlp_json.STATUS_NAMES, dtype=object)[codes], dtype=STR_DTYPE)
        data["status_message"] = pd.array(messages, dtype=STR_DTYPE)
        del messages
        data["attrs"] = _object_array(self.attrs)
        data["resource"] = _object_array(self.resource)
        self.attrs, self.resource = [], []
        for key in list(self.conv):
            rows, values = self.conv.pop(key)
            data[key] = _typed_column(key, rows, values, n, fail)
            del rows, values
        df = pd.DataFrame(data, copy=False)
        if bad:
            for row, reason in sorted(bad.items()):
                src, line = self.where(row)
                self.skipped.append(Skipped(src, line, reason))
            keep = np.ones(n, dtype=bool)
            keep[list(bad)] = False
            df = df.loc[keep].reset_index(drop=True)
        return df


def empty_frame() -> pd.DataFrame:
    """A spans DataFrame with no rows and the contract's columns and dtypes."""
    return SpanRows().frame()


def _object_array(items: list[Any]) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr


def _all_hex(ids: list[str], width: int) -> bool:
    """Whether every id is ``width`` lowercase hex digits (one C-level pass over all of them)."""
    if set(map(len, ids)) != {width}:
        return False
    return not "".join(ids).encode("ascii", "replace").translate(None, _HEX)


def _normalize_ids(ids: list[Any], nbytes: int, field: str,
                   fail: Callable[[int, str, str, Any], None], *, allow_empty: bool) -> list[Any]:
    """Ids as lowercase hex of ``nbytes`` bytes; base64 ids (Tempo) converted; empty -> None.

    Fast path: every (non-empty) id is already lowercase hex of the right length.
    """
    width = 2 * nbytes
    if allow_empty:
        ids = [x or None for x in ids]
        present = [x for x in ids if x is not None]
    else:
        present = ids
    try:
        if _all_hex(present, width):
            return ids
    except TypeError:  # a non-string id: the slow path names it
        pass
    out: list[Any] = list(ids)
    zero = "0" * width
    for i, x in enumerate(out):
        if x is None or x == "":
            if not allow_empty:
                fail(i, field, f"{width} hex digits", x)
            out[i] = None
            continue
        if not isinstance(x, str):
            fail(i, field, f"{width} hex digits", x)
            out[i] = None
            continue
        if len(x) == width:
            low = x.lower()
            if not low.encode("ascii", "replace").translate(None, _HEX):
                out[i] = None if (allow_empty and low == zero) else low
                continue
        try:
            raw = base64.b64decode(x + "=" * (-len(x) % 4), validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) == nbytes:
            out[i] = raw.hex()
            if allow_empty and out[i] == zero:
                out[i] = None
        else:
            fail(i, field, f"{width} hex digits (or base64 of {nbytes} bytes)", x)
            out[i] = None
    return out


def _all_missing(n: int, typ: type) -> Any:
    if typ is str:
        return pd.arrays.StringArray(np.full(n, None, dtype=object))
    if typ is int:
        return pd.arrays.IntegerArray(np.zeros(n, np.int64), np.ones(n, dtype=bool))
    if typ is float:
        return pd.arrays.FloatingArray(np.zeros(n, np.float64), np.ones(n, dtype=bool))
    return pd.arrays.BooleanArray(np.zeros(n, np.bool_), np.ones(n, dtype=bool))


def _typed_column(key: str, rows: list[int], values: list[Any], n: int,
                  fail: Callable[[int, str, str, Any], None]) -> Any:
    """One convention attribute as a pandas nullable array of its declared type."""
    typ = spans.ATTRIBUTE_TYPES[key]
    dtype = NULLABLE_DTYPES[typ]
    if not rows:
        return _all_missing(n, typ)
    types = set(map(type, values))
    allowed = {int: {int}, float: {float, int}, str: {str}, bool: {bool}}[typ]
    if not types <= allowed:
        if typ is int and types <= {int, float}:
            ok = all(type(v) is int or v.is_integer() for v in values)
            if ok:
                values = [int(v) for v in values]
        else:
            ok = False
        if not ok:
            good_rows, good_values = [], []
            for r, v in zip(rows, values):
                if type(v) in allowed or (typ is int and type(v) is float and v.is_integer()):
                    good_rows.append(r)
                    good_values.append(int(v) if typ is int else v)
                else:
                    fail(r, f"attributes[{key}]", f"{typ.__name__} ({dtype})", v)
            rows, values = good_rows, good_values
    idx = np.asarray(rows, dtype=np.int64)
    if typ is str:
        arr = np.full(n, None, dtype=object)
        arr[idx] = values
        return pd.arrays.StringArray(arr)
    np_type = {int: np.int64, float: np.float64, bool: np.bool_}[typ]
    vals = np.zeros(n, dtype=np_type)
    mask = np.ones(n, dtype=bool)
    if typ is int:
        try:
            vals[idx] = np.asarray(values, dtype=np.int64)
        except OverflowError:
            out_of_range = []
            for r, v in zip(rows, values):
                if -(2**63) <= v < 2**63:
                    vals[r] = v
                else:
                    fail(r, f"attributes[{key}]", "an int64", v)
                    out_of_range.append(r)
            mask[idx] = False
            mask[out_of_range] = True
            return pd.arrays.IntegerArray(vals, mask)
    else:
        vals[idx] = np.asarray(values, dtype=np_type)
    mask[idx] = False
    if typ is int:
        return pd.arrays.IntegerArray(vals, mask)
    if typ is float:
        return pd.arrays.FloatingArray(vals, mask)
    return pd.arrays.BooleanArray(vals, mask)
