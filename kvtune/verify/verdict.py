"""Comparisons between configurations and the sentences that state them: the verdict of the
verify page and the ``verification`` entry the tune report shows at its top."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from kvtune.errors import AnalysisError
from kvtune.verify import stats
from kvtune.verify.configs import DEFAULTS, RECOMMENDED
from kvtune.verify.results import Comparison, ConfigResult, VerifyResult

STATUS_BETTER: Final = "verified: faster than defaults"
STATUS_WORSE: Final = "not confirmed: slower than defaults"
STATUS_NO_DIFFERENCE: Final = "not verified: no difference detectable"
STATUS_UNKNOWN: Final = "not verified: too few matched requests"
STATUS_DEFAULTS: Final = "kvtune recommends vLLM's defaults for this traffic"
"""The recommendation holds vLLM's defaults: nothing to verify against them; the decision is
verified instead (the runner-up measured against the recommendation)."""


def _pct(v: float) -> str:
    return f"{v:.1f}"


def _detectable(change: stats.PairedChange) -> str:
    if change.detectable_pct is None:
        return ""
    return (f"; smallest detectable effect {_pct(change.detectable_pct)}% "
            f"({stats.POWER:.0%} power, {stats.TEST_LEVEL:.0%} level)")


def _over(change: stats.PairedChange) -> str:
    starts = f" over {change.starts} starts each" if change.starts > 1 else ""
    return f"{change.n_pairs} matched requests{starts}"


def verdict_text(baseline: str, candidate: str, change: stats.PairedChange | None,
                 label: str = "p50") -> str:
    """The comparison in words that follow its interval: ``"recommended is 52.3% faster than
    defaults at p50 (...)"`` only where the interval excludes zero (likewise "slower"), else
    ``"... no difference detectable above 6.1% at p50 (...)"``; always with the smallest effect
    the run could have detected."""
    if change is None:
        return (f"{candidate} vs {baseline}: too few requests measured under both to compare "
                f"at {label}")
    ms = (f"{change.candidate_ms:.1f} ms vs {change.baseline_ms:.1f} ms, {_over(change)}, "
          f"{stats.CONFIDENCE:.0%} interval of the difference [{_pct(change.low_pct)}, "
          f"{_pct(change.high_pct)}]% faster{_detectable(change)}")
    if change.excludes_zero:
        word = "faster" if change.faster_pct > 0 else "slower"
        return (f"{candidate} is {_pct(abs(change.faster_pct))}% {word} than {baseline} at "
                f"{label} ({ms})")
    bound = (f" above {_pct(change.detectable_pct)}%" if change.detectable_pct is not None
             else "")
    return f"{candidate} vs {baseline}: no difference detectable{bound} at {label} ({ms})"


def compare(baseline: ConfigResult, candidate: ConfigResult, *, seed: int = 0) -> Comparison:
    """Paired bootstrap of ``candidate`` against ``baseline`` over the requests both measured
    (in the same start; the starts resampled too where there were several)."""
    b, c = baseline.ttft_by_key(), candidate.ttft_by_key()
    starts = {**baseline.start_by_key(), **candidate.start_by_key()}
    units = {r.key: r.turn_key for cfg in (baseline, candidate) for r in cfg.requests}
    out: dict[str, stats.PairedChange | None] = {}
    for label, q in (("p50", 0.5), ("p99", 0.99)):
        try:
            out[label] = stats.paired_change(b, c, q, seed=seed, starts=starts, units=units)
        except AnalysisError:
            out[label] = None
    return Comparison(baseline.config.name, candidate.config.name, out["p50"], out["p99"],
                      verdict_text(baseline.config.name, candidate.config.name, out["p50"]))


def comparisons(configs: Sequence[ConfigResult], baseline: str | None = None,
                seed: int = 0) -> tuple[Comparison, ...]:
    """Every configuration against ``baseline`` (default: the one named ``defaults``, else the
    first)."""
    if len(configs) < 2:
        return ()
    names = [c.config.name for c in configs]
    base_name = baseline or (DEFAULTS if DEFAULTS in names else names[0])
    if base_name not in names:
        raise AnalysisError(f"verify: baseline {base_name!r} is not among the configurations "
                            f"{names}")
    base = configs[names.index(base_name)]
    return tuple(compare(base, c, seed=seed) for c in configs if c.config.name != base_name)


def headline_comparison(result: VerifyResult) -> Comparison | None:
    """The comparison the tune report states: ``recommended`` against the baseline (or, where
    the recommendation is vLLM's defaults, the runner-up against the recommendation), else the
    first one."""
    for c in result.comparisons:
        if RECOMMENDED in (c.candidate, c.baseline):
            return c
    return result.comparisons[0] if result.comparisons else None


def status(change: stats.PairedChange | None) -> str:
    """The report's status of the recommendation against vLLM's defaults."""
    if change is None:
        return STATUS_UNKNOWN
    if change.low_pct > 0:
        return STATUS_BETTER
    if change.high_pct < 0:
        return STATUS_WORSE
    return (f"{STATUS_NO_DIFFERENCE} above {_pct(change.detectable_pct)}%"
            if change.detectable_pct is not None else STATUS_NO_DIFFERENCE)


def decision_status(runner_up: str, change: stats.PairedChange | None) -> str:
    """The status where the recommendation is vLLM's defaults: ``change`` is the runner-up
    (candidate) against the recommendation (baseline)."""
    if change is None:
        return f"{STATUS_DEFAULTS}; {STATUS_UNKNOWN}"
    if change.low_pct > 0:
        return (f"{STATUS_DEFAULTS}; not confirmed: the runner-up {runner_up} measured "
                f"{_pct(change.faster_pct)}% faster")
    if change.high_pct < 0:
        return (f"{STATUS_DEFAULTS}; decision verified: the runner-up {runner_up} measured "
                f"{_pct(-change.faster_pct)}% slower")
    bound = (f" above {_pct(change.detectable_pct)}%" if change.detectable_pct is not None
             else "")
    return (f"{STATUS_DEFAULTS}; the runner-up {runner_up}: no difference detectable{bound} "
            f"(a tie)")


def verification_entry(result: VerifyResult, *, result_path: str = "verify/verify.json"
                       ) -> dict[str, Any] | None:
    """The ``verification`` object of ``recommendation.json`` (read by
    ``kvtune.tune.headline.Verification``); None without a comparison."""
    comp = headline_comparison(result)
    if comp is None:
        return None
    ch = comp.p50
    decision = comp.baseline == RECOMMENDED
    where = f"({result.target}; {result_path})"
    if decision:
        # the runner-up's mode, not its configuration's name ("the runner-up runner-up")
        mode = next((c.config.mode for c in result.configs if c.config.name == comp.candidate),
                    comp.candidate)
        stat = decision_status(mode, ch)
        detail = f"{comp.verdict} {where}"
    else:
        stat = status(ch)
        detail = (f"{comp.candidate} beat {comp.baseline} by {_pct(ch.faster_pct)}% at TTFT p50 "
                  f"(x{ch.baseline_ms / ch.candidate_ms:.2f}), {stats.CONFIDENCE:.0%} interval "
                  f"[{_pct(ch.low_pct)}, {_pct(ch.high_pct)}]% ({_over(ch)}"
                  f"{_detectable(ch)}; {result.target}; {result_path})"
                  if ch is not None and ch.low_pct > 0 else f"{comp.verdict} {where}")
    pred = _prediction_text(result, RECOMMENDED if decision else comp.candidate)
    return {"status": stat,
            "ttft_p50_change_pct": (round(-ch.faster_pct, 2)
                                    if ch is not None and not decision else None),
            "detectable_pct": (round(ch.detectable_pct, 2)
                               if ch is not None and ch.detectable_pct is not None else None),
            "detail": detail + (f"; {pred}" if pred else ""), "baseline": comp.baseline,
            "candidate": comp.candidate}


def _prediction_text(result: VerifyResult, candidate: str) -> str:
    """How the candidate's predicted TTFT p50 and reuse captured compared with the measurement."""
    p = result.predictions
    if p is None:
        return ""
    parts = [f"{m.mode} TTFT p50 predicted {m.predicted_p50_ms:.0f} ms, measured "
             f"{m.measured_p50_ms:.0f} ms ({m.error_share:+.0%})"
             for m in p.modes if m.config == candidate and m.measured_p50_ms is not None
             and m.error_share is not None]
    r = p.reuse
    if r is not None and r.config == candidate and r.measured_share is not None:
        parts.append(f"reuse captured predicted {r.predicted_share:.0%}, measured "
                     f"{r.measured_share:.0%}")
    return "; ".join(parts)


def matches_recommendation(result: VerifyResult, rec: Mapping[str, Any]) -> bool:
    """Whether the result's ``recommended`` configuration holds the values of ``rec``
    (``recommendation.json``): a verification of other values is not shown as this one's."""
    from kvtune.verify.configs import from_recommendation
    from pathlib import Path

    try:
        want = from_recommendation(Path("recommendation.json"), data=dict(rec))
    except Exception:
        return False
    comp = headline_comparison(result)
    if comp is None:
        return False
    for c in result.configs:
        if c.config.name == RECOMMENDED:
            got = c.config
            return (got.mode, got.recompute_threshold_tokens, got.ttl_s) == (
                want.mode, want.recompute_threshold_tokens, want.ttl_s)
    return False
