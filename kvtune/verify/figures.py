"""Plotly figures of a verification (pure: result in, figure out)."""
from __future__ import annotations

from typing import Any

from kvtune.verify.predictions import PredictionCheck
from kvtune.verify.results import CrossoverResult, VerifyResult

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _go() -> Any:
    import plotly.graph_objects as go
    return go


def comparison(result: VerifyResult) -> Any:
    """Per configuration: every request's TTFT (points), p50 and p99 with their intervals."""
    from plotly.subplots import make_subplots
    go = _go()
    fig = make_subplots(rows=1, cols=3, column_widths=[0.5, 0.25, 0.25],
                        subplot_titles=("TTFT per request (p50, p99 with 95% intervals)",
                                        "History pulled back from the decode (share of turn 2+ prompt tokens)",
                                        "Decode KV cache in use over the replay"))
    for i, c in enumerate(result.configs):
        color = COLORS[i % len(COLORS)]
        name = c.config.name
        ys = [r.ttft_ms for r in c.requests if r.ok and r.ttft_ms is not None]
        fig.add_trace(go.Box(y=ys, name=name, boxpoints="all", jitter=0.4, pointpos=0,
                             marker=dict(color=color, size=4), line=dict(color=color),
                             fillcolor="rgba(0,0,0,0)", showlegend=False), row=1, col=1)
        for q, symbol in ((c.ttft_p50, "diamond"), (c.ttft_p99, "triangle-up")):
            if q is None:
                continue
            fig.add_trace(go.Scatter(
                x=[name], y=[q.value_ms], mode="markers", marker=dict(symbol=symbol, size=11,
                                                                      color=color),
                error_y=dict(type="data", symmetric=False, array=[q.high_ms - q.value_ms],
                             arrayminus=[q.value_ms - q.low_ms]),
                name=f"{name} p{int(q.q * 100)}", showlegend=False,
                hovertemplate=f"{name} p{int(q.q * 100)} %{{y:.1f}} ms "
                              f"[{q.low_ms:.1f}, {q.high_ms:.1f}]<extra></extra>"), row=1, col=1)
        share = c.reuse_captured_share
        fig.add_trace(go.Bar(x=[name], y=[100 * share if share is not None else 0],
                             marker_color=color, showlegend=False,
                             text=["n/a" if share is None else f"{share:.0%}"],
                             textposition="outside"), row=1, col=2)
        if c.memory:
            fig.add_trace(go.Scatter(x=[m.t_s for m in c.memory],
                                     y=[m.decode_kv_usage_pct for m in c.memory], mode="lines",
                                     name=name, line=dict(color=color)), row=1, col=3)
    fig.update_yaxes(title_text="TTFT (ms)", type="log", row=1, col=1)
    fig.update_yaxes(title_text="% of turn 2+ prompt tokens", range=[0, 110], row=1, col=2)
    fig.update_yaxes(title_text="KV cache in use (%)", row=1, col=3)
    fig.update_xaxes(title_text="seconds into the replay", row=1, col=3)
    title = "; ".join(c.verdict for c in result.comparisons) or "one configuration measured"
    fig.update_layout(title=dict(text=title, font=dict(size=12)), height=480,
                      template="plotly_white")
    return fig


