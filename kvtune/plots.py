"""Plotly figures for the notebooks and the report. Pure: data in, figure out; no analysis here."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from kvtune.spans import PHASE_COLUMNS, PHASES
from kvtune.vllm_pd import DEFAULT_KV_RECOMPUTE_THRESHOLD_TOKENS

PHASE_COLORS = {
    "registration_ms": "#8c564b", "rendezvous_ms": "#9467bd", "descriptor_setup_ms": "#ff7f0e",
    "rdma_ms": "#1f77b4", "notify_ms": "#2ca02c", "decode_start_ms": "#d62728",
    "prefill_ms": "#7f7f7f", "before_transfer_ms": "#bcbd22", "uncovered_ms": "#17becf",
}


def _go():
    import plotly.graph_objects as go
    return go


def floor_fit(tx: pd.DataFrame, fit: Any, *, column: str = "critical_ms",
              title: str = "Transfer time vs bytes, with the fitted floor") -> Any:
    """Scatter of transfer time vs bytes (log-log), the fit and its 95% band."""
    go = _go()
    fig = go.Figure()
    df = tx.dropna(subset=[column, "bytes"])
    for key, grp in df.groupby(df["op"].fillna("?").astype(str) + " " +
                               df["mode"].fillna("?").astype(str)):
        fig.add_trace(go.Scatter(x=grp["bytes"].astype(float), y=grp[column].astype(float),
                                 mode="markers", name=key, opacity=0.6))
    if fit is not None and len(df):
        xs = np.geomspace(max(float(df["bytes"].min()), 1.0), float(df["bytes"].max()), 60)
        mid = [fit.predict_ms(x) for x in xs]
        lo = [fit.floor_ci_ms[0] + x * 8 / (fit.bandwidth_ci_gbps[1] * 1e9) * 1e3 for x in xs]
        hi = [fit.floor_ci_ms[1] + x * 8 / (max(fit.bandwidth_ci_gbps[0], 1e-9) * 1e9) * 1e3
              for x in xs]
        fig.add_trace(go.Scatter(x=np.concatenate([xs, xs[::-1]]), y=np.concatenate([hi, lo[::-1]]),
                                 fill="toself", fillcolor="rgba(0,0,0,0.12)", line={"width": 0},
                                 name="95% interval", hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=xs, y=mid, mode="lines", line={"color": "black"},
                                 name=f"fit: floor {fit.floor_ms:.3g} ms, "
                                      f"{fit.bandwidth_gbps:.3g} Gb/s"))
        fig.add_trace(go.Scatter(x=[xs[0], xs[-1]], y=[fit.floor_ms, fit.floor_ms], mode="lines",
                                 line={"dash": "dot", "color": "gray"},
                                 name=f"floor {fit.floor_ms:.3g} ms"))
    fig.update_layout(title=title, xaxis_title="bytes per transfer (per rank)",
                      yaxis_title=f"{column.removesuffix('_ms')} time (ms)", xaxis_type="log",
                      yaxis_type="log")
    return fig


def size_buckets(bytes_: pd.Series) -> pd.Series:
    """Human-readable power-of-two size bucket labels (e.g. ``64 KiB``), ordered by size."""
    b = bytes_.astype(float).clip(lower=1)
    exp = np.floor(np.log2(b)).astype(int)
    labels = [_fmt_bytes(2 ** e) for e in exp]
    return pd.Series(pd.Categorical(labels, categories=[_fmt_bytes(2 ** e) for e in sorted(set(exp))],
                                    ordered=True), index=bytes_.index)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} TiB"


def phase_split(tx: pd.DataFrame, *, phases: Sequence[str] | None = None,
                title: str = "Where each transfer's time goes (median per size)") -> Any:
    """Stacked bars: median duration of each phase per size bucket."""
    go = _go()
    cols = [c for c in (phases or [PHASE_COLUMNS[p] for p in PHASES]) if c in tx.columns]
    df = tx.dropna(subset=["bytes"]).copy()
    fig = go.Figure()
    if len(df):
        df["size"] = size_buckets(df["bytes"])
        med = df.groupby("size", observed=True)[cols].median()
        for col in cols:
            if med[col].notna().any():
                fig.add_trace(go.Bar(x=[str(i) for i in med.index], y=med[col].fillna(0),
                                     name=col.removesuffix("_ms"),
                                     marker_color=PHASE_COLORS.get(col)))
    fig.update_layout(barmode="stack", title=title, xaxis_title="transfer size",
                      yaxis_title="median ms")
    return fig


def efficiency(tx: pd.DataFrame, *, nominal_gbps: float = 0.0, column: str = "rdma_ms",
               title: str = "Achieved throughput vs size") -> Any:
    """Achieved Gb/s of the transfer phase vs bytes, with the link's nominal rate when known."""
    go = _go()
    df = tx.dropna(subset=[column, "bytes"])
    df = df[df[column].astype(float) > 0]
    gbps = df["bytes"].astype(float) * 8 / (df[column].astype(float) / 1e3) / 1e9
    fig = go.Figure(go.Scatter(x=df["bytes"].astype(float), y=gbps, mode="markers",
                               name="achieved", opacity=0.6))
    if nominal_gbps > 0:
        fig.add_hline(y=nominal_gbps, line_dash="dash",
                      annotation_text=f"nominal {nominal_gbps:g} Gb/s")
    fig.update_layout(title=title, xaxis_type="log", xaxis_title="bytes per transfer",
                      yaxis_title="Gb/s")
    return fig


