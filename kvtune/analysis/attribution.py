"""Every millisecond of TTFT named: per request, the share of its time to first token each span
takes, and the share no span names.

The TTFT window of a request is its router's ``kv.request`` began -> the decode's first
``kv.decode_start`` ended (:func:`kvtune.analysis.modes.first_step_ttft`, what ``kvtune verify``
measures). Clocks are the loader's, corrected across hosts (``kvtune.traces.load``). Every span of
the trace with a convention name but ``kv.request`` and ``kv.retention`` (a wait between turns,
not a step of this one) is clipped to the window. Each instant is then given to one span, so that
nothing is counted twice and a request's shares sum to one:

- the engines' spans before the router's phases (:data:`kvtune.spans.ROUTER_PHASES`: the engines'
  work nests inside the legs, so a leg keeps only its own time: the hop, the API servers' HTTP
  intake and the answer's way back);
- among spans of one layer, the one that began last (the innermost, or the latest thing the
  request went on to wait for, e.g. push's rendezvous over the decode's registration).

Instants covered by no such span are *unnamed* (:data:`UNNAMED`). The largest unnamed stretch of
a request is reported with the spans it sits between (the one given the instant before it, and
the one after; ``kv.request`` at the window's edges).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvtune import spans as S
from kvtune.analysis.modes import first_step_ttft

UNNAMED = "unnamed"
"""The ``phase`` of time no span names."""
NAMED_SHARE_QUANTILES: tuple[float, float] = (0.5, 0.1)
"""The per-request quantiles of the named share a summary reports (median, p10)."""
EXCLUDED_SPANS: frozenset[str] = frozenset(n.value for n in S.NOT_TTFT_STEPS)
"""Spans that are not steps of the request's TTFT (the window itself; a wait between turns)."""
ROUTER_LAYER, ENGINE_LAYER = 1, 2
"""Priority of a span's instants: engine spans nest inside the router's phases."""

PHASE_COLUMNS: tuple[str, ...] = ("trace_id", "mode", "ttft_ms", "phase", "ms", "share")
"""Columns of :func:`phase_shares`: one row per request and phase (span name, or
:data:`UNNAMED`) that holds some of its TTFT; ``ms`` its time, ``share`` = ms / ttft_ms."""
REQUEST_COLUMNS: tuple[str, ...] = (
    "trace_id", "mode", "start_ns", "ttft_ms", "named_ms", "unnamed_ms", "named_share",
    "unnamed_share", "gap_ms", "gap_after", "gap_before")
"""Columns of :func:`request_attribution`: one row per request; ``gap_ms`` its largest unnamed
stretch, after the span ``gap_after`` and before ``gap_before`` (None when nothing is unnamed)."""
SEGMENT_COLUMNS: tuple[str, ...] = ("trace_id", "phase", "start_ms", "end_ms")
"""Columns of :func:`segments`: one request's TTFT as consecutive stretches, each given to one
phase, in ms from the request's start (what a waterfall draws)."""


def _named_spans(spans: pd.DataFrame) -> pd.DataFrame:
    names = spans["name"].astype("object")
    keep = names.isin(S.span_names() - EXCLUDED_SPANS).to_numpy(dtype=bool)
    out = spans.loc[keep, ["trace_id", "name", "start_ns", "end_ns"]].copy()
    router = {p.value for p in S.ROUTER_PHASES}
    out["layer"] = np.where(out["name"].astype("object").isin(router), ROUTER_LAYER, ENGINE_LAYER)
    return out


def _sweep(t0: int, t1: int, parts: pd.DataFrame) -> list[tuple[str, int, int]]:
    """``[t0, t1]`` cut into consecutive (phase, start_ns, end_ns) stretches (see module doc)."""
    s = np.clip(parts["start_ns"].to_numpy(dtype=np.int64), t0, t1)
    e = np.clip(parts["end_ns"].to_numpy(dtype=np.int64), t0, t1)
    ok = e > s
    s, e = s[ok], e[ok]
    names = parts["name"].astype("object").to_numpy()[ok]
    layer = parts["layer"].to_numpy()[ok]
    cuts = np.unique(np.concatenate([[t0, t1], s, e]))
    out: list[tuple[str, int, int]] = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        active = np.flatnonzero((s <= a) & (e >= b))
        if len(active):
            best = active[np.lexsort((s[active], layer[active]))[-1]]
            phase = str(names[best])
        else:
            phase = UNNAMED
        if out and out[-1][0] == phase:
            out[-1] = (phase, out[-1][1], int(b))
        else:
            out.append((phase, int(a), int(b)))
    return out


