"""The offline HTML page of a verification: verdicts, a table per configuration, the figures
(plotly.js embedded, as in the tune report)."""
from __future__ import annotations

import html
from pathlib import Path

from kvtune.verify import figures
from kvtune.verify.results import TTFT_BASIS_DECODE, TTFT_BASIS_ROUTER, VerifyResult


def _fmt(v: float | None, unit: str = "", digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}{unit}"


def table_rows(result: VerifyResult) -> list[list[str]]:
    """The per-configuration table (also what the CLI prints)."""
    rows = [["config", "mode", "threshold", "TTL s", "ok/failed", "TTFT p50 ms [95%]",
             "TTFT p99 ms [95%]", "history pulled back", "decode KV mean/max %"]]
    for c in result.configs:
        p50, p99 = c.ttft_p50, c.ttft_p99
        n_ok = sum(r.ok for r in c.requests)
        rows.append([
            c.config.name, c.config.mode,
            "default" if c.config.recompute_threshold_tokens is None
            else str(c.config.recompute_threshold_tokens),
            "default" if c.config.ttl_s is None else f"{c.config.ttl_s:g}",
            f"{n_ok}/{c.n_failed}",
            "n/a" if p50 is None else f"{p50.value_ms:.1f} [{p50.low_ms:.1f}, {p50.high_ms:.1f}]",
            "n/a" if p99 is None else f"{p99.value_ms:.1f} [{p99.low_ms:.1f}, {p99.high_ms:.1f}]",
            "n/a" if c.reuse_captured_share is None else f"{c.reuse_captured_share:.0%}",
            f"{_fmt(c.decode_kv_usage_mean_pct)}/{_fmt(c.decode_kv_usage_max_pct)}"])
    return rows


def ttft_basis_note(result: VerifyResult) -> str:
    """What the table's TTFT measures (per configuration when they differ)."""
    bases = {c.ttft_basis for c in result.configs}
    words = {TTFT_BASIS_DECODE: "the router received the request -> the decode scheduled its "
                                "first decode step (its KV in place), from the router's and the "
                                "engines' spans",
             TTFT_BASIS_ROUTER: "the router's TTFT (for a non-streamed request: the prefill's "
                                "answer, before any KV reached the decode)"}
    if len(bases) == 1:
        return f"TTFT: {words.get(next(iter(bases)), next(iter(bases)))}."
    return "TTFT: " + "; ".join(f"{c.config.name}: {words.get(c.ttft_basis, c.ttft_basis)}"
                                for c in result.configs) + "."


def crossover_text(result: VerifyResult) -> str:
    """The measured crossover, its place against the recommended range, and what was left out."""
    from kvtune.verify.crossover import statement

    cx = result.crossover
    if cx is None:
        return ""
    inside = {True: "inside", False: "outside", None: "not comparable with"}[cx.inside_range]
    rng = ("none" if cx.recommended_range_tokens is None else
           f"[{cx.recommended_range_tokens[0]:g}, {cx.recommended_range_tokens[1]:g}] tokens")
    out = (f"Measured crossover: {statement(cx.estimate)}; {inside} the recommended range {rng} "
           f"(swept {', '.join(str(n) for n in cx.estimate.lengths_tokens)} tokens: one block "
           f"to the workload's longest history).")
    if cx.deployment:
        out += f" The sweep ran {cx.deployment}."
    if cx.local_hits:
        out += (f" {cx.local_hits} reuse-off turns left out: the prefill's own cache held a "
                f"block or more of their history.")
    if cx.not_offered:
        out += (f" {cx.not_offered} reuse-on turns left out: the router offered no history "
                f"(expired before the turn came).")
    if cx.unresolved_tokens:
        out += (f" Not resolved at the repeats allowed: "
                f"{', '.join(str(n) for n in cx.unresolved_tokens)} tokens.")
    return out


def render(result: VerifyResult) -> str:
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    e = html.escape
    rows = table_rows(result)
    table = ("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in rows[0]) + "</tr>"
             + "".join("<tr>" + "".join(f"<td>{e(v)}</td>" for v in r) + "</tr>"
                       for r in rows[1:]) + "</table>")
    verdicts = "".join(f'<p class="verdict">{e(c.verdict)}</p>' for c in result.comparisons)
    table += f'<p class="meta" id="ttft-basis">{e(ttft_basis_note(result))}</p>'
    parts = [f"<h1>kvtune verify</h1><p class='meta'>Target: {e(result.target)}. Workload: "
             f"{e(result.workload)}. {e(result.created_utc)}, kvtune {e(result.kvtune_version)}."
             "</p>", f'<section id="verdicts">{verdicts}</section>', table]
    figs = [("comparison", figures.comparison(result))]
    if result.crossover is not None:
        parts.append(f'<p id="crossover-text">{e(crossover_text(result))}</p>')
        figs.append(("crossover", figures.crossover(result.crossover)))
    if result.predictions is not None:
        items = "".join(f"<li>{e(line)}</li>" for line in result.predictions.lines())
        parts.append(f'<section id="predictions"><h2>Predictions against measurements</h2>'
                     f'<ul>{items}</ul></section>')
        if result.predictions.modes:
            figs.append(("predictions", figures.predictions(result.predictions)))
    for name, fig in figs:
        parts.append(f'<div class="figure" id="fig-{name}">' + pio.to_html(
            fig, include_plotlyjs=False, full_html=False, div_id=f"plot-{name}",
            config={"displaylogo": False}) + "</div>")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvtune verify</title>"
            f"<script type='text/javascript'>{get_plotlyjs()}</script>"
            "<style>body{font-family:sans-serif;margin:1em 2em;max-width:1300px}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}"
            ".verdict{font-weight:bold}.meta{color:#444}</style></head><body>"
            + "\n".join(parts) + "</body></html>")


def write(result: VerifyResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(result))
    return path
