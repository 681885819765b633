"""kvtune.verify.stats: quantile intervals, the paired change, the measured crossover (hand-made
numbers with known answers)."""
from __future__ import annotations

import numpy as np
import pytest

from kvtune.errors import AnalysisError
from kvtune.verify import stats


def test_quantile_ci_brackets_the_sample_median_and_is_reproducible():
    values = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 100.0]
    est = stats.quantile_ci(values, 0.5, seed=3)
    assert est.value_ms == 13.0 and est.n == 7
    assert 10.0 <= est.low_ms <= 13.0 <= est.high_ms <= 100.0
    assert est == stats.quantile_ci(values, 0.5, seed=3)


def test_quantile_ci_of_a_constant_sample_is_a_point():
    est = stats.quantile_ci([5.0] * 10, 0.99)
    assert (est.value_ms, est.low_ms, est.high_ms) == (5.0, 5.0, 5.0)


def test_quantile_ci_ignores_missing_and_refuses_too_few():
    assert stats.quantile_ci([1.0, None, float("nan"), 3.0], 0.5).n == 2
    with pytest.raises(AnalysisError, match="at least 2"):
        stats.quantile_ci([1.0, None], 0.5, what="x")
    with pytest.raises(AnalysisError, match="q expected"):
        stats.quantile_ci([1.0, 2.0], 1.5)


def test_paired_change_of_a_uniform_speedup_is_exact():
    rng = np.random.default_rng(0)
    base = {f"r{i}": float(v) for i, v in enumerate(rng.lognormal(4, 0.5, 40))}
    cand = {k: 0.75 * v for k, v in base.items()}
    ch = stats.paired_change(base, cand, 0.5)
    assert ch.faster_pct == pytest.approx(25.0)
    assert ch.low_pct == pytest.approx(25.0) and ch.high_pct == pytest.approx(25.0)
    assert ch.n_pairs == 40
    slower = stats.paired_change(base, {k: 2 * v for k, v in base.items()}, 0.5)
    assert slower.faster_pct == pytest.approx(-100.0)


def test_paired_change_uses_only_matched_requests_and_its_interval_covers_noise():
    rng = np.random.default_rng(1)
    base = {f"r{i}": 100.0 + float(rng.normal(0, 5)) for i in range(60)}
    cand = {k: v + float(rng.normal(0, 5)) for k, v in base.items()}
    cand["only-here"] = 1.0
    ch = stats.paired_change(base, cand, 0.5)
    assert ch.n_pairs == 60
    assert ch.low_pct < 0 < ch.high_pct  # no real difference: the interval includes zero
    with pytest.raises(AnalysisError, match="under both"):
        stats.paired_change({"a": 1.0}, {"b": 1.0})


def _lines(lengths, on, off, n=10, noise=1.0, seed=0):
    rng = np.random.default_rng(seed)
    return ({h: list(on(h) + rng.normal(0, noise, n)) for h in lengths},
            {h: list(off(h) + rng.normal(0, noise, n)) for h in lengths})


def test_crossover_of_two_lines_is_their_intersection():
    # reuse on: 50 + 0.05 h; off: 40 + 0.1 h -> equal at h = 200
    on, off = _lines((32, 64, 128, 256, 512), lambda h: 50 + 0.05 * h, lambda h: 40 + 0.1 * h)
    est = stats.crossover(on, off)
    assert est.side == "crossed"
    assert est.tokens == pytest.approx(200, rel=0.15)
    assert est.low_tokens <= est.tokens <= est.high_tokens
    assert est.lengths_tokens == (32, 64, 128, 256, 512) and len(est.diff_p50_ms) == 5


def test_crossover_sides_when_one_always_wins():
    on, off = _lines((32, 64, 128), lambda h: 10.0, lambda h: 50.0)
    est = stats.crossover(on, off)
    assert est.side == "reuse_always_faster" and est.tokens is None
    assert est.low_tokens == est.high_tokens == 32
    on, off = _lines((32, 64, 128), lambda h: 50.0, lambda h: 10.0)
    est = stats.crossover(on, off)
    assert est.side == "recompute_always_faster" and est.high_tokens == 128


def test_crossover_needs_two_lengths_under_both():
    with pytest.raises(AnalysisError, match="at least 2 history lengths"):
        stats.crossover({32: [1.0, 2.0]}, {32: [1.0, 2.0], 64: [1.0, 2.0]})


def test_crossover_without_break_even_shape_has_no_interval():
    # reuse faster on short histories, slower on long: no break-even to report
    on, off = _lines((32, 64, 128), lambda h: 10.0 + 0.5 * h, lambda h: 40.0)
    est = stats.crossover(on, off)
    assert est.side == "no_break_even"
    assert est.tokens is None and est.low_tokens is None and est.high_tokens is None