def _requests(spans: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, list[tuple[str, int, int]]]]:
    need = {"name", "trace_id", "start_ns", "end_ns", S.ROLE}
    if spans.empty or not need <= set(spans.columns):
        return pd.DataFrame(columns=["trace_id", "mode", "start_ns", "ttft_ms"]), {}
    ttft = first_step_ttft(spans)
    if ttft.empty:
        return pd.DataFrame(columns=["trace_id", "mode", "start_ns", "ttft_ms"]), {}
    req = spans[(spans["name"].astype("object") == S.SpanName.REQUEST.value).to_numpy(dtype=bool)]
    start = req.drop_duplicates("trace_id").set_index("trace_id")["start_ns"]
    ttft = ttft.assign(start_ns=ttft["trace_id"].map(start).astype("int64"))
    named = _named_spans(spans[spans["trace_id"].isin(ttft["trace_id"]).to_numpy(dtype=bool)])
    by_trace = dict(iter(named.groupby("trace_id")))
    empty = named.iloc[:0]
    cut = {}
    for tid, t0, ms in zip(ttft["trace_id"], ttft["start_ns"], ttft["ttft_ms"]):
        t1 = int(t0) + int(round(float(ms) * 1e6))
        cut[tid] = _sweep(int(t0), t1, by_trace.get(tid, empty))
    return ttft[["trace_id", "mode", "start_ns", "ttft_ms"]], cut


def segments(spans: pd.DataFrame) -> pd.DataFrame:
    """Each router-traced request's TTFT as consecutive stretches (:data:`SEGMENT_COLUMNS`)."""
    reqs, cut = _requests(spans)
    rows = [(tid, phase, (a - t0) / 1e6, (b - t0) / 1e6)
            for tid, t0 in zip(reqs["trace_id"], reqs["start_ns"]) for phase, a, b in cut[tid]]
    return pd.DataFrame(rows, columns=list(SEGMENT_COLUMNS))


def phase_shares(spans: pd.DataFrame) -> pd.DataFrame:
    """Per request and phase, its time and share of the request's TTFT (:data:`PHASE_COLUMNS`)."""
    reqs, cut = _requests(spans)
    rows = []
    for tid, mode, ttft in zip(reqs["trace_id"], reqs["mode"], reqs["ttft_ms"]):
        total: dict[str, int] = {}
        for phase, a, b in cut[tid]:
            total[phase] = total.get(phase, 0) + (b - a)
        for phase, ns in total.items():
            rows.append((tid, mode, float(ttft), phase, ns / 1e6,
                         ns / 1e6 / ttft if ttft > 0 else float("nan")))
    return pd.DataFrame(rows, columns=list(PHASE_COLUMNS))


SUMMARY_COLUMNS: tuple[str, ...] = ("mode", "phase", "n_requests", "share_p50", "share_total")
"""Columns of :func:`share_summary`: per mode and phase, the requests it appears in, its median
share of their TTFT and its share of the mode's summed TTFT."""


def share_summary(shares: pd.DataFrame) -> pd.DataFrame:
    """Per mode and phase of :func:`phase_shares`' frame (:data:`SUMMARY_COLUMNS`), each mode's
    phases by median share, largest first: what the bench prints and the report tabulates."""
    if shares.empty:
        return pd.DataFrame(columns=list(SUMMARY_COLUMNS))
    shares = shares.assign(mode=shares["mode"].astype("object").fillna("?"))
    per_mode_ms = shares.groupby("mode")["ms"].sum()
    g = shares.groupby(["mode", "phase"])
    out = pd.DataFrame({"n_requests": g["trace_id"].nunique(), "share_p50": g["share"].median(),
                        "ms": g["ms"].sum()}).reset_index()
    out["share_total"] = out["ms"] / out["mode"].map(per_mode_ms)
    out = out.sort_values(["mode", "share_p50", "phase"], ascending=[True, False, True])
    return out[list(SUMMARY_COLUMNS)].reset_index(drop=True)


SUMMED_COLUMNS: tuple[str, ...] = ("mode", "phase", "ms", "share")
"""Columns of :func:`summed_span_shares`."""
PANEL_SPANS: frozenset[str] = frozenset(
    n.value for n in S.TTFT_STEP_SPANS if n is not S.SpanName.NOTIFY)
"""The spans the dashboard's per-phase share panel sums (its ``SHARE_SPANS``: steps with an
extent; ``kv.notify`` is an instant)."""


