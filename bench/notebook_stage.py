"""`make tune`'s notebook stage today and after this change, in one run.

Before (today's stage, as main had it at ``--baseline`` (cd7e008), its code unpacked from git):
every notebook that draws the tuning runs ``recommend()`` itself (the simulator and 200 bootstrap
resamples, five times over the same spans), papermill starts each notebook's kernel when its turn
comes, and each figure went through ``plotly.io``'s renderers once more as its cell's result:
that import (nbformat, jsonschema and its URI grammars) took 2-4 s in every kernel, the largest
cost found by profiling the stage.
After (this tree): `kvtune tune` computes the tuning once, saves ``tuning.json`` and the notebooks
read it; ``nb.show`` displays each figure once, as plotly's mimetype renderer would, without that
import; reading the tuning no longer imports the local vLLM pair, router and aiohttp
(``kvtune.local`` imports its modules on first use); each kernel is started one notebook ahead
(it boots while the notebook before it runs, the first while the tuning is computed) and stopped
at once when its notebook is done.
Two more runs of this tree tell the changes apart: ``share_tuning=False, kernels_ahead=False``
(every notebook computes the tuning, kernels in turn) and ``share_tuning=True,
kernels_ahead=False``.

Each run is a fresh ``python`` process on the same spans and parameters, timed from start to exit
(what `kvtune tune` pays: imports included); the published values of all runs must agree.
The spans stand in for `make tune`'s default source on a machine without vLLM: a fabric-probe
sweep (``kvtune.testing.synthetic.probe_spans``) plus the simulator's serving traffic calibrated
with it (the ``probe+sim`` source of ``kvtune.tune.sources``). ``--traces`` takes other spans
(e.g. a `make tune` run's ``out/tune/spans``).

Run: .venv/bin/python bench/notebook_stage.py [--traces SRC] [--repeats N] [--baseline REV]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from kvtune.testing import synthetic
from kvtune.tune import sources


def make_spans(out: Path, seed: int = 0) -> str:
    """Probe sweep + simulated serving spans, shaped like `make tune`'s ``probe+sim`` source."""
    out.mkdir(parents=True, exist_ok=True)
    truth = synthetic.FabricTruth()
    synthetic.write_otlp_json(synthetic.probe_spans(truth, seed=seed), out / "probe.jsonl")
    fit = sources._FitGuess(floor_ms=truth.floor_ms, bandwidth_gbps=truth.bandwidth_gbps)
    sources._sim(out / "sim", fit, seed)
    return str(out)


ROOT = Path(__file__).resolve().parents[1]
BASELINE_REV = "cd7e008"
"""main before this change: its ``share_tuning=False`` is today's notebook stage."""
RUN = ("import json, sys\n"
       "from kvtune.tune.run import run_tune\n"
       "r = run_tune(sys.argv[1], sys.argv[2], progress=False, **json.loads(sys.argv[3]))\n"
       "print(json.dumps({k: str(v) for k, v in r.notebooks.items()}))\n")


def _published(notebooks: dict[str, str]) -> dict:
    import nbformat
    return {name: nbformat.read(path, as_version=4).metadata.get("kvtune", {})
            for name, path in sorted(notebooks.items())}


def _unpack(rev: str, dest: Path) -> Path:
    """The tree of ``rev`` (this repository's git history) at ``dest``."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _run(code_root: Path, traces: str, out: Path, kwargs: dict) -> tuple[float, dict]:
    """One `run_tune` in a fresh interpreter importing kvtune from ``code_root``: wall seconds
    from start to exit, and the published values of its notebooks."""
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", RUN, traces, str(out), json.dumps(kwargs)],
                          env=env, cwd=code_root, capture_output=True, text=True)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run_tune({kwargs}) from {code_root} failed:\n{proc.stderr[-3000:]}")
    return took, _published(json.loads(proc.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="", help="span source (default: probe sweep + simulator)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of the four runs")
    ap.add_argument("--baseline", default=BASELINE_REV, help="git revision of today's stage")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvtune-bench-nb-") as tmp:
        root = Path(tmp)
        traces = args.traces or make_spans(root / "spans")
        today = _unpack(args.baseline, root / "baseline")
        runs = {
            "before": (today, {"share_tuning": False}),
            "each": (ROOT, {"share_tuning": False, "kernels_ahead": False}),
            "shared": (ROOT, {"share_tuning": True, "kernels_ahead": False}),
            "after": (ROOT, {"share_tuning": True, "kernels_ahead": True}),
        }
        times: dict[str, list[float]] = {label: [] for label in runs}
        values = {}
        for i in range(args.repeats):
            for label, (code, kwargs) in runs.items():
                took, values[label] = _run(code, traces, root / f"{label}-{i}", kwargs)
                times[label].append(took)
                where = args.baseline if code == today else "this tree"
                print(f"{label:6s} ({where}, {', '.join(f'{k}={v}' for k, v in kwargs.items())}) "
                      f"run {i}: {took:6.1f} s", flush=True)
        same = len({json.dumps(v, sort_keys=True) for v in values.values()}) == 1
        best = {label: min(t) for label, t in times.items()}
        print(f"notebook stage ({len(values['after'])} notebooks, `kvtune tune` in a fresh process, "
              f"best of {args.repeats}) on {traces}:")
        print(f"  before: today ({args.baseline}), each notebook computes the tuning "
              f"{best['before']:6.1f} s")
        print(f"  this tree, each notebook computes the tuning, kernels in turn  "
              f"{best['each']:6.1f} s")
        print(f"  this tree, tuning computed once, kernels in turn               "
              f"{best['shared']:6.1f} s")
        print(f"  after:  tuning computed once, kernels started one notebook ahead "
              f"{best['after']:6.1f} s")
        print(f"  speed-up before/after: {best['before'] / best['after']:.2f}x; within this "
              f"tree, once vs each notebook: {best['each'] / best['after']:.2f}x; published "
              f"values identical: {same}")
        return 0 if same else 1

if __name__ == "__main__":
    sys.exit(main())
