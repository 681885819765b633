"""Which phase holds a stalled request's time: stalled requests next to fast ones, per phase.

A request's time (``kv.request`` when a router traced it, else from its first to its last engine
span) is split into the transfer phases (columns of the transfers table), the wait for each
engine's scheduler (``kv.queue`` by role: ``queue_prefill_ms``, ``queue_decode_ms``), the prefill
(``kv.prefill``), the gaps between them (``handoff_ms``, ``dispatch_ms``) and what no span covers
(``uncovered_ms``: HTTP, response handling, decode steps). The phase whose median grows most
between fast and stalled requests is named as the one holding the stall.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvtune import spans as S
from kvtune.errors import AnalysisError

STALL_MS = 1000.0
"""A request slower than this is stalled (the issue's yardstick: 'share of requests over 1 s'); so is
a transfer phase (a lost notification, a hung registration...: ``kvtune.recommend.findings``)."""

PHASE_COLS = tuple(S.PHASE_COLUMNS[p] for p in S.PHASES)
QUEUE_COLS = {S.Role.PREFILL.value: "queue_prefill_ms", S.Role.DECODE.value: "queue_decode_ms"}
"""``kv.queue`` time per trace, by the emitting engine's role."""
GAP_COLS = ("handoff_ms", "dispatch_ms")
"""Gaps between spans of one request: ``handoff_ms`` = prefill done -> the decode's API server
stamped the decode request's arrival (prefill response, router/client, decode intake);
``dispatch_ms`` = the decode's scheduler first saw it -> its first transfer span began
(scheduler -> worker step, handshake wait)."""
EXTRA_COLS = (*QUEUE_COLS.values(), "prefill_ms", *GAP_COLS, "uncovered_ms")


@dataclass(frozen=True)
class StallDiagnosis:
    """Per-request phase split of stalled vs fast requests.

    ``table``: one row per request (trace) with ``request_ms``, each phase column, ``stalled``.
    ``phase_excess_ms``: median(stalled) - median(fast) per phase. ``dominant_phase``: the phase with
    the largest excess (None when nothing stalled). ``slow_trace``/``fast_trace``: examples."""

    table: pd.DataFrame
    stalled_share: float
    n_requests: int
    n_stalled: int
    p50_ms: float
    p99_ms: float
    dominant_phase: str | None
    phase_excess_ms: dict[str, float] = field(default_factory=dict)
    slow_trace: str | None = None
    fast_trace: str | None = None
    threshold_ms: float = STALL_MS

    @property
    def summary(self) -> str:
        if self.n_requests == 0:
            return "no requests"
        head = (f"{self.n_stalled} of {self.n_requests} requests over {self.threshold_ms:g} ms "
                f"({self.stalled_share:.0%}); p50 {self.p50_ms:.0f} ms, p99 {self.p99_ms:.0f} ms")
        if self.dominant_phase is None:
            return head + "; nothing stalled"
        return (head + f"; the stalled time is in {self.dominant_phase.removesuffix('_ms')} "
                f"(+{self.phase_excess_ms[self.dominant_phase]:.0f} ms median over fast requests)")


def _own_request_spans(spans: pd.DataFrame) -> pd.DataFrame:
    """Without a router's ``kv.request``: the engines' spans that belong to the request itself.

    Left out: retention (lasts until the next turn) and the reverse transfer of the next turn,
    which joins this turn's trace."""
    if not len(spans) or "name" not in spans.columns:
        return spans.iloc[0:0] if len(spans) else spans
    keep = spans["name"].isin([S.SpanName.QUEUE.value, S.SpanName.PREFILL.value,
                               S.SpanName.HANDSHAKE.value, S.SpanName.REUSE_DECISION.value,
                               *(p.value for p in S.PHASES)])
    if S.DIRECTION in spans.columns:
        keep &= (spans[S.DIRECTION].astype("object") != S.Direction.REVERSE.value).to_numpy()
    return spans[keep.to_numpy(dtype=bool)]


def _gaps(own: pd.DataFrame) -> pd.DataFrame:
    """Per trace: :data:`GAP_COLS` from the prefill, the decode's ``kv.queue`` and the first
    transfer span after it (handshake, registration, descriptor setup); ``own`` is
    :func:`_own_request_spans` (no reverse transfer)."""
    if not len(own) or S.ROLE not in own.columns:
        return pd.DataFrame(columns=list(GAP_COLS))
    role = own[S.ROLE].astype("object")
    pre_end = own[own["name"] == S.SpanName.PREFILL.value].groupby("trace_id")["end_ns"].min()
    dq = own[(own["name"] == S.SpanName.QUEUE.value) & (role == S.Role.DECODE.value)]
    dq_start = dq.groupby("trace_id")["start_ns"].min()
    dq_end = dq.groupby("trace_id")["end_ns"].min()
    first = own[own["name"].isin([S.SpanName.HANDSHAKE.value, S.SpanName.REGISTRATION.value,
                                  S.SpanName.DESCRIPTOR_SETUP.value])]
    first_start = first.groupby("trace_id")["start_ns"].min()
    out = pd.DataFrame(index=pd.Index(sorted(set(dq_start.index)), name="trace_id"))
    # unclipped: negative where the decode saw its leg before the prefill ended (push)
    out["handoff_ms"] = (dq_start - pre_end).reindex(out.index).astype(float) / 1e6
    out["dispatch_ms"] = (first_start - dq_end).reindex(out.index).astype(float) / 1e6
    return out


def handoffs_ms(spans: pd.DataFrame) -> pd.Series:
    """Per trace whose decode leg began after its prefill ended (pull, and bidirectional's forward
    leg): ``handoff_ms``, the prefill's answer -> the decode's scheduler saw the decode leg
    (two HTTP hops through the router and the router's own work)."""
    if not len(spans) or "name" not in spans.columns:
        return pd.Series(dtype=float)
    h = _gaps(_own_request_spans(spans))["handoff_ms"].dropna()
    return h[h >= 0].astype(float)


def _request_times(spans: pd.DataFrame, own: pd.DataFrame, tx: pd.DataFrame) -> pd.DataFrame:
    req = spans[spans["name"] == S.SpanName.REQUEST.value] if len(spans) else spans
    if len(req):
        out = req.groupby("trace_id").agg(start_ns=("start_ns", "min"), end_ns=("end_ns", "max"))
    elif len(own):
        out = own.groupby("trace_id").agg(start_ns=("start_ns", "min"), end_ns=("end_ns", "max"))
    elif len(tx):
        out = tx.groupby("trace_id").agg(start_ns=("start_ns", "min"), end_ns=("end_ns", "max"))
    else:
        raise AnalysisError("stall diagnosis: no kv.request spans and no transfers in the trace")
    out["request_ms"] = (out["end_ns"] - out["start_ns"]).astype(float) / 1e6
    return out


def stall_diagnosis(tx: pd.DataFrame, spans: pd.DataFrame | None = None, *,
                    threshold_ms: float = STALL_MS) -> StallDiagnosis:
    """Split each request's time by phase and name the phase that holds the stalls."""
    spans = spans if spans is not None else pd.DataFrame(columns=["name", "trace_id"])
    own = _own_request_spans(spans)
    req = _request_times(spans, own, tx)
    cols = [c for c in PHASE_COLS if c in tx.columns]
    per = (tx.groupby("trace_id")[cols].sum(min_count=1).astype(float) if len(tx)
           else pd.DataFrame(columns=cols, dtype=float))
    table = req.join(per, how="left")
    pre = spans[spans["name"] == S.SpanName.PREFILL.value] if len(spans) else spans
    table["prefill_ms"] = (pre.groupby("trace_id")["duration_ms"].sum().astype(float)
                           if len(pre) else np.nan)
    que = spans[spans["name"] == S.SpanName.QUEUE.value] if len(spans) else spans
    for role, col in QUEUE_COLS.items():
        sel = que[que[S.ROLE] == role] if len(que) and S.ROLE in que.columns else que.iloc[0:0]
        table[col] = (sel.groupby("trace_id")["duration_ms"].sum().astype(float)
                      if len(sel) else np.nan)
    gaps = _gaps(own)
    for col in GAP_COLS:
        table[col] = gaps[col].clip(lower=0) if len(gaps) else np.nan
    covered = table[cols + list(EXTRA_COLS[:-1])].fillna(0).sum(axis=1)
    table["uncovered_ms"] = (table["request_ms"] - covered).clip(lower=0)
    table["stalled"] = table["request_ms"] > threshold_ms
    table = table.sort_values("request_ms")
    n = len(table)
    n_st = int(table["stalled"].sum())
    excess: dict[str, float] = {}
    dominant = None
    if n_st and n_st < n:
        st, fast = table[table["stalled"]], table[~table["stalled"]]
        for c in cols + list(EXTRA_COLS):
            a, b = st[c].astype(float).median(), fast[c].astype(float).median()
            a = 0.0 if np.isnan(a) else a
            b = 0.0 if np.isnan(b) else b
            excess[c] = float(a - b)
        dominant = max(excess, key=excess.get)
    elif n_st:
        st = table[table["stalled"]]
        for c in cols + list(EXTRA_COLS):
            v = st[c].astype(float).median()
            excess[c] = 0.0 if np.isnan(v) else float(v)
        dominant = max(excess, key=excess.get)
    rq = table["request_ms"].astype(float)
    return StallDiagnosis(
        table=table.reset_index(), stalled_share=n_st / n if n else 0.0, n_requests=n,
        n_stalled=n_st, p50_ms=float(rq.median()) if n else float("nan"),
        p99_ms=float(rq.quantile(0.99)) if n else float("nan"), dominant_phase=dominant,
        phase_excess_ms=excess,
        slow_trace=str(table.index[-1]) if n_st else None,
        fast_trace=str(table.index[0]) if n_st < n and n else None, threshold_ms=threshold_ms)


def side_by_side_figure(diag: StallDiagnosis) -> Any:
    """Stacked bars: the slowest stalled request next to the fastest one, and the medians."""
    import plotly.graph_objects as go

    from kvtune.plots import PHASE_COLORS

    t = diag.table.set_index("trace_id")
    rows: list[tuple[str, pd.Series]] = []
    if diag.slow_trace:
        rows.append((f"slowest ({t.loc[diag.slow_trace, 'request_ms']:.0f} ms)", t.loc[diag.slow_trace]))
    if diag.fast_trace:
        rows.append((f"fastest ({t.loc[diag.fast_trace, 'request_ms']:.0f} ms)", t.loc[diag.fast_trace]))
    for label, sel in (("median stalled", t[t["stalled"]]), ("median fast", t[~t["stalled"]])):
        if len(sel):
            rows.append((label, sel.drop(columns=["stalled"]).astype(float).median()))
    fig = go.Figure()
    for c in [c for c in PHASE_COLS if c in t.columns] + list(EXTRA_COLS):
        fig.add_trace(go.Bar(x=[r[0] for r in rows],
                             y=[0.0 if pd.isna(r[1].get(c)) else float(r[1].get(c)) for r in rows],
                             name=c.removesuffix("_ms"), marker_color=PHASE_COLORS.get(c)))
    fig.update_layout(barmode="stack", yaxis_title="ms",
                      title="Stalled vs fast requests: " + diag.summary)
    return fig


def timeline_figure(diag: StallDiagnosis, spans: pd.DataFrame) -> Any:
    """The slowest stalled request and the fastest one, each span on a time axis from the request's
    first span (two panels, one row per span name and role): the gaps show where time went."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    picks = [(f"slowest: {diag.slow_trace}", diag.slow_trace),
             (f"fastest: {diag.fast_trace}", diag.fast_trace)]
    picks = [(label, t) for label, t in picks if t]
    if not picks:
        raise AnalysisError("timeline: no stalled or fast request to show")
    fig = make_subplots(rows=len(picks), cols=1, subplot_titles=[p[0] for p in picks],
                        shared_xaxes=False, vertical_spacing=0.22)
    own = _own_request_spans(spans)
    for row, (_, trace) in enumerate(picks, start=1):
        sel = own[own["trace_id"] == trace].sort_values("start_ns")
        if not len(sel):
            continue
        t0 = int(sel["start_ns"].min())
        role = (sel[S.ROLE].astype("object").fillna("?") if S.ROLE in sel.columns
                else pd.Series("?", index=sel.index))
        labels = [f"{r} {n}" for r, n in zip(role, sel["name"])]
        fig.add_trace(go.Bar(
            y=labels, x=[max(float(d), 0.05) for d in sel["duration_ms"]],
            base=[(int(s) - t0) / 1e6 for s in sel["start_ns"]], orientation="h",
            showlegend=False, hovertemplate="%{y}: %{x:.1f} ms from %{base:.1f} ms",
            marker_color=[_span_color(n) for n in sel["name"]]), row=row, col=1)
        fig.update_xaxes(title_text="ms since the request's first span", row=row, col=1)
        fig.update_yaxes(autorange="reversed", row=row, col=1)
    fig.update_layout(title="Where the time went<br><sup>" + diag.summary + "</sup>",
                      height=320 * len(picks))
    return fig


def _span_color(name: str) -> str:
    from kvtune.plots import PHASE_COLORS

    if name == S.SpanName.PREFILL.value:
        return PHASE_COLORS.get("prefill_ms", "#7f7f7f")
    if name == S.SpanName.QUEUE.value:
        return "#bcbd22"
    for phase in S.PHASES:
        if phase.value == name:
            return PHASE_COLORS.get(S.PHASE_COLUMNS[phase], "#aaaaaa")
    return "#aaaaaa"  # handshake, reuse decision