def crossover(cx: CrossoverResult) -> Any:
    """Turn-2 TTFT vs history length, reuse on and off; measured crossover and the recommended
    threshold with its range."""
    go = _go()
    fig = go.Figure()
    for label, color in (("on", COLORS[0]), ("off", COLORS[1])):
        pts = [p for p in cx.points if p.reuse == label]
        fig.add_trace(go.Scatter(x=[p.history_tokens for p in pts], y=[p.ttft_ms for p in pts],
                                 mode="markers", marker=dict(color=color, size=5, opacity=0.5),
                                 name=f"reuse {label} (requests)"))
        by: dict[int, list[float]] = {}
        for p in pts:
            by.setdefault(p.history_tokens, []).append(p.ttft_ms)
        xs = sorted(by)
        import statistics
        fig.add_trace(go.Scatter(x=xs, y=[statistics.median(by[x]) for x in xs],
                                 mode="lines+markers", line=dict(color=color),
                                 name=f"reuse {label} (median)"))
    est = cx.estimate
    if est.low_tokens is not None and est.high_tokens is not None:
        fig.add_vrect(x0=est.low_tokens, x1=max(est.high_tokens, est.low_tokens * 1.01),
                      fillcolor="green", opacity=0.12, line_width=0,
                      annotation_text="measured crossover 95%", annotation_position="top left")
    if est.tokens is not None:
        fig.add_vline(x=est.tokens, line=dict(color="green", width=2),
                      annotation_text=f"measured {est.tokens:.0f}",
                      annotation_position="bottom right")
    if cx.recommended_range_tokens is not None:
        lo, hi = cx.recommended_range_tokens
        fig.add_vrect(x0=max(lo, 1), x1=max(hi, lo * 1.01, 1.01), fillcolor="orange", opacity=0.12,
                      line_width=0, annotation_text="recommended range",
                      annotation_position="bottom left")
    if cx.recommended_threshold_tokens is not None:
        fig.add_vline(x=max(cx.recommended_threshold_tokens, 1),
                      line=dict(color="orange", width=2, dash="dash"),
                      annotation_text=f"recommended {cx.recommended_threshold_tokens:.0f}")
    side = {"crossed": "", "reuse_always_faster": " (reuse faster at every swept length)",
            "recompute_always_faster": " (recompute faster at every swept length)",
            "no_break_even": " (no break-even shape)"}.get(est.side, "")
    fig.update_layout(title=f"Measured recompute/pull crossover{side}", template="plotly_white",
                      xaxis=dict(title="history pulled back or recomputed (tokens)", type="log"),
                      yaxis=dict(title="turn-2 TTFT (ms)"), height=460)
    return fig


def predictions(check: PredictionCheck) -> Any:
    """Per mode: kvtune's predicted TTFT p50 (open marker, with the tolerance band) against the
    measured p50 and its 95% interval."""
    go = _go()
    fig = go.Figure()
    tol = check.p50_tolerance_share
    modes = [m for m in check.modes]
    x = [f"{m.mode}<br>({m.config or 'not measured'})" for m in modes]
    fig.add_trace(go.Scatter(
        x=x, y=[m.predicted_p50_ms for m in modes], mode="markers", name="predicted p50",
        marker=dict(symbol="circle-open", size=14, color="#444"),
        error_y=dict(type="data", array=[tol * m.predicted_p50_ms for m in modes],
                     color="#aaa", thickness=6, width=0),
        hovertemplate="predicted %{y:.1f} ms<extra></extra>"))
    got = [m for m in modes if m.measured_p50_ms is not None]
    fig.add_trace(go.Scatter(
        x=[f"{m.mode}<br>({m.config or 'not measured'})" for m in got],
        y=[m.measured_p50_ms for m in got], mode="markers", name="measured p50 [95%]",
        marker=dict(symbol="diamond", size=11,
                    color=["#2ca02c" if m.held else "#d62728" for m in got]),
        error_y=dict(type="data", symmetric=False,
                     array=[(m.measured_p50_ci_ms or (0, 0))[1] - m.measured_p50_ms for m in got],
                     arrayminus=[m.measured_p50_ms - (m.measured_p50_ci_ms or (0, 0))[0]
                                 for m in got]),
        hovertemplate="measured %{y:.1f} ms<extra></extra>"))
    fig.update_layout(title=f"TTFT p50 per mode: kvtune's prediction (grey band: ±{tol:.0%}) "
                            f"against the measurement", yaxis_title="TTFT p50 (ms)",
                      height=420, template="plotly_white")
    return fig
