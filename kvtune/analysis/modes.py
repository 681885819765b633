"""Traces that hold more than one P/D mode: which mode the advice reads, and what the others tell.

Every kvtune span carries ``kv.mode``. A trace may hold requests served in several modes (an A/B
of push against pull, or ``kvtune tune``'s push and pull runs beside its bidirectional one). The
workload and the prefill cost are read from one mode's spans (the one with the most requests, the
*main* mode; ties go to the first name) with the probe's: mixing modes would mix conversations.
The fabric fit reads every mode's transfers (one fabric). Each mode's own requests then say what
its TTFT was (:func:`measured_ttft`), which the mode comparison takes over the simulator's for
that mode (``kvtune.recommend.mode``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvtune import spans as S

BOOTSTRAP_DRAWS = 1000
BOOTSTRAP_SEED = 0
MIN_MODE_REQUESTS = 6
"""Fewer traced requests of a mode than this give it no measured TTFT."""


def spans_named(spans: pd.DataFrame, name: str, role: str | None = None) -> pd.DataFrame:
    """``spans``' rows of span ``name`` (emitted by ``role``, when given)."""
    keep = spans["name"].astype("object") == name
    if role is not None:
        keep &= spans[S.ROLE].astype("object") == role
    return spans[keep.to_numpy(dtype=bool)]


@dataclass(frozen=True)
class ModeSplit:
    main: str | None
    """The serving mode the advice reads (None: no span names one)."""
    requests: dict[str, int]
    """Requests per serving mode (``kv.request`` spans, else ``kv.prefill`` spans)."""
    main_spans: pd.DataFrame
    """The main mode's spans, the probe's and those naming no mode."""
    others: dict[str, pd.DataFrame]
    """The other serving modes' spans."""


def split_modes(spans: pd.DataFrame) -> ModeSplit:
    """Split ``spans`` (``kvtune.traces.load``'s frame) by serving mode (see module doc)."""
    if spans.empty or S.MODE not in spans.columns or "name" not in spans.columns:
        return ModeSplit(None, {}, spans, {})
    mode = spans[S.MODE].astype("object")
    serving = mode.notna() & (mode != S.Mode.PROBE.value)
    name = spans["name"].astype("object")
    counted = name == S.SpanName.REQUEST.value
    if not (counted & serving).any():
        counted = name == S.SpanName.PREFILL.value
    counts = mode[(counted & serving).to_numpy(dtype=bool)].value_counts()
    requests = {str(k): int(v) for k, v in counts.items()}
    if len(requests) <= 1:
        return ModeSplit(next(iter(requests), None), requests, spans, {})
    main = max(sorted(requests), key=lambda m: requests[m])
    keep = (~serving | (mode == main)).to_numpy(dtype=bool)
    others = {m: spans[(mode == m).to_numpy(dtype=bool)] for m in sorted(requests) if m != main}
    return ModeSplit(main, requests, spans[keep], others)


@dataclass(frozen=True)
class MeasuredTtft:
    """TTFT to the decode's first step of one mode's traced requests (see :func:`first_step_ttft`)."""

    p50_ms: float
    p99_ms: float
    n_requests: int
    p50_ci_ms: tuple[float, float] = (float("nan"), float("nan"))
    """95% percentile-bootstrap interval of ``p50_ms`` (the requests' own spread; two pair starts
    differ by a few milliseconds beyond it)."""

    def as_dict(self) -> dict[str, float | int | list[float]]:
        return {"p50_ms": self.p50_ms, "p99_ms": self.p99_ms, "n_requests": self.n_requests,
                "p50_ci_ms": list(self.p50_ci_ms)}


