"""``run_verify``: replay one workload under each configuration, compare, write JSON and page."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvtune import __version__
from kvtune.errors import ConfigError
from kvtune.local.workload import ConversationPlan
from kvtune.verify import page, results, verdict
from kvtune.verify.backends import Backend
from kvtune.verify.configs import VerifyConfig
from kvtune.verify.crossover import CrossoverSpec, run_crossover
from kvtune.verify.results import ConfigResult, VerifyResult

_log = logging.getLogger(__name__)


def describe(plans: Sequence[ConversationPlan], origin: str) -> str:
    n_req = sum(len(p.turns) for p in plans)
    return f"{origin}: {len(plans)} conversations, {n_req} requests"


def run_verify(configs: Sequence[VerifyConfig], backend: Backend,
               plans: Sequence[ConversationPlan], out_dir: str | Path, *,
               workload: str = "workload", baseline: str | None = None,
               crossover: CrossoverSpec | None = None,
               recommendation: Mapping[str, Any] | None = None, time_scale: float = 1.0,
               max_concurrency: int | None = None, progress: bool = True,
               seed: int = 0) -> VerifyResult:
    """Measure every configuration (in order) and, with ``crossover``, the crossover sweep; write
    ``verify.json`` and ``verify.html`` into ``out_dir`` and return the result. With a
    ``recommendation``, its predictions are checked against the measurements
    (:mod:`kvtune.verify.predictions`)."""
    from tqdm import tqdm

    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ConfigError(f"verify: configuration names must differ, got {names}")
    if not configs and crossover is None:
        raise ConfigError("verify: expected at least one configuration or a crossover sweep")
    if configs and not plans:
        raise ConfigError("verify: the workload has no conversations")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    measured: list[ConfigResult] = []
    bar = tqdm(list(configs), desc="kvtune verify", unit="config", disable=not progress)
    for cfg in bar:
        bar.set_postfix_str(cfg.name)
        from kvtune.verify.measure import measure_config
        measured.append(measure_config(cfg, backend, plans, out / "runs" / cfg.name,
                                       time_scale=time_scale, max_concurrency=max_concurrency,
                                       progress=progress))
    bar.close()
    cross = None
    if crossover is not None:
        cross, _ = run_crossover(crossover, backend, out / "runs", recommendation=recommendation,
                                 progress=progress)
    result = assemble(measured, target=backend.description, workload=workload,
                      baseline=baseline, crossover=cross, seed=seed)
    if recommendation is not None:
        from kvtune.verify.predictions import check
        result = dataclasses.replace(result, predictions=check(
            recommendation, measured, plans))
    results.write(result, out / results.RESULT_FILE)
    page.write(result, out / results.PAGE_FILE)
    return result


def assemble(measured: Sequence[ConfigResult], *, target: str, workload: str,
             baseline: str | None = None, crossover: results.CrossoverResult | None = None,
             seed: int = 0) -> VerifyResult:
    """The result of measured configurations (pure apart from the timestamp)."""
    return VerifyResult(
        format=results.RESULT_FORMAT,
        created_utc=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        kvtune_version=__version__, target=target, workload=workload, configs=tuple(measured),
        comparisons=verdict.comparisons(measured, baseline, seed=seed), crossover=crossover)
