"""Spans in bounded memory: streamed into a columnar store (DuckDB, on disk), reduced there to a
sample of whole conversations, returned in the loader's shape.

``load_sample(source, max_spans=N)`` reads ``source`` (what :func:`kvtune.traces.load` reads, plus
Parquet files of the store's schema, :data:`STORE_COLUMNS`) chunk by chunk with the loader's own
decoder and bounds, appending each chunk to a DuckDB table in a temporary directory; DuckDB spills
to disk past :data:`DUCKDB_MEMORY_LIMIT`, so memory grows with the chunk and the sample, not with
the spans. The reduction (:data:`UNITS_SQL`, :data:`SAMPLE_SQL`) keeps every span of a uniform
sample of *units* - a conversation (every trace naming one ``kv.conversation_id``), else a trace -
chosen by a hash of the unit's id, so that gaps between turns, each request's transfers and its
prefill stay whole. The sample's share is ``max_spans / spans in the source`` (all when it is
larger), the same for every unit: every analysis of ``kvtune.analysis`` reads the sample as it
reads any spans frame, and :func:`kvtune.analysis.workload` scales what sums over conversations
(retained memory per second, the request rate) by the share (``df.attrs["sample"]``).

The queries are plain SQL over one table ``spans`` (md5, substr, group by, join): the same text
runs on Parquet in object storage with DuckDB's httpfs, or on Spark SQL, unchanged
(``docs/fleet-scale.md``).

A reduced frame differs from ``load``'s in one column: ``attrs`` holds only the attributes outside
the convention (the convention's are in their typed columns, where every analysis reads them).
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvtune import spans as sc
from kvtune.errors import TraceSourceError
from kvtune.traces.columns import (NULLABLE_DTYPES, SHARED_STR_MAX_CHARS, SPAN_COLUMNS,
                                   SPAN_DTYPES, SpanRows, attribute_columns)

_logger = logging.getLogger(__name__)

DEFAULT_MAX_SPANS = 200_000
"""Spans a sample holds at most when the caller gives no cap: about 30,000 requests, enough for
the workload's distributions and every mode's measured TTFT; the recommendation's analysis of it
stays within a few hundred MB (a million took 2.6 GB). The fits read more, chunk by chunk
(``kvtune.analysis.reduced``)."""
CHUNK_SPANS = 25_000
"""Spans decoded before they are appended to the store (about 60 MB while decoded)."""
DUCKDB_MEMORY_LIMIT = "256MB"
"""DuckDB's own memory limit; its grouping and joins spill to the temporary directory past it."""
DUCKDB_THREADS = 2
FETCH_VECTORS = 16
"""DuckDB vectors (2048 rows each) fetched and converted at a time."""
HASH_DIGITS = 8
"""Hex digits of md5(unit) compared with the share's cut (2**32 steps: shares down to 1e-9)."""
PARQUET_SUFFIXES = (".parquet", ".parq")

_CONV = set(attribute_columns())
STORE_COLUMNS: tuple[str, ...] = (
    "trace_id", "span_id", "parent_span_id", "name", "service", "host", "start_ns", "end_ns",
    "status", "status_message", "extra_json", "resource_json", *attribute_columns())
"""Columns of the store's ``spans`` table (and of Parquet sources): the loader's columns, with
``attrs`` outside the convention and ``resource`` as JSON text, and no ``duration_ms``."""

UNITS_SQL = f"""
CREATE TABLE units AS
SELECT trace_id,
       coalesce(max("{sc.CONVERSATION_ID}"), 'trace:' || trace_id) AS unit,
       count(*) AS spans
FROM spans GROUP BY trace_id
"""
"""One row per trace: the unit it is sampled with (its conversation, else itself)."""
SAMPLE_SQL = f"""
SELECT s.* FROM spans s JOIN units u USING (trace_id)
WHERE substr(md5(u.unit), 1, {HASH_DIGITS}) < ?
"""
"""Every span of the units whose hash falls under the share's cut (``?``, hex)."""