def summed_span_shares(spans: pd.DataFrame) -> pd.DataFrame:
    """What the dashboard's "share of time per phase" panel stacks, over the whole range, per
    serving mode (:data:`SUMMED_COLUMNS`): every step span's whole duration summed per ``kv.mode``
    and name, and its share of the mode's sum.

    Unlike :func:`phase_shares` nothing is clipped to the TTFT window and spans that nest (an
    engine's inside a router leg) or run side by side are each counted in full, as a TraceQL
    ``sum_over_time(duration)`` counts them; spans without ``kv.mode`` are left out, as the
    panel's mode filter leaves them out."""
    if spans.empty or S.MODE not in spans.columns:
        return pd.DataFrame(columns=list(SUMMED_COLUMNS))
    names = spans["name"].astype("object")
    mode = spans[S.MODE].astype("object")
    keep = (names.isin(PANEL_SPANS) & mode.notna()).to_numpy(dtype=bool)
    df = pd.DataFrame({"mode": mode[keep].astype(str), "phase": names[keep],
                       "ms": (spans["end_ns"][keep] - spans["start_ns"][keep]).to_numpy() / 1e6})
    out = df.groupby(["mode", "phase"])["ms"].sum().reset_index()
    out["share"] = out["ms"] / out["mode"].map(out.groupby("mode")["ms"].sum())
    out = out.sort_values(["mode", "share", "phase"], ascending=[True, False, True])
    return out[list(SUMMED_COLUMNS)].reset_index(drop=True)


def request_attribution(spans: pd.DataFrame) -> pd.DataFrame:
    """Per request, named and unnamed time and its largest unnamed gap (:data:`REQUEST_COLUMNS`)."""
    reqs, cut = _requests(spans)
    rows = []
    for tid, mode, t0, ttft in zip(reqs["trace_id"], reqs["mode"], reqs["start_ns"],
                                   reqs["ttft_ms"]):
        parts = cut[tid]
        unnamed_ns = sum(b - a for p, a, b in parts if p == UNNAMED)
        gap, after, before = 0, None, None
        for i, (p, a, b) in enumerate(parts):
            if p == UNNAMED and b - a > gap:
                gap = b - a
                after = parts[i - 1][0] if i > 0 else S.SpanName.REQUEST.value
                before = parts[i + 1][0] if i + 1 < len(parts) else S.SpanName.REQUEST.value
        ttft = float(ttft)
        unnamed_ms = unnamed_ns / 1e6
        share = unnamed_ms / ttft if ttft > 0 else float("nan")
        rows.append((tid, mode, int(t0), ttft, ttft - unnamed_ms, unnamed_ms, 1.0 - share, share,
                     gap / 1e6, after, before))
    return pd.DataFrame(rows, columns=list(REQUEST_COLUMNS))


@dataclass(frozen=True)
class NamedShare:
    """One serving mode's named share of TTFT over its requests."""

    mode: str
    n_requests: int
    named_share_p50: float
    named_share_p10: float
    unnamed_ms_p50: float
    ttft_ms_p50: float
    gap_after: str | None
    """The span the most common largest unnamed gap follows (None: nothing unnamed)."""
    gap_before: str | None
    """The span that gap precedes."""

    def as_dict(self) -> dict[str, float | int | str | None]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def named_shares(table: pd.DataFrame) -> dict[str, NamedShare]:
    """:class:`NamedShare` per serving mode of :func:`request_attribution`'s ``table``."""
    out: dict[str, NamedShare] = {}
    table = table.assign(mode=table["mode"].astype("object").fillna("?"))
    for mode, g in table.dropna(subset=["named_share"]).groupby("mode"):
        share = g["named_share"].to_numpy(dtype=float)
        p50, p10 = (float(np.quantile(share, q)) for q in NAMED_SHARE_QUANTILES)
        gaps = g[g["gap_ms"] > 0]
        after = before = None
        if len(gaps):
            pair = (gaps.groupby(["gap_after", "gap_before"])["gap_ms"].sum()
                    .sort_values(ascending=False).index[0])
            after, before = str(pair[0]), str(pair[1])
        out[str(mode)] = NamedShare(
            str(mode), int(len(g)), p50, p10, float(g["unnamed_ms"].median()),
            float(g["ttft_ms"].median()), after, before)
    return out


WATERFALL_SLOWEST = 3
"""Requests a report draws a waterfall of: this many slowest, and one typical."""


def waterfall_requests(table: pd.DataFrame, *, slowest: int = WATERFALL_SLOWEST) -> list[str]:
    """Trace ids to draw (:func:`request_attribution`'s ``table``): the ``slowest`` by TTFT, then
    the typical one (TTFT nearest the median) when it is not among them."""
    if table.empty:
        return []
    by_ttft = table.sort_values("ttft_ms", ascending=False)
    out = [str(t) for t in by_ttft["trace_id"].head(slowest)]
    median = float(table["ttft_ms"].median())
    typical = str(table.loc[(table["ttft_ms"] - median).abs().idxmin(), "trace_id"])
    return out if typical in out else out + [typical]
