"""`make tune`'s notebook stage, before and after the tuning is computed once, in one run.

Before: every notebook that draws the tuning runs ``recommend()`` itself (the simulator and 200
bootstrap resamples, five times over the same spans): ``run_tune(share_tuning=False)``.
After: `kvtune tune` computes it once, saves ``tuning.json`` and the notebooks read it.
Both runs take the same spans and parameters; the published values must agree.

The spans stand in for `make tune`'s default source on a machine without vLLM: a fabric-probe
sweep (``kvtune.testing.synthetic.probe_spans``) plus the simulator's serving traffic calibrated
with it (the ``probe+sim`` source of ``kvtune.tune.sources``). ``--traces`` takes other spans
(e.g. a `make tune` run's ``out/tune/spans``).

Run: .venv/bin/python bench/notebook_stage.py [--traces SRC] [--repeats N]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from kvtune.testing import synthetic
from kvtune.tune import sources
from kvtune.tune.run import run_tune


def make_spans(out: Path, seed: int = 0) -> str:
    """Probe sweep + simulated serving spans, shaped like `make tune`'s ``probe+sim`` source."""
    out.mkdir(parents=True, exist_ok=True)
    truth = synthetic.FabricTruth()
    synthetic.write_otlp_json(synthetic.probe_spans(truth, seed=seed), out / "probe.jsonl")
    fit = sources._FitGuess(floor_ms=truth.floor_ms, bandwidth_gbps=truth.bandwidth_gbps)
    sources._sim(out / "sim", fit, seed)
    return str(out)


def _published(result) -> dict:
    import nbformat
    values = {}
    for name, path in sorted(result.notebooks.items()):
        values[name] = nbformat.read(str(path), as_version=4).metadata.get("kvtune", {})
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="", help="span source (default: probe sweep + simulator)")
    ap.add_argument("--repeats", type=int, default=1, help="before/after pairs to run")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvtune-bench-nb-") as tmp:
        root = Path(tmp)
        traces = args.traces or make_spans(root / "spans")
        times: dict[str, list[float]] = {"before": [], "after": []}
        values = {}
        for i in range(args.repeats):
            for label, share in (("before", False), ("after", True)):
                t0 = time.monotonic()
                result = run_tune(traces, root / f"{label}-{i}", progress=False,
                                  share_tuning=share)
                times[label].append(time.monotonic() - t0)
                values[label] = _published(result)
                print(f"{label:6s} (share_tuning={share!s:5s}) run {i}: "
                      f"{times[label][-1]:6.1f} s", flush=True)
        same = json.dumps(values["before"], sort_keys=True) == json.dumps(values["after"],
                                                                           sort_keys=True)
        before, after = min(times["before"]), min(times["after"])
        print(f"notebook stage ({len(values['after'])} notebooks) on {traces}:")
        print(f"  before: each notebook computes the tuning   {before:6.1f} s (best of "
              f"{args.repeats})")
        print(f"  after:  computed once, notebooks draw it     {after:6.1f} s")
        print(f"  speed-up: {before / after:.2f}x; published values identical: {same}")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
