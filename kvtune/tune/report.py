"""One self-contained HTML report: every figure the notebooks drew, plotly.js embedded (offline)."""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any

SECTION_TITLES = {
    "fabric_floor": "Fabric floor: transfer time vs bytes",
    "recompute_threshold": "kv_recompute_threshold: recompute vs pull",
    "block_ttl": "decoder_kv_blocks_ttl: reuse captured vs memory held",
    "mode_choice": "Mode: push vs pull vs bidirectional",
    "stalls": "Stalls: where the slow requests' time went",
    "tune": "Tuning summary",
    "verify": "Verification: measured TTFT per configuration (kvtune verify)",
}


def write_report(path: Path, figures_dir: Path, *, title: str, source: str,
                 values: dict[str, Any], notebooks: list[str],
                 recommendation: dict[str, Any] | None = None,
                 configs_dir: Path | None = None) -> Path:
    """Write the report to ``path`` and return it.

    The top (``kvtune.tune.headline``) comes from ``recommendation`` (``recommendation.json``):
    the three values, how sure, how to apply, the findings; then the figures, in notebook order.
    Without a recommendation (the tune notebook did not run) the published values stand in."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    from kvtune.tune import headline
    from kvtune.tune.findings import FINDINGS_CSS, findings_html

    parts = [f"<h1>{html.escape(title)}</h1>",
             f'<p class="source"><b>Trace source:</b> {html.escape(source)}</p>']
    if recommendation is not None:
        rel = headline.configs_relative(path, configs_dir or path.parent / "configs")
        top = headline.build(recommendation, configs_rel=rel)
        parts.append(headline.render(top))
        parts.append(f'<section id="findings"><h2>Findings ({len(top.findings)})</h2>'
                     f'{findings_html(top.findings)}</section>')
        parts.append(sim_inputs_html(recommendation))
    else:
        parts.append('<p class="no-rec"><b>No recommendation</b>: the tune notebook did not run, '
                     'so there are no values to apply. Values the notebooks published:</p>')
        parts.append(_values_table(values))
    n_figs = 0
    for name in notebooks:
        figs = (sorted(figures_dir.glob(f"{name}--*.json"), key=lambda p: p.stat().st_mtime_ns)
                if figures_dir.exists() else [])
        if not figs:
            continue
        parts.append(f"<h2>{html.escape(SECTION_TITLES.get(name, name))}</h2>")
        for fig_path in figs:
            fig = pio.from_json(fig_path.read_text())
            parts.append('<div class="figure">' + pio.to_html(
                fig, include_plotlyjs=False, full_html=False,
                div_id=f"fig-{n_figs}", config={"displaylogo": False}) + "</div>")
            n_figs += 1
    doc = ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
           f"<title>{html.escape(title)}</title>"
           f"<script type='text/javascript'>{get_plotlyjs()}</script>"
           "<style>body{font-family:sans-serif;margin:1em 2em;max-width:1300px}"
           "h1{margin:.2em 0;font-size:1.5em}h2{font-size:1.2em;margin:.8em 0 .3em}"
           "p.source{margin:.2em 0;color:#444;overflow-wrap:anywhere}"
           "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;"
           "text-align:left}.figure{margin:1em 0}"
           + headline.HEADLINE_CSS + FINDINGS_CSS + "</style></head><body>"
           + "\n".join(parts) + "</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc)
    return path


def sim_inputs_html(recommendation: dict[str, Any]) -> str:
    """The numbers the simulator played for the mode comparison, each with its source
    (``recommendations.mode.evidence.sim_inputs``); preset values first. "" when it did not run."""
    from kvtune.tune.findings import value_text

    ev = ((recommendation.get("recommendations") or {}).get("mode") or {}).get("evidence") or {}
    inputs = [i for i in ev.get("sim_inputs") or () if isinstance(i, dict)]
    if not inputs:
        return ""
    inputs.sort(key=lambda i: (not str(i.get("source", "")).startswith("preset"),))
    n_preset = sum(1 for i in inputs if str(i.get("source", "")).startswith("preset"))
    rows = "".join(
        f"<tr><td><code>{html.escape(str(i.get('name')))}</code></td>"
        f"<td>{html.escape(value_text(i.get('value')))}</td>"
        f"<td>{html.escape(str(i.get('source')))}</td></tr>" for i in inputs)
    return (f'<section id="sim-inputs"><h2>Simulator inputs ({n_preset} of {len(inputs)} from '
            f'the preset)</h2><details><summary>What the mode comparison played, and where each '
            f'number came from</summary><table class="sim-inputs"><tr><th>input</th><th>value</th>'
            f'<th>source</th></tr>{rows}</table></details></section>')


def _values_table(values: dict[str, Any]) -> str:
    from kvtune.tune.findings import value_text

    if not values:
        return ""
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(value_text(v))}</td></tr>"
        for k, v in values.items())
    return f'<table class="values">{rows}</table>'
