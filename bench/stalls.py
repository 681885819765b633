"""Stall experiment on the local vLLM pair: N requests per mode, with and without a setting.

For each mode (pull, push, bidirectional) and each setting, start the pair with kvtune's connectors,
send N requests (sequential, prompt lengths cycling), record each request's wall time, and write the
connectors' spans. Then kvtune's own analysis (`kvtune.analysis.stalls`) says which phase holds the
stalled time. Prints share of requests over 1 s, p50/p99 per (mode, setting), and writes
`summary.json` + `stalls.html` (before/after figures) into --out.

    .venv/bin/python bench/stalls.py --out out/stalls --requests 30 \
        --setting 'default={}' --setting 'num_threads=1={"num_threads": 1}'
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from kvtune.analysis import transfers
from kvtune.analysis.stalls import STALL_MS, stall_diagnosis
from kvtune.local.pair import LocalPair
from kvtune.traces import load

PROMPT_LENGTHS = (64, 256, 512, 1024)
MAX_TOKENS = 4


def prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(50, 1950, n)]


def run_one(mode: str, name: str, extra: dict, n: int, out: Path) -> dict:
    spans_dir = out / f"{mode}-{name}" / "spans"
    latencies, errors = [], []
    t_start = time.monotonic()
    with LocalPair(mode, connector="kvtune", workdir=out / f"{mode}-{name}" / "work",
                   spans_dir=spans_dir, kv_extra_config=extra,
                   recompute_threshold=1 if mode == "bidirectional" else None) as pair:
        for i in range(n):
            toks = prompt(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)], seed=i)
            t0 = time.monotonic()
            try:
                conv = f"c{i // 2}" if mode == "bidirectional" else None
                pair.complete(toks, MAX_TOKENS, conversation=conv)
                latencies.append((time.monotonic() - t0) * 1e3)
            except Exception as exc:  # noqa: BLE001 - recorded and reported
                errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            print(f"  {mode}/{name} {i + 1}/{n}: {latencies[-1] if latencies else float('nan'):.0f} ms",
                  file=sys.stderr)
    time.sleep(2)  # let the servers' batch processors flush (they flush on shutdown too)
    spans = load(spans_dir)
    tx = transfers(spans)
    lat = np.asarray(latencies)
    diag = stall_diagnosis(tx, spans)
    return {"mode": mode, "setting": name, "extra": extra, "n": n, "ok": len(lat),
            "errors": errors, "over_1s_share": float((lat > STALL_MS).mean()) if len(lat) else None,
            "p50_ms": float(np.median(lat)) if len(lat) else None,
            "p99_ms": float(np.quantile(lat, 0.99)) if len(lat) else None,
            "latencies_ms": lat.tolist(), "stall_phase": diag.dominant_phase,
            "stall_summary": diag.summary, "phase_excess_ms": diag.phase_excess_ms,
            "wall_s": time.monotonic() - t_start, "spans_dir": str(spans_dir)}


def figure(results: list[dict]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("share of requests over 1 s",
                                                        "request time p50 / p99 (ms)"))
    for r in results:
        label = f"{r['mode']}<br>{r['setting']}"
        fig.add_trace(go.Bar(x=[label], y=[r["over_1s_share"]], name=label, showlegend=False),
                      row=1, col=1)
        fig.add_trace(go.Bar(x=[label], y=[r["p50_ms"]], marker_color="#1f77b4", showlegend=False),
                      row=1, col=2)
        fig.add_trace(go.Bar(x=[label], y=[r["p99_ms"]], marker_color="#ff7f0e", showlegend=False),
                      row=1, col=2)
    fig.update_layout(barmode="group", title="Stalls before/after, per mode")
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/stalls")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--modes", default="pull,push,bidirectional")
    ap.add_argument("--setting", action="append", default=[],
                    help="NAME=JSON kv_connector_extra_config additions (repeatable)")
    args = ap.parse_args()
    settings = [s.split("=", 1) for s in (args.setting or ["default={}"])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for mode in args.modes.split(","):
        for name, extra in settings:
            print(f"{mode} / {name}: starting", file=sys.stderr)
            r = run_one(mode, name, json.loads(extra), args.requests, out)
            results.append(r)
            print(f"{mode:14s} {name:16s} over 1 s {r['over_1s_share']:.0%}  p50 {r['p50_ms']:.0f} ms"
                  f"  p99 {r['p99_ms']:.0f} ms  errors {len(r['errors'])}  stall phase "
                  f"{r['stall_phase']}", flush=True)
            (out / "summary.json").write_text(json.dumps(results, indent=2))
    figure(results).write_html(out / "stalls.html", include_plotlyjs=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
