"""A verification seen from a ``kvtune tune`` output directory: the report's verification line.

``kvtune verify --tune-dir OUT`` writes its result to ``OUT/verify/verify.json``; then
:func:`attach` puts the verdict into ``OUT/configs/recommendation.json`` (key
``verification``), adds the comparison figure to ``OUT/figures`` and renders ``OUT/report.html``
again, and :func:`verification_for_tune_dir` is what ``kvtune tune`` calls on its own output
directory: a verification of *other* values (an earlier run's) is never shown as this one's.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from kvtune.errors import KvtuneError
from kvtune.verify import figures, results, verdict

VERIFY_DIR: Final = "verify"
WORKLOAD_FILE: Final = "workload.json"
"""Under ``verify/``: the conversations ``kvtune tune --verify`` replayed (``kvtune.workload/1``),
so that the prediction check can be recomputed from the directory alone."""
TUNE_VERIFY_STARTS: Final = 3
"""``kvtune tune --verify``: starts of each configuration's deployment, in alternating order
(A B A B A B), so that one start's offset is not read as an effect. Three, not two: with two, the
spread between the starts' own estimates (which bounds the standard error) rests on one degree of
freedom, and the smallest detectable effect of five fleet runs wandered from 4.1% to 12.8%; a
third start costs about 40 s per configuration here (128 requests a start in the fleet
regime)."""
TUNE_VERIFY_AIM_PCT: Final = 10.0
"""``kvtune tune --verify`` adds whole rounds of starts (A B) while the smallest effect it could
detect at p50 exceeds this (``kvtune.verify.run.MoreStarts``): one start 40% off the others (seen
here once in three fresh fleet runs) left a detectable effect of 23.5% after three starts."""
TUNE_VERIFY_MAX_STARTS: Final = 5
"""At most this many starts per configuration with the added rounds."""
TUNE_VERIFY_BUDGET_S: Final = 360.0
"""No round is added that would end the verification's measurements past six minutes."""
TUNE_VERIFY_SEED: Final = 1
"""``kvtune tune --verify``'s seed: the replayed conversations' tokens (tune's own traffic uses 0:
the same sizes, other tokens) and the crossover's bootstrap."""
FIGURE_PREFIX: Final = "verify"
"""Figures land in ``figures/verify--*.json``: the report's section for the name ``verify``."""


def result_path(tune_dir: str | Path) -> Path:
    return Path(tune_dir) / VERIFY_DIR / results.RESULT_FILE


