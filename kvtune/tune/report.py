"""One self-contained HTML report: every figure the notebooks drew, plotly.js embedded (offline)."""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

SECTION_TITLES = {
    "fabric_floor": "Fabric floor: transfer time vs bytes",
    "recompute_threshold": "kv_recompute_threshold: recompute vs pull",
    "block_ttl": "decoder_kv_blocks_ttl: reuse captured vs memory held",
    "mode_choice": "Mode: push vs pull vs bidirectional",
    "stalls": "Stalls: where the slow requests' time went",
    "tune": "Tuning summary",
}


def write_report(path: Path, figures_dir: Path, *, title: str, source: str,
                 values: dict[str, Any], notebooks: list[str]) -> Path:
    """Write the report to ``path`` and return it. Figures are read in notebook order."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    parts = [f"<h1>{html.escape(title)}</h1>",
             f"<p><b>Trace source:</b> {html.escape(source)}</p>",
             _values_table(values)]
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
           "<style>body{font-family:sans-serif;margin:2em;max-width:1200px}"
           "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}"
           ".figure{margin:1em 0}</style></head><body>"
           + "\n".join(parts) + "</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc)
    return path


def _values_table(values: dict[str, Any]) -> str:
    if not values:
        return ""
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_fmt(v))}</td></tr>"
        for k, v in values.items())
    return f"<table>{rows}</table>"


def _fmt(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:400]
    return str(v)
