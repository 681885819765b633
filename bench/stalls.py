"""Stall experiment on the local vLLM pair: N requests per mode, with and without a setting.

For each mode (pull, push, bidirectional) and each setting, start the pair with kvtune's connectors,
measure the servers' idle CPU (cores busy while no request is in flight), then send N requests
(sequential, prompt lengths cycling) while ``--hogs`` CPU-bound processes stand for the rest of the
host's work (router, client, notebooks during ``tune``; other tests in CI), record each request's
wall time, and write the connectors' spans. kvtune's own analysis (`kvtune.analysis.stalls`) says
which phase holds the stalled time. Prints share of requests over 1 s, p50/p99 per (mode, setting),
and writes `summary.json` + `stalls.html` (before/after figures) into --out.

A setting is NAME=JSON: ``kv_connector_extra_config`` additions for both servers, or
``{"prefill": {...}, "decode": {...}}`` for one side each.

    .venv/bin/python bench/stalls.py --out out/stalls --requests 30 --hogs 1 \
        --setting 'default={"kvtune_progress_delay_us": null}' \
        --setting 'sleeping-progress={"kvtune_progress_delay_us": 1000}'
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

from kvtune.analysis import transfers
from kvtune.analysis.stalls import STALL_MS, stall_diagnosis
from kvtune.local.pair import LocalPair
from kvtune.traces import load

PROMPT_LENGTHS = (64, 256, 512, 1024)
MAX_TOKENS = 4


def prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(50, 1950, n)]


def server_cpu_s(pair: LocalPair) -> float:
    """CPU seconds used so far by both servers' processes (API server, engine, worker): each server
    leads its own session, so its processes are those whose session id is its pid."""
    sessions = {s.proc.pid for s in (pair.prefill, pair.decode) if s is not None and s.proc}
    ticks = 0
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            st = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(st[3]) in sessions:
            ticks += int(st[11]) + int(st[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def split_roles(extra: dict) -> tuple[dict, dict]:
    if set(extra) <= {"prefill", "decode"} and extra:
        return {}, extra
    return extra, {}


def run_one(mode: str, name: str, extra: dict, n: int, out: Path, hogs: int) -> dict:
    spans_dir = out / f"{mode}-{name}" / "spans"
    latencies, errors = [], []
    t_start = time.monotonic()
    both, per_role = split_roles(extra)
    with LocalPair(mode, connector="kvtune", workdir=out / f"{mode}-{name}" / "work",
                   spans_dir=spans_dir, kv_extra_config=both, role_kv_extra_config=per_role,
                   extra_env={"OTEL_BSP_SCHEDULE_DELAY": "200"},
                   recompute_threshold=1 if mode == "bidirectional" else None) as pair:
        time.sleep(3)
        c0 = server_cpu_s(pair)
        time.sleep(5)
        idle_cores = (server_cpu_s(pair) - c0) / 5
        print(f"  {mode}/{name}: servers' idle CPU {idle_cores:.2f} cores", file=sys.stderr)
        hog_procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                     for _ in range(hogs)]
        try:
            lat_loop(pair, mode, name, n, latencies, errors)
        finally:
            for h in hog_procs:
                h.kill()
                h.wait()
    time.sleep(2)  # let the servers' batch processors flush (they flush on shutdown too)
    spans = load(spans_dir)
    tx = transfers(spans)
    lat = np.asarray(latencies)
    diag = stall_diagnosis(tx, spans)
    return {"mode": mode, "setting": name, "extra": extra, "n": n, "ok": len(lat), "hogs": hogs,
            "idle_cores": idle_cores,
            "errors": errors, "over_1s_share": float((lat > STALL_MS).mean()) if len(lat) else None,
            "p50_ms": float(np.median(lat)) if len(lat) else None,
            "p99_ms": float(np.quantile(lat, 0.99)) if len(lat) else None,
            "max_ms": float(lat.max()) if len(lat) else None,
            "latencies_ms": lat.tolist(), "stall_phase": diag.dominant_phase,
            "stall_summary": diag.summary, "phase_excess_ms": diag.phase_excess_ms,
            "wall_s": time.monotonic() - t_start, "spans_dir": str(spans_dir)}


def lat_loop(pair: LocalPair, mode: str, name: str, n: int, latencies: list, errors: list) -> None:
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
    ap.add_argument("--hogs", type=int, default=1,
                    help="CPU-bound processes running while requests are sent (default 1)")
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
            r = run_one(mode, name, json.loads(extra), args.requests, out, args.hogs)
            results.append(r)
            print(f"{mode:14s} {name:18s} idle {r['idle_cores']:.2f} cores  "
                  f"over 1 s {r['over_1s_share']:.0%}  p50 {r['p50_ms']:.0f} ms"
                  f"  p99 {r['p99_ms']:.0f} ms  errors {len(r['errors'])}  stall phase "
                  f"{r['stall_phase']}", flush=True)
            (out / "summary.json").write_text(json.dumps(results, indent=2))
    figure(results).write_html(out / "stalls.html", include_plotlyjs=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
