"""The analysis' inputs from a reduced read: a spans frame of a sample of whole conversations
(``kvtune.traces.reduce``), and, for the fits, the transfers table and the prefill spans of a
larger sample of the same units, computed chunk by chunk from the store.

Why two samples: the workload's statistics (gaps, prompt lengths, each mode's TTFT) come from
requests, and a few tens of thousands of them pin them down; the floor/bandwidth fit and the
prefill fit narrow with every transfer and prefill they read, and their points are small (one row
per transfer), while a spans frame costs the analysis about 2.6 KB a span. So the frame is capped
at ``max_spans`` and the fits read up to ``max_transfers`` transfers: both samples are the units
whose md5 falls under a cut, the frame's a subset of the fits'.

``read(source)`` is what the notebooks and ``kvtune tune`` call: ``kvtune.traces.load`` for small
sources, this reduction for large ones (or whenever a cap is given).
"""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from kvtune import spans as sc
from kvtune.analysis.prefill import VLLM_REQUEST_SPAN
from kvtune.analysis.transfers import empty_transfers, transfers
from kvtune.errors import AnalysisError, TraceSourceError
from kvtune.traces.reduce import (DEFAULT_MAX_SPANS, SpanStore, ingest, sample_frame,
                                  share_cut, split_sources)

_logger = logging.getLogger(__name__)

DEFAULT_MAX_TRANSFERS = 250_000
"""Transfers the fits read at most (about 100 MB as a table, 30 s of bootstrap on two cores)."""
MAX_SPANS_ENV = "KVTUNE_MAX_SPANS"
"""Environment variable `kvtune tune --max-spans` sets, so that the notebooks' kernels (which
inherit it) read the same sample as the shared tuning."""
STREAM_MIN_BYTES = 512 * 2**20
"""Span files (plain JSON on disk; gzip counted 4x) above which :func:`read` reduces instead of
loading: the loader's frame takes about 3x the JSON's size in memory (2.1 KB a span)."""
FIT_SPANS = tuple(p.value for p in sc.PHASES) + (sc.SpanName.PREFILL.value, VLLM_REQUEST_SPAN)
"""Span names the fits' chunks read: the transfers' phases and the prefills."""

PREFILL_COLUMNS = ("trace_id", "name", "status", "start_ns", "end_ns", "duration_ms", "attrs",
                   sc.MODE, sc.ROLE, sc.PROMPT_TOKENS, sc.CACHED_TOKENS, sc.COMPUTED_TOKENS)
"""What ``kvtune.analysis.prefill_cost`` reads of the prefill spans (kept of each chunk)."""


@dataclass(frozen=True, eq=False)
class FitInputs:
    """What the floor and prefill fits read in place of the frame's own spans. Compared by
    identity (it rides in ``df.attrs``, which pandas compares when it combines frames)."""

    transfers: pd.DataFrame
    """``kvtune.analysis.transfers`` of the fit sample's phase spans (``TRANSFER_COLUMNS``)."""
    prefill_spans: pd.DataFrame
    """The fit sample's ``kv.prefill`` (and vLLM ``llm_request``) spans: a spans frame of
    :data:`PREFILL_COLUMNS`."""
    share: float
    units: int

    def __deepcopy__(self, memo: dict) -> FitInputs:
        # pandas deep-copies ``df.attrs`` into every frame derived from one (a boolean mask, a
        # column pick): copying these tables each time took the analysis from 0.9 to 3.4 GB
        return self

    def prefill_of(self, mode: str | None) -> pd.DataFrame:
        """The prefill spans of serving ``mode`` and those naming none (None: all)."""
        pf = self.prefill_spans
        if mode is None or sc.MODE not in pf.columns:
            return pf
        m = pf[sc.MODE].astype("object")
        return pf[(m.isna() | (m == mode)).to_numpy(dtype=bool)]


