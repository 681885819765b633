"""Plotly figures for the notebooks and the report. Pure: data in, figure out; no analysis here."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from kvtune.spans import PHASE_COLUMNS, PHASES

PHASE_COLORS = {
    "registration_ms": "#8c564b", "rendezvous_ms": "#9467bd", "descriptor_setup_ms": "#ff7f0e",
    "rdma_ms": "#1f77b4", "notify_ms": "#2ca02c", "decode_start_ms": "#d62728",
    "prefill_ms": "#7f7f7f", "before_transfer_ms": "#bcbd22", "uncovered_ms": "#17becf",
}
MIB = 1024 * 1024


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
                                 name=f"fit: floor {fit.floor_ms:.3f} ms, "
                                      f"{fit.bandwidth_gbps:.2f} Gb/s"))
        fig.add_hline(y=fit.floor_ms, line_dash="dot",
                      annotation_text=f"floor {fit.floor_ms:.3f} ms")
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
