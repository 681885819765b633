"""Run-to-run spread of `kvtune tune`'s embedded default on this machine: N runs, one after another.

Each run makes its own spans (probe + the local vLLM pair through the router), so the spread is
the whole chain's: pair, workload, fits, bootstraps. Prints per run the three recommended values
with their ranges, the findings, the serving requests over 1 s (kvtune's stall diagnosis) and the
serving transfers' size span (largest / smallest bytes: the floor fit needs >= 16x); with
``--verify`` (what `make tune` runs) also the verification's verdict at p50 with its interval and
smallest detectable effect, the measured crossover against the recommended range, and how long
the tuning and the verification took; then whether the threshold ranges overlap, whether the
mode is the same, and the spread of each value. The load average before each run is printed with
it (one heavy job at a time).

    .venv/bin/python bench/tune_spread.py --runs 3 --out out/tune-spread --verify [--lab fleet]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def run_once(out: Path, fabric: str, *, verify: bool = False, lab: str | None = None) -> dict:
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "kvtune.cli", "tune", "--out", str(out), "--fabric", fabric]
    cmd += ["--verify"] if verify else []
    cmd += ["--lab", lab] if lab else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        return {"out": str(out), "error": proc.stderr[-2000:], "load_before": load,
                "elapsed_s": elapsed}
    rec = json.loads((out / "configs" / "recommendation.json").read_text())
    recs = rec.get("recommendations", rec)
    row = {"out": str(out), "load_before": load, "elapsed_s": elapsed,
           "findings": sorted(f["code"] for f in rec.get("findings", []))}
    for key in ("kv_recompute_threshold", "decoder_kv_blocks_ttl", "mode"):
        item = recs[key]
        row[key] = {"value": item["value"], "range": item.get("range")}
    row.update(serving_stats(out / "spans"))
    if verify:
        row.update(verification(out, proc.stdout))
    return row


def verification(out: Path, stdout: str) -> dict:
    """The run's verification: headline verdict, interval, detectable effect, crossover; and
    how long the tuning took (``kvtune tune: done in N s``) beside the whole run."""
    import re

    from kvtune.verify import crossover as X
    from kvtune.verify import results, verdict

    res = results.read(out / "verify" / results.RESULT_FILE)
    comp = verdict.headline_comparison(res)
    ch = comp.p50 if comp is not None else None
    m = re.search(r"kvtune tune: done in (\d+) s", stdout)
    row: dict = {"tune_s": float(m.group(1)) if m else None,
                 "verdict": comp.verdict if comp is not None else None,
                 "faster_pct": ch.faster_pct if ch else None,
                 "interval_pct": [ch.low_pct, ch.high_pct] if ch else None,
                 "detectable_pct": ch.detectable_pct if ch else None,
                 "ranking_held": res.predictions.ranking_held if res.predictions else None,
                 "predictions": [[p.mode, p.predicted_p50_ms, p.measured_p50_ms, p.error_share]
                                 for p in (res.predictions.modes if res.predictions else ())
                                 if p.measured_p50_ms is not None]}
    cx = res.crossover
    if cx is not None:
        row["crossover"] = X.statement(cx.estimate)
        row["crossover_inside"] = cx.inside_range
        row["recommended_range"] = cx.recommended_range_tokens
    return row


def serving_stats(spans_dir: Path) -> dict:
    """Requests over 1 s and the serving transfers' size span, from the run's own spans."""
    from kvtune.analysis import transfers
    from kvtune.analysis.stalls import stall_diagnosis
    from kvtune.traces import load

    spans = load(spans_dir)
    tr = transfers(spans)
    serving = tr[(tr["mode"].astype("object") != "probe").to_numpy(dtype=bool)]
    diag = stall_diagnosis(serving, spans)
    b = serving["bytes"].dropna().astype(float)
    return {"requests": diag.n_requests, "requests_over_1s": diag.n_stalled,
            "request_p50_ms": diag.p50_ms, "request_p99_ms": diag.p99_ms,
            "serving_transfers": int(len(serving)),
            "transfer_size_span": float(b.max() / b.min()) if len(b) and b.min() > 0 else None}


def summarize(rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r]
    lines = ["| run | load before | s | threshold (range) | TTL s (range) | mode (range) | "
             "requests over 1 s | p99 ms | transfer size span | findings |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        if "error" in r:
            lines.append(f"| {i} | {r['load_before']:.2f} | {r['elapsed_s']:.0f} | FAILED | | | | | | |")
            continue
        th, ttl, mode = r["kv_recompute_threshold"], r["decoder_kv_blocks_ttl"], r["mode"]
        span = f"{r['transfer_size_span']:.1f}x" if r["transfer_size_span"] else "-"
        lines.append(
            f"| {i} | {r['load_before']:.2f} | {r['elapsed_s']:.0f} | {th['value']} {th['range']} | "
            f"{ttl['value']} {ttl['range']} | {mode['value']} {mode['range']} | "
            f"{r['requests_over_1s']}/{r['requests']} | {r['request_p99_ms']:.0f} | "
            f"{span} | {', '.join(r['findings'])} |")
    if any("verdict" in r for r in ok):
        lines += ["", "| run | tune s | verify s | recommended vs baseline at p50 [95%] | "
                      "detectable | ranking | crossover | inside the recommended range |",
                  "|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(rows, 1):
            if "verdict" not in r:
                continue
            iv = r["interval_pct"] or [float("nan")] * 2
            ver = r["elapsed_s"] - (r["tune_s"] or 0)
            lines.append(
                f"| {i} | {r['tune_s']:.0f} | {ver:.0f} | {r['faster_pct']:+.1f}% faster "
                f"[{iv[0]:.1f}, {iv[1]:.1f}] | {r['detectable_pct']:.1f}% | "
                f"{r['ranking_held']} | {r.get('crossover')} | {r.get('crossover_inside')} "
                f"{r.get('recommended_range')} |")
    if len(ok) >= 2:
        def tokens(v: object) -> float:  # 'never': no history is worth pulling back
            return float("inf") if v == "never" else float(v)  # type: ignore[arg-type]
        lows = [tokens(r["kv_recompute_threshold"]["range"][0]) for r in ok]
        highs = [tokens(r["kv_recompute_threshold"]["range"][1]) for r in ok]
        overlap = max(lows) <= min(highs)
        modes = {r["mode"]["value"] for r in ok}
        th = np.array([tokens(r["kv_recompute_threshold"]["value"]) for r in ok], dtype=float)
        ttl = np.array([r["decoder_kv_blocks_ttl"]["value"] for r in ok], dtype=float)
        lines += ["",
                  f"threshold ranges overlap: {overlap} (common part [{max(lows)}, {min(highs)}])",
                  f"mode the same in every run: {len(modes) == 1} ({sorted(modes)})",
                  f"threshold spread: {th.min():g}-{th.max():g} tokens (max/min "
                  f"{th.max() / max(th.min(), 1e-9):.2f}); TTL spread: {ttl.min():g}-{ttl.max():g} s",
                  f"fit_from_probe in any run: {any('fit_from_probe' in r['findings'] for r in ok)}",
                  f"fit_low_r2 in: {sum('fit_low_r2' in r['findings'] for r in ok)} of {len(ok)} runs"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="out/tune-spread")
    ap.add_argument("--fabric", default="auto", help="as `make tune` (default: auto)")
    ap.add_argument("--verify", action="store_true", help="as `make tune`: verify each run")
    ap.add_argument("--lab", default=None, help="the lab regime (default: kvtune tune's, fleet)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(args.runs):
        print(f"run {i + 1}/{args.runs} (load average {os.getloadavg()[0]:.2f})", file=sys.stderr)
        rows.append(run_once(out / f"run-{i + 1}", args.fabric, verify=args.verify,
                             lab=args.lab))
        (out / "summary.json").write_text(json.dumps(rows, indent=2))
    text = summarize(rows)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