def fit_inputs(store: SpanStore, frame: pd.DataFrame, *,
               max_transfers: int = DEFAULT_MAX_TRANSFERS) -> FitInputs | None:
    """The fits' inputs over the units under a cut holding about ``max_transfers`` transfers
    (None when that is no more than the frame already holds). Each chunk of whole traces gets the
    frame's clock offsets, then ``transfers()``."""
    from kvtune.traces.clocks import apply_offsets

    sample = frame.attrs["sample"]
    (n_transfers,) = store.con.execute(
        f"SELECT count(DISTINCT trace_id || '/' || \"{sc.TRANSFER_ID}\") FROM spans "
        f"WHERE \"{sc.TRANSFER_ID}\" IS NOT NULL").fetchone()
    share = 1.0 if n_transfers <= max_transfers else max_transfers / n_transfers
    if share <= sample.share:
        return None
    cut = share_cut(share)
    _, units = store.units_under(cut)
    offsets = frame.attrs.get("clock_offsets_ns") or {}
    tables, prefills = [], []
    for chunk in store.trace_chunks(cut, FIT_SPANS):
        if offsets:
            chunk = apply_offsets(chunk, offsets)
        name = chunk["name"].astype("object")
        prefills.append(chunk.loc[name.isin([sc.SpanName.PREFILL.value, VLLM_REQUEST_SPAN])
                                  .to_numpy(dtype=bool), list(PREFILL_COLUMNS)])
        try:
            tables.append(transfers(chunk))
        except AnalysisError as exc:
            if "no KV transfers" not in str(exc):
                raise
        del chunk
    tr = (pd.concat(tables, ignore_index=True) if tables else empty_transfers())
    tr = tr.sort_values(["start_ns", "transfer_id"], kind="stable").reset_index(drop=True)
    pre = (pd.concat(prefills, ignore_index=True) if prefills
           else frame.loc[:, list(PREFILL_COLUMNS)].iloc[:0])
    return FitInputs(tr, pre, share=units / sample.source_units if sample.source_units else 1.0,
                     units=units)


def reduce_source(source: Any, *, max_spans: int = DEFAULT_MAX_SPANS,
                  max_transfers: int = DEFAULT_MAX_TRANSFERS, skip_bad: bool = False,
                  correct_clocks: bool = True, progress: bool | None = None,
                  workdir: str | os.PathLike[str] | None = None) -> pd.DataFrame:
    """``source`` reduced in bounded memory: the spans frame of ``kvtune.traces.reduce``
    (``max_spans``) with ``df.attrs["fit_inputs"]`` (:class:`FitInputs`, ``max_transfers``)
    when the fits can read more than the frame holds; ``recommend()`` fits those."""
    if isinstance(max_transfers, bool) or not isinstance(max_transfers, int) or max_transfers < 1:
        raise TraceSourceError(f"reduce_source: max_transfers: expected a whole number >= 1, "
                               f"got {max_transfers!r}")
    with tempfile.TemporaryDirectory(prefix="kvtune-reduce-", dir=workdir) as tmp:
        store = SpanStore(tmp)
        try:
            info = ingest(store, source, skip_bad=skip_bad, progress=progress)
            df = sample_frame(store, info, max_spans=max_spans, correct_clocks=correct_clocks)
            fits = fit_inputs(store, df, max_transfers=max_transfers)
        finally:
            store.close()
    if fits is not None:
        df.attrs["fit_inputs"] = fits
        df.attrs["sample"] = replace(df.attrs["sample"], fit_units=fits.units,
                                     fit_transfers=len(fits.transfers), fit_share=fits.share)
    _logger.info("%s", df.attrs["sample"].summary())
    return df


def read(source: Any, *, max_spans: int | None = None, skip_bad: bool = False,
         progress: bool | None = None) -> pd.DataFrame:
    """Spans for the analysis: ``kvtune.traces.load`` for a small source; :func:`reduce_source`
    (at most ``max_spans``, default ``kvtune.traces.reduce.DEFAULT_MAX_SPANS``) when
    ``max_spans`` (or :data:`MAX_SPANS_ENV`) is given, when the files hold more than
    :data:`STREAM_MIN_BYTES`, or for Parquet sources. A Tempo source is loaded whole unless a cap
    is given."""
    from kvtune.traces.loader import load, resolve

    if max_spans is None and os.environ.get(MAX_SPANS_ENV):
        text = os.environ[MAX_SPANS_ENV]
        try:
            max_spans = int(text)
        except ValueError:
            raise TraceSourceError(f"{MAX_SPANS_ENV}={text!r}: expected a whole number of "
                                   f"spans >= 1") from None
    others, parquet = split_sources(source)
    if max_spans is None and not parquet:
        files = [p for p in resolve(others if len(others) > 1 else others[0])
                 if isinstance(p, Path)]
        size = sum(p.stat().st_size * (4 if p.suffix == ".gz" else 1) for p in files)
        if size <= STREAM_MIN_BYTES:
            return load(source, skip_bad=skip_bad, progress=progress)
    return reduce_source(source, max_spans=max_spans or DEFAULT_MAX_SPANS, skip_bad=skip_bad,
                         progress=progress)
