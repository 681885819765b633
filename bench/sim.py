"""Simulator speed and calibration, measured in one run.

Prints: simulated requests per wall-clock second for 1 hour of 8 QPS multi-turn traffic (per mode,
and with spans written), the wall time of ``expected_ttft`` for three modes, and the public preset's
TTFTs next to the published ones. Run: ``.venv/bin/python bench/sim.py [--minutes 60]``.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvtune.sim import Dist, WorkloadSpec, simulate
from kvtune.sim import presets as P
from kvtune.sim.estimate import expected_ttft


def multi_turn_hour(minutes: float) -> WorkloadSpec:
    return WorkloadSpec(qps=8.0, duration_s=minutes * 60.0, prompt_tokens=Dist("lognormal", (2000, 0.6)),
                        output_tokens=Dist("lognormal", (200, 0.5)), turns=Dist("uniform", (1, 8)),
                        new_tokens=Dist("lognormal", (300, 0.5)),
                        think_time_s=Dist("exponential", (20.0,)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="simulated traffic duration")
    args = ap.parse_args()
    wl = multi_turn_hour(args.minutes)
    print(f"# {args.minutes:g} min of 8 QPS multi-turn traffic, public preset (1P1D)")
    for mode in ("push", "pull", "bidirectional"):
        t0 = time.perf_counter()
        res = simulate(P.public_h200_qwen3_32b(mode=mode).with_(workload=wl))
        wall = time.perf_counter() - t0
        n = len(res.requests)
        print(f"{mode:>13}: {n} requests, {res.events} events in {wall:.2f} s wall "
              f"-> {n / wall:,.0f} simulated requests per wall second "
              f"(TTFT p50 {res.ttft().p50_ms:.0f} ms)")
        if mode == "bidirectional":
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                n_spans = res.write_spans(Path(tmp) / "spans.jsonl")
                ws = time.perf_counter() - t0
                size = (Path(tmp) / "spans.jsonl").stat().st_size
            print(f"{'':>13}  spans: {n_spans} written in {ws:.2f} s ({n_spans / ws:,.0f} spans/s, "
                  f"{size / 1e6:.0f} MB)")

    agent = WorkloadSpec(qps=2.0, duration_s=600.0, prompt_tokens=Dist("lognormal", (8000, 0.3)),
                         output_tokens=Dist.fixed(300), turns=Dist.fixed(10),
                         new_tokens=Dist.fixed(400), think_time_s=Dist("uniform", (2, 20)))
    t0 = time.perf_counter()
    est = expected_ttft(agent)
    wall = time.perf_counter() - t0
    print(f"\n# expected_ttft, 3 modes, agent sessions: {wall:.2f} s wall; p50 ms: "
          + ", ".join(f"{m} {e.p50_ms:.0f}" for m, e in est.items()))

    print("\n# public preset vs published (mean TTFT ms over the run's requests, as the blog "
          "averages them; push/pull: steady-state p50)")
    for ctx in sorted(P.PUBLIC_REUSE_TTFT_MS):
        got = {}
        for reuse, table in ((True, P.PUBLIC_REUSE_TTFT_MS), (False, P.PUBLIC_NO_REUSE_TTFT_MS)):
            got[reuse] = simulate(P.reuse_scenario(ctx, reuse=reuse)).ttft().mean_ms
            print(f"{ctx:>6} tokens, {'reuse   ' if reuse else 'no reuse'}: {got[reuse]:6.0f} "
                  f"(published {table[ctx]:.0f}, ratio {got[reuse] / table[ctx]:.2f})")
        published = P.PUBLIC_NO_REUSE_TTFT_MS[ctx] / P.PUBLIC_REUSE_TTFT_MS[ctx]
        benefit = got[False] / got[True]
        print(f"{ctx:>6} tokens, reuse benefit (no-reuse / reuse TTFT): {benefit:.2f} "
              f"(published {published:.2f}, {benefit / published - 1:+.1%})")
    for name, (tokens, qps, published) in P.PUBLIC_PUSH_PULL.items():
        p50 = {m: simulate(P.push_pull_scenario(m, tokens, qps)).ttft(warmup_s=P.PUSH_PULL_WARMUP_S).p50_ms
               for m in ("push", "pull")}
        print(f"{tokens:>6} tokens @ {qps:g} QPS: push {p50['push']:.0f}, pull {p50['pull']:.0f}, "
              f"pull/push {p50['pull'] / p50['push']:.2f} (published about {published:g})")


if __name__ == "__main__":
    main()