def first_step_ttft(spans: pd.DataFrame) -> pd.DataFrame:
    """Per request that a router traced and whose decode step was traced: ``trace_id``,
    ``client_request_id``, ``mode`` and ``ttft_ms`` = the router's ``kv.request`` began -> the
    decode's ``kv.decode_start`` ended (the request scheduled for its first token, its KV in
    place). Unlike the router's ``kv.ttft_ms`` of a non-streamed request (the prefill's answer),
    every mode's KV path is inside it."""
    cols = ["trace_id", "client_request_id", "mode", "ttft_ms"]
    if spans.empty or not {"name", "trace_id", "start_ns", "end_ns", S.ROLE} <= set(spans.columns):
        return pd.DataFrame(columns=cols)
    req = spans_named(spans, S.SpanName.REQUEST.value)
    ds = spans_named(spans, S.SpanName.DECODE_START.value, S.Role.DECODE.value)
    if req.empty or ds.empty:
        return pd.DataFrame(columns=cols)
    first = ds.groupby("trace_id")["end_ns"].min()
    req = req.drop_duplicates("trace_id")
    end = req["trace_id"].map(first)
    keep = (end.notna() & (end >= req["start_ns"])).to_numpy(dtype=bool)
    req, end = req[keep], end[keep]
    if S.CLIENT_REQUEST_ID in req.columns:
        rid = req[S.CLIENT_REQUEST_ID].astype("object")
    else:  # not a typed column: every attribute is in ``attrs``
        rid = pd.Series([a.get(S.CLIENT_REQUEST_ID) if isinstance(a, dict) else None
                         for a in (req["attrs"] if "attrs" in req.columns else [None] * len(req))],
                        index=req.index, dtype="object")
    mode = (req[S.MODE].astype("object") if S.MODE in req.columns
            else pd.Series(None, index=req.index, dtype="object"))
    return pd.DataFrame({"trace_id": req["trace_id"].to_numpy(), "client_request_id": rid.to_numpy(),
                         "mode": mode.to_numpy(),
                         "ttft_ms": (end.astype("int64") - req["start_ns"].astype("int64"))
                         .to_numpy(dtype=float) / 1e6})


def measured_ttft(spans: pd.DataFrame) -> dict[str, MeasuredTtft]:
    """:func:`first_step_ttft`'s p50/p99 per serving mode with at least
    :data:`MIN_MODE_REQUESTS` requests."""
    t = first_step_ttft(spans)
    out = {}
    for mode, g in t.dropna(subset=["mode"]).groupby("mode"):
        if str(mode) == S.Mode.PROBE.value or len(g) < MIN_MODE_REQUESTS:
            continue
        v = g["ttft_ms"].to_numpy(dtype=float)
        rng = np.random.default_rng(BOOTSTRAP_SEED)
        draws = np.median(v[rng.integers(0, len(v), (BOOTSTRAP_DRAWS, len(v)))], axis=1)
        lo, hi = np.quantile(draws, [0.025, 0.975])
        out[str(mode)] = MeasuredTtft(float(np.quantile(v, 0.5)), float(np.quantile(v, 0.99)),
                                      int(len(v)), (float(lo), float(hi)))
    return out


@dataclass(frozen=True)
class TracedSettings:
    """The reuse settings the traced requests ran under (medians of what the spans carry)."""

    threshold_tokens: int | None
    """``kv.reuse.threshold_tokens`` of the prefill's reuse decisions."""
    ttl_s: float | None
    """``kv.retention.ttl_s`` of the decode's retentions."""


def traced_settings(spans: pd.DataFrame) -> TracedSettings:
    """:class:`TracedSettings` of ``spans`` (None where no span says)."""
    def median(col: str, span: str) -> float | None:
        if spans.empty or col not in spans.columns or "name" not in spans.columns:
            return None
        v = pd.to_numeric(spans_named(spans, span)[col], errors="coerce").dropna()
        return float(v.median()) if len(v) else None

    thr = median(S.REUSE_THRESHOLD_TOKENS, S.SpanName.REUSE_DECISION.value)
    return TracedSettings(None if thr is None else int(round(thr)),
                          median(S.RETENTION_TTL_S, S.SpanName.RETENTION.value))
