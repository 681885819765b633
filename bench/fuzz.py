"""A longer fuzz run of the hostile-input property tests than ``make test`` does (500 examples each).

Runs every ``test_property_*`` function of the modules below with ``--examples`` examples per
property (hypothesis; a failure prints its minimal example and the run exits 1), and prints per
property the examples run, the wall time and the time per example, measured in this run.

    .venv/bin/python bench/fuzz.py [--examples 20000] [--only traces|probe|binding]
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
import traceback
from pathlib import Path

MODULES = {"traces": "test_traces_hostile", "probe": "test_probe_frames",
           "binding": "test_router_binding"}
"""Test modules (in ``tests/``) whose ``test_property_*`` functions this runs."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20_000, help="examples per property")
    parser.add_argument("--only", choices=sorted(MODULES), action="append",
                        help="only these modules (repeatable; default all)")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error("--examples: expected an integer >= 1")
    logging.getLogger("kvtune").setLevel(logging.ERROR)  # skipped-record warnings: thousands
    # Read by tests/fuzz_settings.py when the test modules are imported (below).
    os.environ["KVTUNE_FUZZ_EXAMPLES"] = str(args.examples)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    failures = 0
    print(f"{'property':72s} {'examples':>9s} {'wall s':>8s} {'ms/example':>11s}")
    for key in args.only or sorted(MODULES):
        module = importlib.import_module(MODULES[key])
        for name in sorted(n for n in dir(module) if n.startswith("test_property_")):
            t0 = time.perf_counter()
            try:
                getattr(module, name)()
                status = ""
            except Exception:  # a property found a counterexample: show it, go on with the rest
                failures += 1
                status = "  FAILED"
                traceback.print_exc()
            wall = time.perf_counter() - t0
            print(f"{module.__name__ + '.' + name:72s} {args.examples:9d} {wall:8.1f} "
                  f"{1e3 * wall / args.examples:11.2f}{status}", flush=True)
    print(f"{failures} propert{'y' if failures == 1 else 'ies'} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