def verification_for_tune_dir(tune_dir: str | Path,
                              recommendation: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``verification`` entry for ``recommendation`` from ``tune_dir/verify/verify.json``;
    None when there is none, it cannot be read, or it verified other values."""
    path = result_path(tune_dir)
    if not path.is_file():
        return None
    try:
        res = results.read(path)
    except KvtuneError:
        return None
    if not verdict.matches_recommendation(res, recommendation):
        return None
    return verdict.verification_entry(res, result_path=f"{VERIFY_DIR}/{results.RESULT_FILE}")


def attach(result: results.VerifyResult, tune_dir: str | Path) -> Path | None:
    """Show ``result`` in the tune report of ``tune_dir``; returns the report (None when the
    directory has no recommendation or the result verified other values)."""
    from kvtune.tune.headline import VERIFY_KEY
    from kvtune.tune.notebooks import TUNE_NOTEBOOKS
    from kvtune.tune.report import write_report

    tune = Path(tune_dir)
    rec_path = tune / "configs" / "recommendation.json"
    if not rec_path.is_file():
        return None
    rec = json.loads(rec_path.read_text())
    if not verdict.matches_recommendation(result, rec):
        return None
    rec[VERIFY_KEY] = verdict.verification_entry(
        result, result_path=f"{VERIFY_DIR}/{results.RESULT_FILE}")
    rec_path.write_text(json.dumps(rec, indent=2))
    figs = tune / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    (figs / f"{FIGURE_PREFIX}--comparison.json").write_text(figures.comparison(result).to_json())
    if result.crossover is not None:
        (figs / f"{FIGURE_PREFIX}--crossover.json").write_text(
            figures.crossover(result.crossover).to_json())
    source = str(rec.get("report_source") or rec.get("trace_source") or "see the notebooks")
    return write_report(tune / "report.html", figs, title="kvtune tuning report", source=source,
                        values={}, notebooks=[*TUNE_NOTEBOOKS, FIGURE_PREFIX],
                        recommendation=rec, configs_dir=rec_path.parent)


def verify_tune_dir(tune_dir: str | Path, *, shaped_rate_mbit: float | None,
                    conversations: int | None = None, seed: int = TUNE_VERIFY_SEED,
                    starts: int = TUNE_VERIFY_STARTS, lab: str | None = None,
                    crossover: bool = True, progress: bool = True) -> results.VerifyResult:
    """``kvtune tune --verify``: replay the embedded default's traffic (another seed) on the local
    pair in the lab regime the tuning measured (``recommendation.json``'s ``lab``, else ``lab``,
    else warm) under vLLM's defaults and under the recommendation just written to ``tune_dir``,
    each over ``starts`` starts in alternating order, on the same fabric, and show the verdict and
    the predictions' check at the top of its report. Where the recommendation is vLLM's defaults,
    the runner-up (the mode ranked second, at the recommended threshold and TTL) is measured
    against it instead: the decision is what is verified. With ``crossover``, the
    recompute/pull crossover is swept too (lengths from the workload, one more deployment)."""
    from kvtune.local.regime import WARM, regime
    from kvtune.tune.headline import LAB_KEY
    from kvtune.tune.sources import workload_plans
    from kvtune.verify import configs as C
    from kvtune.verify.backends import LocalPairBackend
    from kvtune.verify.run import MoreStarts, describe, run_verify

    tune = Path(tune_dir)
    rec_path = tune / "configs" / C.RECOMMENDATION_FILE
    if not rec_path.is_file():
        raise KvtuneError(f"kvtune tune --verify: {rec_path}: no recommendation to verify")
    rec = json.loads(rec_path.read_text())
    traced = rec.get(LAB_KEY) if isinstance(rec.get(LAB_KEY), dict) else {}
    reg = regime(lab or traced.get("regime") or WARM.name)
    plans = workload_plans(reg, conversations or reg.verify_conversations, seed=seed)
    backend = LocalPairBackend(shaped_rate_mbit=shaped_rate_mbit, pair_kwargs={"regime": reg},
                               regime=reg.name)
    recommended = C.from_recommendation(rec_path, data=rec)
    configs, baseline = [C.vllm_defaults(), recommended], C.DEFAULTS
    if C.same_settings(recommended, configs[0]):
        runner = C.runner_up(rec)
        if runner is None:
            raise KvtuneError(f"kvtune tune --verify: {rec_path}: the recommendation is vLLM's "
                              f"defaults and names no runner-up mode to verify the decision "
                              f"against")
        configs, baseline = [recommended, runner], C.RECOMMENDED
    from kvtune.verify import workload_file
    from kvtune.verify.crossover import CrossoverSpec, lengths_for
    workload_file.save(plans, tune / VERIFY_DIR / WORKLOAD_FILE)
    sweep = CrossoverSpec(lengths_for(plans, reg), seed=seed) if crossover else None
    result = run_verify(configs, backend, plans, tune / VERIFY_DIR,
                        workload=describe(plans, f"kvtune tune's embedded default traffic "
                                                 f"(lab regime {reg.name}, seed {seed})"),
                        baseline=baseline, recommendation=rec, crossover=sweep,
                        max_concurrency=reg.parallel_conversations, turn_major=reg.turn_major,
                        starts=starts, progress=progress, seed=seed,
                        more_starts=MoreStarts(TUNE_VERIFY_AIM_PCT,
                                               max(starts, TUNE_VERIFY_MAX_STARTS),
                                               TUNE_VERIFY_BUDGET_S))
    attach(result, tune)
    return result
