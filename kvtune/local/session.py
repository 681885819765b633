"""Run a multi-turn workload on a fresh local vLLM pair (what ``kvtune local run`` does)."""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtune.local.pair import LocalPair
from kvtune.local.workload import PairTarget, RequestResult, WorkloadConfig, generate, run_workload


@dataclass(frozen=True)
class SessionSummary:
    """What one local run did; latencies in milliseconds over the successful requests."""

    mode: str
    connector: str
    n_requests: int
    n_failed: int
    latency_p50_ms: float | None
    ttft_p50_ms: float | None
    spans_dir: str | None
    results_path: str | None


def run_local_session(mode: str, *, workdir: str | os.PathLike[str],
                      connector: str = "kvtune",
                      spans_dir: str | os.PathLike[str] | None = None,
                      config: WorkloadConfig = WorkloadConfig(), time_scale: float = 1.0,
                      ttl_s: float | None = None, recompute_threshold: int | None = None,
                      results_path: str | os.PathLike[str] | None = None,
                      progress: bool = True) -> tuple[SessionSummary, list[RequestResult]]:
    """Start a ``LocalPair``, drive ``config``'s conversations through it, stop it.

    Results are also written as JSON lines to ``results_path`` when given.
    """
    plans = generate(config)
    with LocalPair(mode, connector=connector, workdir=workdir, spans_dir=spans_dir, ttl_s=ttl_s,
                   recompute_threshold=recompute_threshold) as pair:
        results = run_workload(plans, PairTarget(pair), time_scale=time_scale, progress=progress)
    if results_path is not None:
        path = Path(results_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for r in results:
                f.write(json.dumps(_jsonable(asdict(r))) + "\n")
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    summary = SessionSummary(
        mode=mode, connector=connector, n_requests=len(results),
        n_failed=len(results) - len(ok),
        latency_p50_ms=statistics.median(r.latency_ms for r in ok) if ok else None,
        ttft_p50_ms=statistics.median(ttfts) if ttfts else None,
        spans_dir=str(spans_dir) if spans_dir is not None else None,
        results_path=str(results_path) if results_path is not None else None)
    return summary, results


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
