"""Loading kvtune spans into a DataFrame: OTLP-JSON lines files, Collector output, Tempo.

``load(source)`` returns one row per span with the columns documented in ``docs/contracts.md``
(:data:`SPAN_COLUMNS`, then one typed column per convention attribute).
"""
from __future__ import annotations

from kvtune.traces.clocks import ClockOffsets, apply_offsets, estimate_offsets
from kvtune.traces.columns import SPAN_COLUMNS, SPAN_DTYPES, all_columns, attribute_columns, empty_frame
from kvtune.traces.loader import load, resolve
from kvtune.traces.summary import TraceSummary, summarize, summarize_frame
from kvtune.traces.tempo import TempoSource

__all__ = [
    "SPAN_COLUMNS", "SPAN_DTYPES", "ClockOffsets", "TempoSource", "TraceSummary", "all_columns",
    "apply_offsets", "attribute_columns", "empty_frame", "estimate_offsets", "load", "resolve",
    "summarize", "summarize_frame",
]
