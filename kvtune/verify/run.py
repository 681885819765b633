"""``run_verify``: replay one workload under each configuration, compare, write JSON and page."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class MoreStarts:
    """Adaptive starts: after the first ``starts`` rounds, another round of every configuration
    (A B again) while the smallest effect the headline comparisons could detect at p50 exceeds
    ``aim_detectable_pct``, up to ``max_starts`` rounds and while one more round (timed as the
    rounds so far), and the crossover sweep's own deployment where it needs one (timed as a
    round), still end within ``budget_s`` of the verification's start."""

    aim_detectable_pct: float
    max_starts: int
    budget_s: float | None = None


def fits_budget(elapsed_s: float, rounds_done: int, rounds_left: int,
                budget_s: float | None) -> bool:
    """Whether ``rounds_left`` more rounds, each as long as the mean of the ``rounds_done`` that
    took ``elapsed_s``, end within ``budget_s`` (None: no budget)."""
    if budget_s is None:
        return True
    return elapsed_s * (rounds_done + rounds_left) / max(rounds_done, 1) <= budget_s


def worst_detectable_pct(parts: Mapping[str, Sequence[ConfigResult]], baseline: str | None, *,
                         seed: int = 0) -> float | None:
    """The largest smallest-detectable effect at p50 over the comparisons of ``parts`` (each
    configuration's starts so far); None when no comparison has one."""
    from kvtune.verify.measure import combine
    measured = [combine(list(v), seed=seed) for v in parts.values() if v]
    found = [c.p50.detectable_pct for c in verdict.comparisons(measured, baseline, seed=seed)
             if c.p50 is not None and c.p50.detectable_pct is not None]
    return max(found) if found else None


def _say(bar: Any, text: str, *, warn: bool = False) -> None:
    """Above the progress bar where it is shown, else to the log (not both: kvtune tune's log
    handler printed each line a second time)."""
    if not bar.disable:
        bar.write(text)
    else:
        (_log.warning if warn else _log.info)("%s", text)


def run_verify(configs: Sequence[VerifyConfig], backend: Backend,
               plans: Sequence[ConversationPlan], out_dir: str | Path, *,
               workload: str = "workload", baseline: str | None = None,
               crossover: CrossoverSpec | None = None,
               recommendation: Mapping[str, Any] | None = None, time_scale: float = 1.0,
               max_concurrency: int | None = None, turn_major: bool = False, starts: int = 1,
               more_starts: MoreStarts | None = None,
               progress: bool = True, seed: int = 0) -> VerifyResult:
    """Measure every configuration and, with ``crossover``, the crossover sweep; write
    ``verify.json`` and ``verify.html`` into ``out_dir`` and return the result. With a
    ``recommendation``, its predictions are checked against the measurements
    (:mod:`kvtune.verify.predictions`).

    ``starts``: each configuration is measured over this many starts of its deployment, the
    configurations in alternating order (A B A B ...), so that one start's offset is neither
    read as an effect nor confounded with the order; the paired comparison resamples the starts
    (:func:`kvtune.verify.stats.paired_change`). ``more_starts`` adds rounds while the run could
    not yet detect the effect it aims at (:class:`MoreStarts`)."""
    from tqdm import tqdm

    from kvtune.verify import crossover as X
    from kvtune.verify.measure import Phase, combine, measure_deployment

    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ConfigError(f"verify: configuration names must differ, got {names}")
    if not configs and crossover is None:
        raise ConfigError("verify: expected at least one configuration or a crossover sweep")
    if configs and not plans:
        raise ConfigError("verify: the workload has no conversations")
    if starts < 1:
        raise ConfigError(f"verify: starts expected >= 1, got {starts}")
    if more_starts is not None and more_starts.max_starts < starts:
        raise ConfigError(f"verify: max starts expected >= starts ({starts}), got "
                          f"{more_starts.max_starts}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The sweep rides on the last of the first ``starts`` starts of a configuration that pulls
    # every swept history (one start fewer), else it gets a deployment of its own.
    host = next((c for c in configs if crossover is not None
                 and X.can_host(crossover, c, backend)), None)
    parts: dict[str, list[ConfigResult]] = {c.name: [] for c in configs}
    swept: ConfigResult | None = None
    t0 = time.monotonic()
    bar = tqdm(total=starts * len(configs), desc="kvtune verify", unit="start",
               disable=not progress)

    single = starts == 1 and more_starts is None

    def one_round(k: int) -> None:
        nonlocal swept
        for cfg in configs:
            bar.set_postfix_str(f"{cfg.name} (start {k + 1})")
            run_dir = out / "runs" / (cfg.name if single else f"{cfg.name}-{k + 1}")
            phases = [Phase("replay", plans, time_scale=time_scale,
                            max_concurrency=max_concurrency, turn_major=turn_major)]
            if cfg is host and k == starts - 1:
                assert crossover is not None
                phases.append(X.sweep_phase(crossover, host))
            got = measure_deployment(cfg, backend, phases, run_dir, progress=progress, start=k)
            parts[cfg.name].append(got[0])
            if len(got) > 1:
                swept = got[1]
            bar.update(1)

    for k in range(starts):
        one_round(k)
    k = starts
    while configs and more_starts is not None and k < more_starts.max_starts:
        worst = worst_detectable_pct(parts, baseline, seed=seed)
        if worst is None or worst <= more_starts.aim_detectable_pct:
            break
        elapsed = time.monotonic() - t0
        # another round, and the sweep's own deployment still to come (about one round's time)
        rounds_left = 1 + (1 if crossover is not None and host is None else 0)
        if not fits_budget(elapsed, k, rounds_left, more_starts.budget_s):
            _say(bar, f"verify: smallest detectable effect {worst:.1f}% > "
                      f"{more_starts.aim_detectable_pct:g}% after {k} starts each, but another "
                      f"round would end the verification past its {more_starts.budget_s:.0f} s "
                      f"budget", warn=True)
            break
        _say(bar, f"verify: smallest detectable effect {worst:.1f}% > "
                  f"{more_starts.aim_detectable_pct:g}% after {k} starts each: one more start "
                  f"of each configuration")
        bar.total += len(configs)
        bar.refresh()
        one_round(k)
        k += 1
    bar.close()
    measured = [combine(parts[c.name], seed=seed) for c in configs]
    cross = None
    if crossover is not None and swept is not None and host is not None:
        cross = X.analyze(X.points(swept), recommendation, seed=crossover.seed,
                          deployment=f"after the replay on {host.name!r}'s last start "
                                     f"(threshold {X.effective_settings(host)[1]}: every swept "
                                     f"history offered back is pulled)")
    elif crossover is not None:
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