def table(rows: Sequence[dict[str, Any]], *, title: str = "") -> Any:
    """A plotly table of dict rows (for findings and evidence)."""
    go = _go()
    keys = list(rows[0].keys()) if rows else ["(none)"]
    values = [[str(r.get(k, "")) for r in rows] for k in keys] if rows else [["nothing to report"]]
    fig = go.Figure(go.Table(header={"values": keys, "align": "left"},
                             cells={"values": values, "align": "left"}))
    fig.update_layout(title=title, height=120 + 40 * max(len(rows), 1))
    return fig


def threshold_curve(tuning: Any, prefill: Any, *, max_tokens: int | None = None,
                    title: str = "Recompute vs pull: where pulling history back pays") -> Any:
    """Pull cost (floor + wire) and recompute cost over history length, break-even and its range."""
    go = _go()
    thr = tuning.threshold
    ev = thr.evidence
    c = float(ev.wire_ms_per_token)
    floor = float(ev.floor_ms)
    top = max_tokens or int(max(ev.max_context_tokens or 0, (ev.break_even_tokens or 0) * 2, 256))
    xs = np.unique(np.geomspace(1, top, 120).astype(int))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=xs, y=[floor + x * c for x in xs], name="pull: floor + wire",
                             line={"color": "#1f77b4"}))
    fig.add_trace(go.Scatter(x=xs, y=[prefill.recompute_ms(x) for x in xs],
                             name="recompute (measured prefill)", line={"color": "#d62728"}))
    ys = [floor + x * c for x in xs] + [prefill.recompute_ms(x) for x in xs]
    y_lo, y_hi = max(min(y for y in ys if y > 0), 1e-6), max(ys)

    def vline(x: float, name: str, **line: Any) -> None:
        # A trace, not a shape: shapes and annotations on log axes take log10 coordinates.
        fig.add_trace(go.Scatter(x=[x, x], y=[y_lo, y_hi], mode="lines", name=name, line=line))

    lo, hi = thr.range
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)):
        fig.add_trace(go.Scatter(x=[lo, hi, hi, lo], y=[y_lo, y_lo, y_hi, y_hi], fill="toself",
                                 fillcolor="rgba(0,0,0,0.1)", line={"width": 0},
                                 name=f"95% range {lo}-{hi}", mode="lines"))
    if isinstance(thr.value, (int, float)):
        vline(thr.value, f"recommended {thr.value}", color="black")
    vline(DEFAULT_KV_RECOMPUTE_THRESHOLD_TOKENS,
          f"vLLM default {DEFAULT_KV_RECOMPUTE_THRESHOLD_TOKENS}", color="gray",
          dash="dot")
    fig.update_layout(title=title, xaxis_type="log", xaxis_title="history tokens (R)",
                      yaxis_title="ms", yaxis_type="log")
    return fig


