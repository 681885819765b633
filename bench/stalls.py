"""Stalls of the local vLLM pair, side by side: kvtune's connectors and vLLM's own, per mode.

For each layout, mode (pull, push, bidirectional) and connector (``kvtune``: the instrumented
connectors; ``vllm``: vLLM's own connectors with only the layout's NIXL/idle settings, see
``kvtune.connectors.plain``), start the pair, measure the servers' idle CPU (cores used while no
request is in flight, after warm-up), send the same N requests (sequential, prompt lengths
cycling, two turns per conversation in bidirectional mode) while ``--hogs`` CPU-bound processes
run beside the pair, and record each request's wall time. kvtune's spans (kvtune connector runs)
say where stalled time went. Every leg over 20 s gets every server thread's stack dumped
(``kvtune.local.watchdog``; files under ``stacks/`` in each run's pair workdir).

Prints one table (requests over 1 s, p50/p99/max, idle cores, and per mode the ratio of kvtune's
p50 to vLLM's p50: the proof that instrumentation is not what stalls), with the load average
before each run; writes ``summary.json``, ``stalls.html`` and the spans into --out.

    .venv/bin/python bench/stalls.py --out out/stalls --requests 30 --hogs 0
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvtune.analysis import transfers
from kvtune.analysis.stalls import STALL_MS, stall_diagnosis
from kvtune.local.layout import LAYOUTS, PINNED
from kvtune.local.pair import LocalPair
from kvtune.local.watchdog import session_pids
from kvtune.traces import load

BENCH_LAYOUTS = {
    **LAYOUTS,
    # vLLM's and NIXL's CPU defaults with one change, the model in the engine's process: the
    # smallest difference from what a user gets, for a report to vLLM.
    "vllm-defaults-one-process": dataclasses.replace(
        PINNED, name="vllm-defaults-one-process", pull_progress_delay_us=None,
        one_process_engine=True),
    "vllm-defaults": dataclasses.replace(PINNED, name="vllm-defaults", pull_progress_delay_us=None),
}
PROMPT_LENGTHS = (64, 256, 512, 1024)
MAX_TOKENS = 4
IDLE_SETTLE_S = 3.0
IDLE_WINDOW_S = 5.0


def prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(50, 1950, n)]


def server_cpu_s(pair: LocalPair) -> float:
    """CPU seconds used so far by both servers' processes (API server, engine, worker): each server
    leads its own session (``kvtune.local.watchdog.session_pids``)."""
    leaders = [s.proc.pid for s in (pair.prefill, pair.decode) if s is not None and s.proc]
    ticks = 0
    for pid in session_pids(lambda: leaders):
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(st[11]) + int(st[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def idle_cores(pair: LocalPair) -> float:
    time.sleep(IDLE_SETTLE_S)
    c0 = server_cpu_s(pair)
    time.sleep(IDLE_WINDOW_S)
    return (server_cpu_s(pair) - c0) / IDLE_WINDOW_S


def load_average() -> float:
    return os.getloadavg()[0]


def wait_for_quiet(max_load: float = 1.5, timeout_s: float = 180.0) -> float:
    """Wait until the 1-minute load average falls under ``max_load`` (the previous pair's
    processes still weigh in it for a while) or ``timeout_s`` passes; returns the load."""
    deadline = time.monotonic() + timeout_s
    while load_average() >= max_load and time.monotonic() < deadline:
        time.sleep(5)
    return load_average()


def run_one(layout: str, mode: str, connector: str, n: int, out: Path, hogs: int) -> dict:
    name = f"{layout}-{mode}-{connector}"
    spans_dir = out / name / "spans"
    latencies: list[float] = []
    errors: list[str] = []
    t_start = time.monotonic()
    load_before = wait_for_quiet()
    with LocalPair(mode, connector=connector, layout=BENCH_LAYOUTS[layout],
                   workdir=out / name / "work",
                   spans_dir=spans_dir if connector == "kvtune" else None,
                   extra_env={"OTEL_BSP_SCHEDULE_DELAY": "200"},
                   recompute_threshold=1 if mode == "bidirectional" else None) as pair:
        start_s = time.monotonic() - t_start
        idle = idle_cores(pair)
        print(f"  {name}: pair up in {start_s:.0f} s, servers' idle CPU {idle:.2f} cores",
              file=sys.stderr)
        hog_procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                     for _ in range(hogs)]
        try:
            for i in range(n):
                toks = prompt(PROMPT_LENGTHS[(i // 2) % len(PROMPT_LENGTHS)], seed=i // 2)
                conv = f"c{i // 2}" if mode == "bidirectional" else None
                if conv is not None and i % 2 == 1:
                    toks = toks + prompt(16, seed=10_000 + i)  # turn 2: history + a new message
                t0 = time.monotonic()
                try:
                    pair.complete(toks, MAX_TOKENS, conversation=conv)
                    latencies.append((time.monotonic() - t0) * 1e3)
                except Exception as exc:  # recorded and reported
                    errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
                print(f"  {name} {i + 1}/{n}: "
                      f"{latencies[-1] if latencies else float('nan'):.0f} ms", file=sys.stderr)
        finally:
            for h in hog_procs:
                h.kill()
                h.wait()
        idle_after = idle_cores(pair)
        dumps = [str(f) for d in (pair._watchdog.dumps if pair._watchdog else ())
                 for f in d.files]
    lat = np.asarray(latencies)
    result = {"layout": layout, "mode": mode, "connector": connector, "n": n, "ok": len(lat),
              "hogs": hogs, "load_before": load_before, "pair_start_s": start_s,
              "idle_cores": idle, "idle_cores_after": idle_after, "errors": errors,
              "over_1s": int((lat > STALL_MS).sum()),
              "p50_ms": float(np.median(lat)) if len(lat) else None,
              "p99_ms": float(np.quantile(lat, 0.99)) if len(lat) else None,
              "max_ms": float(lat.max()) if len(lat) else None,
              "latencies_ms": lat.tolist(), "stack_dumps": dumps,
              "wall_s": time.monotonic() - t_start}
    if connector == "kvtune":
        time.sleep(1)
        spans = load(spans_dir)
        diag = stall_diagnosis(transfers(spans), spans)
        result.update(stall_phase=diag.dominant_phase, stall_summary=diag.summary,
                      spans_dir=str(spans_dir))
    return result


def _fmt(x: float | None) -> str:
    return f"{x:.0f}" if x is not None else "-"


def table(results: list[dict]) -> str:
    rows = ["| layout | mode | connector | CPU hogs | requests | over 1 s | p50 ms | p99 ms | "
            "max ms | idle cores (before/after) | load before | kvtune p50 / vLLM p50 |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    p50 = {(r["layout"], r["mode"], r["connector"], r.get("hogs", 0)): r["p50_ms"]
           for r in results}
    for r in results:
        hogs = r.get("hogs", 0)
        k, v = ((r["layout"], r["mode"], c, hogs) for c in ("kvtune", "vllm"))
        ratio = (f"{p50[k] / p50[v]:.2f}" if r["connector"] == "kvtune" and p50.get(k)
                 and p50.get(v) else "")
        rows.append(f"| {r['layout']} | {r['mode']} | {r['connector']} | {hogs} | "
                    f"{r['ok']}/{r['n']} | {r['over_1s']} | {_fmt(r['p50_ms'])} | "
                    f"{_fmt(r['p99_ms'])} | {_fmt(r['max_ms'])} | "
                    f"{r['idle_cores']:.2f} / {r['idle_cores_after']:.2f} | "
                    f"{r['load_before']:.2f} | {ratio} |")
    return "\n".join(rows)


def figure(results: list[dict]):
    import plotly.graph_objects as go

    fig = go.Figure()
    for r in results:
        hogs = f"<br>{r['hogs']} hog(s)" if r.get("hogs") else ""
        fig.add_trace(go.Box(y=r["latencies_ms"], name=f"{r['mode']}<br>{r['connector']}"
                             f"<br>{r['layout']}{hogs}", boxpoints="all"))
    fig.update_layout(title="Request time per mode and connector (ms, log scale)",
                      yaxis_type="log", yaxis_title="ms", showlegend=False)
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/stalls")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--modes", default="pull,push,bidirectional")
    ap.add_argument("--connectors", default="kvtune,vllm")
    ap.add_argument("--layouts", default="quiet",
                    help=f"comma list of {sorted(BENCH_LAYOUTS)}")
    ap.add_argument("--hogs", type=int, default=0,
                    help="CPU-bound processes running while requests are sent (default 0)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for layout in args.layouts.split(","):
        for mode in args.modes.split(","):
            for connector in args.connectors.split(","):
                print(f"{layout} / {mode} / {connector}: starting (load average "
                      f"{load_average():.2f})", file=sys.stderr)
                results.append(run_one(layout, mode, connector, args.requests, out, args.hogs))
                (out / "summary.json").write_text(json.dumps(results, indent=2))
    print(table(results), flush=True)
    (out / "table.md").write_text(table(results) + "\n")
    figure(results).write_html(out / "stalls.html", include_plotlyjs="cdn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
