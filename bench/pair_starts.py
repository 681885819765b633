"""How often does a bidirectional pair start hang? N consecutive starts, each with the two-turn
P/D warm-up (the first reverse contact included), per connector and layout.

A start counts as hung when its warm-up needed the restart guard or failed; the watchdog dumps
every server thread's stack for any warm-up leg past 20 s (``stacks/`` in each run's pair
workdir), so a hang leaves its evidence. Prints, per (layout, connector): starts, clean starts,
hangs, restarts and the start times (p50/max), with the load average before each start.

    .venv/bin/python bench/pair_starts.py --starts 20 --connectors kvtune,vllm --layouts quiet
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from kvtune.local.errors import LocalPairError
from kvtune.local.pair import LocalPair


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.restarts = 0
        self.warmup_failures = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "restarting both servers" in msg:
            self.restarts += 1
        elif "warm-up attempt" in msg:
            self.warmup_failures += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/pair_starts")
    ap.add_argument("--starts", type=int, default=20)
    ap.add_argument("--connectors", default="kvtune,vllm")
    ap.add_argument("--layouts", default="quiet")
    ap.add_argument("--mode", default="bidirectional")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counter = _Counter()
    logging.getLogger("kvtune.local.pair").addHandler(counter)
    results = []
    for layout in args.layouts.split(","):
        for connector in args.connectors.split(","):
            times, hangs, dumps = [], 0, 0
            restarts0, failures0 = counter.restarts, counter.warmup_failures
            for i in range(args.starts):
                load = os.getloadavg()[0]
                work = out / f"{layout}-{connector}-{i:02d}"
                t0 = time.monotonic()
                failures_before = counter.warmup_failures
                try:
                    with LocalPair(args.mode, connector=connector, layout=layout,
                                   workdir=work) as pair:
                        elapsed = time.monotonic() - t0
                        dumps += len(pair._watchdog.dumps) if pair._watchdog else 0
                except LocalPairError as exc:
                    elapsed = time.monotonic() - t0
                    print(f"  start {i + 1}: FAILED {str(exc).splitlines()[0][:200]}",
                          file=sys.stderr)
                    hangs += 1
                else:
                    if counter.warmup_failures > failures_before:
                        hangs += 1
                times.append(elapsed)
                print(f"  {layout}/{connector} start {i + 1}/{args.starts}: {elapsed:.0f} s "
                      f"(load before {load:.2f})", file=sys.stderr)
            t = np.asarray(times)
            results.append({"layout": layout, "connector": connector, "starts": args.starts,
                            "hung_starts": hangs,
                            "restarts": counter.restarts - restarts0,
                            "warmup_failures": counter.warmup_failures - failures0,
                            "stack_dump_legs": dumps,
                            "start_s_p50": float(np.median(t)), "start_s_max": float(t.max())})
            print(json.dumps(results[-1]), flush=True)
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    print("| layout | connector | starts | hung starts | restarts | start p50 s | start max s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['layout']} | {r['connector']} | {r['starts']} | {r['hung_starts']} | "
              f"{r['restarts']} | {r['start_s_p50']:.0f} | {r['start_s_max']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