@dataclass(frozen=True)
class SampleReport:
    """What a reduced read kept of its source, and what that costs the intervals."""

    source_spans: int
    source_traces: int
    source_units: int
    sampled_spans: int
    sampled_traces: int
    sampled_units: int
    max_spans: int
    share: float
    """Sampled units / units: the share every sum over conversations is scaled by."""
    unit: str = "conversation (kv.conversation_id), else trace"
    read_s: float = 0.0
    reduce_s: float = 0.0
    fit_units: int = 0
    """Units whose transfers and prefills the fits read (``kvtune.analysis.reduced``: a larger
    sample than the frame's, read chunk by chunk; 0: the fits read the frame)."""
    fit_transfers: int = 0
    fit_share: float = 0.0

    @property
    def complete(self) -> bool:
        return self.sampled_units == self.source_units

    @property
    def interval_widening(self) -> float:
        """About how many times wider an interval from the sample is than one from every span
        (intervals from n independent units shrink as 1/sqrt(n))."""
        return 1.0 / math.sqrt(self.share) if self.share > 0 else math.inf

    @property
    def fit_interval_widening(self) -> float:
        """The same for the fits' intervals (floor, bandwidth, prefill: the threshold's range)."""
        share = self.fit_share or self.share
        return 1.0 / math.sqrt(share) if share > 0 else math.inf

    def summary(self) -> str:
        if self.complete:
            return (f"reduced read: all {self.source_spans} spans ({self.source_units} units) "
                    f"kept, under the cap of {self.max_spans}")
        fits = (f"; the floor and prefill fits read the {self.fit_transfers} transfers and the "
                f"prefills of {self.fit_units} units ({self.fit_share:.2%}; their intervals about "
                f"{self.fit_interval_widening:.2f}x as wide as from every span)"
                if self.fit_units else "")
        return (f"reduced read: {self.sampled_spans} of {self.source_spans} spans kept: every span "
                f"of {self.sampled_units} of {self.source_units} units ({self.unit}), a uniform "
                f"sample of {self.share:.2%} chosen by md5 of the unit id (cap {self.max_spans} "
                f"spans); intervals of the workload (TTL, mode) about "
                f"{self.interval_widening:.2f}x as wide as from every span{fits}")

    def findings(self) -> list[dict[str, Any]]:
        """Findings (``code``, ``severity``, ``message``, ``evidence``) for the recommendation."""
        return [{"code": "spans_sampled" if not self.complete else "spans_reduced",
                 "severity": "info", "message": self.summary(), "evidence": self.as_dict()}]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "interval_widening": self.interval_widening,
                "fit_interval_widening": self.fit_interval_widening}


def share_cut(share: float) -> str:
    """The hex prefix under which ``md5(unit)`` falls for a share ``share`` of units."""
    steps = 16 ** HASH_DIGITS
    return f"{min(steps, math.ceil(share * steps)):0{HASH_DIGITS}x}" if share < 1 else "g"