def gap_histogram(gaps_s: Sequence[float], *, ttl_s: float | None = None,
                  router_ttl_s: float | None = None,
                  title: str = "Inter-turn gaps (next turn start - previous turn end)") -> Any:
    go = _go()
    fig = go.Figure(go.Histogram(x=list(gaps_s), nbinsx=40, name="gaps"))
    if ttl_s is not None:
        fig.add_vline(x=ttl_s, line_color="black", annotation_text=f"TTL {ttl_s:g} s")
    if router_ttl_s is not None:
        fig.add_vline(x=router_ttl_s, line_dash="dot", annotation_text=f"router {router_ttl_s:g} s",
                      annotation_position="bottom right")
    fig.update_layout(title=title, xaxis_title="seconds", yaxis_title="count")
    return fig


def ttl_curves(ttls_s: Sequence[float], captured: Sequence[float], held_gb: Sequence[float], *,
               budget_gb: float, chosen_s: float, router_s: float | None = None,
               title: str = "Reuse captured and decode memory held vs TTL") -> Any:
    """Captured share of reusable history (left axis) and HBM held (right axis) as functions of TTL."""
    go = _go()
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=list(ttls_s), y=list(captured), name="reuse captured (share)",
                             yaxis="y"))
    fig.add_trace(go.Scatter(x=list(ttls_s), y=list(held_gb), name="HBM held (GB)", yaxis="y2",
                             line={"dash": "dash"}))
    fig.add_trace(go.Scatter(x=[min(ttls_s), max(ttls_s)], y=[budget_gb, budget_gb], yaxis="y2",
                             name=f"budget {budget_gb:g} GB", mode="lines",
                             line={"color": "gray", "dash": "dot"}))
    fig.add_vline(x=chosen_s, line_color="black", annotation_text=f"chosen {chosen_s:g} s")
    if router_s is not None:
        fig.add_vline(x=router_s, line_dash="dot", annotation_text=f"router {router_s:g} s",
                      annotation_position="bottom right")
    fig.update_layout(title=title, xaxis_title="decoder_kv_blocks_ttl (s)",
                      yaxis={"title": "share of reusable history", "range": [0, 1.05]},
                      yaxis2={"title": "GB", "overlaying": "y", "side": "right"})
    return fig


def mode_ttft(expected: dict[str, dict[str, float]], *, chosen: str, excluded: dict | None = None,
              title: str = "Expected TTFT per mode on this traffic") -> Any:
    go = _go()
    modes = list(expected)
    fig = go.Figure()
    for q, color in (("p50", "#1f77b4"), ("p99", "#ff7f0e")):
        fig.add_trace(go.Bar(x=modes, y=[expected[m][q] for m in modes], name=q,
                             marker_color=color))
    labels = [f"{m}{' (chosen)' if m == chosen else ''}"
              f"{' — excluded: ' + excluded[m] if excluded and m in excluded else ''}"
              for m in modes]
    fig.update_xaxes(ticktext=labels, tickvals=modes)
    fig.update_layout(barmode="group", title=title, yaxis_title="TTFT (ms)")
    return fig


UNNAMED_COLOR = "#d9d9d9"


def waterfall(segments: pd.DataFrame, trace_id: str, *, title: str = "") -> Any:
    """One request's TTFT as a waterfall: one row per phase (in order of first appearance), a bar
    per stretch the phase holds (``kvtune.analysis.attribution.segments``), unnamed time grey."""
    go = _go()
    seg = segments[segments["trace_id"] == trace_id]
    total = float(seg["end_ms"].max()) if len(seg) else 0.0
    order = list(dict.fromkeys(seg["phase"]))
    fig = go.Figure()
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
               "#7f7f7f", "#bcbd22", "#17becf"]
    for i, phase in enumerate(order):
        g = seg[seg["phase"] == phase]
        ms = float((g["end_ms"] - g["start_ms"]).sum())
        share = ms / total if total > 0 else float("nan")
        fig.add_trace(go.Bar(
            y=[phase] * len(g), x=(g["end_ms"] - g["start_ms"]).to_numpy(),
            base=g["start_ms"].to_numpy(), orientation="h", name=f"{phase} {share:.1%}",
            marker_color=UNNAMED_COLOR if phase == "unnamed" else palette[i % len(palette)],
            hovertemplate=f"{phase}: %{{base:.2f}} → %{{x:.2f}} ms long<extra></extra>"))
    fig.update_layout(title=title or f"TTFT of {trace_id[:12]}…: {total:.1f} ms", barmode="overlay",
                      xaxis_title="ms since the router received the request",
                      yaxis={"autorange": "reversed", "categoryorder": "array",
                             "categoryarray": order}, showlegend=True)
    return fig
