"""A simulation run written to a directory: spans, the per-request table and a summary."""
from __future__ import annotations

import json
import os
from pathlib import Path

from kvtune.sim.config import SimConfig
from kvtune.sim.result import SimResult, simulate

SPANS_FILE = "spans.jsonl"
REQUESTS_FILE = "requests.csv"
SUMMARY_FILE = "summary.json"


def simulate_to_dir(config: SimConfig, out_dir: str | os.PathLike[str], *, spans: bool = True,
                    progress: bool = True) -> SimResult:
    """Simulate ``config`` and write ``spans.jsonl`` (OTLP-JSON lines, loadable with
    ``kvtune.traces.load``), ``requests.csv`` and ``summary.json`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = simulate(config, progress=progress)
    summary = result.summary()
    if spans:
        summary["spans"] = result.write_spans(out / SPANS_FILE, progress=progress)
    result.requests.to_csv(out / REQUESTS_FILE, index=False)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    return result