class SpanStore:
    """A DuckDB database (a file in ``directory``) holding one table ``spans``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        import duckdb

        self.directory = Path(directory)
        self.con = duckdb.connect(str(self.directory / "spans.duckdb"))
        self.con.execute(f"SET memory_limit = '{DUCKDB_MEMORY_LIMIT}'")
        self.con.execute(f"SET threads = {DUCKDB_THREADS}")
        self.con.execute(f"SET temp_directory = '{self.directory / 'spill'}'")
        self.con.execute("SET preserve_insertion_order = false")
        self._created = False

    def close(self) -> None:
        self.con.close()

    def append(self, rows: SpanRows, *, skip_bad: bool) -> int:
        """Appends one decoded chunk (its lists are consumed); returns the spans appended."""
        chunk = store_frame(rows.frame(skip_bad=skip_bad))
        if not len(chunk):
            return 0
        self.con.register("chunk", chunk)
        try:
            if self._created:
                self.con.execute("INSERT INTO spans SELECT * FROM chunk")
            else:
                self.con.execute("CREATE TABLE spans AS SELECT * FROM chunk")
                self._created = True
        finally:
            self.con.unregister("chunk")
        return len(chunk)

    def attach_parquet(self, paths: Sequence[Path]) -> None:
        """Adds Parquet files of :data:`STORE_COLUMNS` to ``spans``."""
        files = ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths)
        cols = ", ".join(f'"{c}"' for c in STORE_COLUMNS)
        try:
            if self._created:
                self.con.execute(f"INSERT INTO spans SELECT {cols} FROM read_parquet([{files}])")
            else:
                self.con.execute(f"CREATE TABLE spans AS SELECT {cols} FROM read_parquet([{files}])")
                self._created = True
        except Exception as exc:  # duckdb's errors share no base class worth naming here
            raise TraceSourceError(f"{files}: cannot read as kvtune spans Parquet (columns "
                                   f"kvtune.traces.reduce.STORE_COLUMNS): {exc}") from None

    def export_parquet(self, path: str | os.PathLike[str]) -> Path:
        """Writes ``spans`` to one Parquet file (the schema a Parquet source has)."""
        out = Path(path)
        self.con.execute(f"COPY spans TO '{str(out).replace(chr(39), chr(39) * 2)}' "
                         f"(FORMAT parquet)")
        return out

    def count(self) -> tuple[int, int]:
        """(spans, traces) in the store."""
        if not self._created:
            return 0, 0
        n, t = self.con.execute("SELECT count(*), count(DISTINCT trace_id) FROM spans").fetchone()
        return int(n), int(t)

    def sample(self, max_spans: int) -> tuple[pd.DataFrame, SampleReport]:
        """Every span of a uniform sample of units holding about ``max_spans`` spans."""
        t0 = time.monotonic()
        n_spans, _ = self.count()
        if not self._created:
            return pd.DataFrame(columns=list(STORE_COLUMNS)), SampleReport(
                0, 0, 0, 0, 0, 0, max_spans, 1.0)
        self.con.execute(UNITS_SQL)
        n_traces, n_units = self.con.execute(
            "SELECT count(*), count(DISTINCT unit) FROM units").fetchone()
        share = 1.0 if n_spans <= max_spans else max_spans / n_spans
        cut = share_cut(share)
        df = self.fetch_frame(SAMPLE_SQL, [cut])
        kept_traces, kept_units = self.units_under(cut)
        report = SampleReport(
            source_spans=n_spans, source_traces=int(n_traces), source_units=int(n_units),
            sampled_spans=len(df), sampled_traces=int(kept_traces), sampled_units=int(kept_units),
            max_spans=max_spans, share=(kept_units / n_units) if n_units else 1.0,
            reduce_s=time.monotonic() - t0)
        return df, report

    def units_under(self, cut: str) -> tuple[int, int]:
        """(traces, units) whose unit hash is under ``cut``."""
        t, u = self.con.execute(f"SELECT count(*), count(DISTINCT unit) FROM units WHERE "
                                f"substr(md5(unit), 1, {HASH_DIGITS}) < ?", [cut]).fetchone()
        return int(t), int(u)

    def fetch_frame(self, sql: str, params: Sequence[Any] = ()) -> pd.DataFrame:
        """A query's rows (of :data:`STORE_COLUMNS`) as a loader frame, fetched and converted a
        chunk at a time (DuckDB's own conversion of a million rows peaked at 2.4 GB)."""
        cur = self.con.execute(sql, list(params))
        parts = []
        strings: dict[str, str] = {}
        while True:
            chunk = cur.fetch_df_chunk(FETCH_VECTORS)
            if not len(chunk):
                break
            parts.append(loader_frame(chunk, strings))
        if not parts:
            return loader_frame(pd.DataFrame(columns=list(STORE_COLUMNS)), strings)
        out = pd.concat(parts, ignore_index=True, copy=False) if len(parts) > 1 else parts[0]
        return out

    def trace_chunks(self, cut: str, names: Sequence[str], chunk_spans: int = CHUNK_SPANS):
        """Loader frames of the spans named ``names`` of the units under ``cut``, whole traces
        per frame, about ``chunk_spans`` spans each (for analyses run chunk by chunk)."""
        quoted = ", ".join("'" + n.replace("'", "''") + "'" for n in names)
        self.con.execute("DROP TABLE IF EXISTS picked")
        self.con.execute(
            f"CREATE TEMP TABLE picked AS SELECT s.* FROM spans s JOIN units u USING (trace_id) "
            f"WHERE substr(md5(u.unit), 1, {HASH_DIGITS}) < ? AND s.name IN ({quoted})", [cut])
        (n,) = self.con.execute("SELECT count(*) FROM picked").fetchone()
        buckets = max(1, math.ceil(int(n) / chunk_spans))
        try:
            for b in range(buckets):
                yield self.fetch_frame(f"SELECT * FROM picked WHERE hash(trace_id) % {buckets} = ?",
                                       [b])
        finally:
            self.con.execute("DROP TABLE IF EXISTS picked")


def store_frame(df: pd.DataFrame) -> pd.DataFrame:
    """A loader frame in the store's columns (:data:`STORE_COLUMNS`)."""
    extra = [None] * len(df)
    for i, a in enumerate(df["attrs"]):
        if a and not _CONV.issuperset(a):
            extra[i] = json.dumps({k: v for k, v in a.items() if k not in _CONV}, default=str)
    texts: dict[int, str] = {}
    resource = []
    for r in df["resource"]:
        key = id(r)
        if key not in texts:
            texts[key] = json.dumps(r, default=str) if r else None
        resource.append(texts[key])
    out = df.drop(columns=["attrs", "resource", "duration_ms"])
    out["extra_json"] = pd.array(extra, dtype="string")
    out["resource_json"] = pd.array(resource, dtype="string")
    return out[list(STORE_COLUMNS)]


def _shared(values: Any, strings: dict[str, str]) -> list[Any]:
    """Short strings as one shared object each (``strings`` holds them across chunks): enum
    values, engine ids and names repeat on every span."""
    out = []
    for v in values:
        if isinstance(v, str) and len(v) <= SHARED_STR_MAX_CHARS:
            v = strings.setdefault(v, v)
        elif v is None or v is pd.NA or (isinstance(v, float) and v != v):
            v = None
        out.append(v)
    return out


def loader_frame(df: pd.DataFrame, strings: dict[str, str] | None = None) -> pd.DataFrame:
    """The store's columns back in the loader's shape and dtypes (``attrs``: extras only)."""
    strings = {} if strings is None else strings
    n = len(df)
    data: dict[str, Any] = {}
    for c in ("trace_id", "span_id", "name", "service", "host", "status", "status_message"):
        vals = _shared(df[c].astype(object), strings)
        if c in ("service", "host", "status_message"):
            vals = ["" if v is None else v for v in vals]
        data[c] = pd.array(vals, dtype=SPAN_DTYPES[c])
    data["parent_span_id"] = pd.array(df["parent_span_id"].astype(object).where(
        df["parent_span_id"].notna(), None).to_numpy(dtype=object), dtype="string")
    start = df["start_ns"].to_numpy(dtype=np.int64)
    end = df["end_ns"].to_numpy(dtype=np.int64)
    data["start_ns"], data["end_ns"] = start, end
    data["duration_ms"] = (end - start) / 1e6
    empty: dict[str, Any] = {}
    attrs = np.empty(n, dtype=object)
    attrs[:] = [json.loads(x) if isinstance(x, str) else empty for x in df["extra_json"]]
    data["attrs"] = attrs
    cache: dict[str, dict] = {}
    resource = np.empty(n, dtype=object)
    resource[:] = [cache.setdefault(x, json.loads(x)) if isinstance(x, str) else empty
                   for x in df["resource_json"]]
    data["resource"] = resource
    for key, typ in sc.ATTRIBUTE_TYPES.items():
        col = df[key] if key in df.columns else pd.Series([None] * n)
        if typ is str:
            data[key] = pd.array(_shared(col.astype(object), strings), dtype=NULLABLE_DTYPES[typ])
        else:
            data[key] = pd.array(col.astype(object).where(col.notna(), None)
                                 .to_numpy(dtype=object), dtype=NULLABLE_DTYPES[typ])
    return pd.DataFrame(data, columns=[*SPAN_COLUMNS, *attribute_columns()], copy=False)


def split_sources(source: Any) -> tuple[list[Any], list[Path]]:
    """(the sources the loader reads, the Parquet files) of ``source``."""
    items = list(source) if isinstance(source, (list, tuple)) else [source]
    parquet, other = [], []
    for item in items:
        text = os.fspath(item) if isinstance(item, (str, os.PathLike)) else None
        if text is not None and "://" not in text:
            p = Path(text).expanduser()
            if p.is_dir():
                found = sorted(q for s in PARQUET_SUFFIXES for q in p.rglob(f"*{s}"))
                parquet += found
                if found and not any(p.rglob("*.json*")):
                    continue
            elif p.suffix.lower() in PARQUET_SUFFIXES:
                parquet.append(p)
                continue
        other.append(item)
    return other, parquet


def load_sample(source: Any, *, max_spans: int = DEFAULT_MAX_SPANS, skip_bad: bool = False,
                correct_clocks: bool = True, progress: bool | None = None,
                workdir: str | os.PathLike[str] | None = None) -> pd.DataFrame:
    """The spans of ``source`` reduced in bounded memory to a sample of at most about
    ``max_spans`` spans (see the module doc), as a spans DataFrame; ``df.attrs["sample"]`` is the
    :class:`SampleReport`. Clock offsets are estimated on the sample and subtracted."""

    with tempfile.TemporaryDirectory(prefix="kvtune-reduce-", dir=workdir) as tmp:
        store = SpanStore(tmp)
        try:
            info = ingest(store, source, skip_bad=skip_bad, progress=progress)
            return sample_frame(store, info, max_spans=max_spans, correct_clocks=correct_clocks)
        finally:
            store.close()


@dataclass(frozen=True)
class Ingested:
    """What :func:`ingest` read into a store besides the spans."""

    sources: tuple[str, ...]
    skipped: tuple[Any, ...]
    tempo_reads: tuple[Any, ...]
    read_s: float


def ingest(store: SpanStore, source: Any, *, skip_bad: bool = False,
           progress: bool | None = None) -> Ingested:
    """Streams ``source`` into ``store`` a chunk at a time (the loader's decoder and bounds)."""
    from kvtune.traces.loader import read_spans

    t0 = time.monotonic()
    others, parquet = split_sources(source)
    skipped: list[Any] = []
    sources: list[str] = [str(p) for p in parquet]
    tempo_reads: list[Any] = []
    if parquet:
        store.attach_parquet(parquet)
    if others:
        last = read_spans(others if len(others) > 1 else others[0], skip_bad=skip_bad,
                          progress=progress, flush_spans=CHUNK_SPANS,
                          flush=lambda rows: store.append(rows, skip_bad=skip_bad))
        store.append(last, skip_bad=skip_bad)
        skipped, tempo_reads = last.skipped, list(last.tempo_reads)
        sources += last.sources
    return Ingested(tuple(sources), tuple(skipped), tuple(tempo_reads), time.monotonic() - t0)


def sample_frame(store: SpanStore, info: Ingested, *, max_spans: int = DEFAULT_MAX_SPANS,
                 correct_clocks: bool = True) -> pd.DataFrame:
    """The sample of ``store`` (see :func:`load_sample`) as a spans frame."""
    from kvtune.traces.clocks import apply_offsets, estimate_offsets

    if isinstance(max_spans, bool) or not isinstance(max_spans, int) or max_spans < 1:
        raise TraceSourceError(f"load_sample: max_spans: expected a whole number >= 1, "
                               f"got {max_spans!r}")
    df, report = store.sample(max_spans)
    report = SampleReport(**{**asdict(report), "read_s": info.read_s})
    skipped, sources, tempo_reads = list(info.skipped), list(info.sources), list(info.tempo_reads)
    offsets: dict[str, int] = {}
    if correct_clocks and len(df):
        offsets = dict(estimate_offsets(df).offsets_ns)
        df = apply_offsets(df, offsets)
    df.attrs["clock_offsets_ns"] = offsets
    df.attrs["skipped"] = [s.as_tuple() for s in skipped]
    df.attrs["sources"] = sources
    df.attrs["sample"] = report
    if tempo_reads:
        df.attrs["tempo_reads"] = tempo_reads
    _logger.info("%s", report.summary())
    return df

