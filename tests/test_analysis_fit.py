"""fit_floor / fit_floor_points: recovery of a known floor, bandwidth and per-descriptor cost."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvtune.analysis import FloorFit, fit_floor, fit_floor_points, transfers
from kvtune.errors import AnalysisError
from kvtune.testing import synthetic as syn

TRUTH = syn.FabricTruth(floor_ms=2.0, bandwidth_gbps=40.0, per_descriptor_us=5.0,
                        noise_rel=0.02, noise_abs_ms=0.02, outlier_share=0.05, outlier_ms=25.0)


def _within(x: float, truth: float, share: float = 0.05) -> bool:
    return abs(x - truth) <= share * truth


def _covers(ci: tuple[float, float], truth: float) -> bool:
    return ci[0] <= truth <= ci[1]


@pytest.fixture(scope="module")
def probe_table():
    return transfers(syn.probe_spans(TRUTH, seed=1))


def test_fit_recovers_truth_within_5_percent_and_ci_covers(probe_table):
    fit = fit_floor(probe_table, seed=1)
    assert isinstance(fit, FloorFit)
    assert _within(fit.floor_ms, TRUTH.floor_ms)
    assert _within(fit.bandwidth_gbps, TRUTH.bandwidth_gbps)
    assert fit.per_descriptor_us is not None
    assert _within(fit.per_descriptor_us, TRUTH.per_descriptor_us)
    assert _covers(fit.floor_ci_ms, TRUTH.floor_ms)
    assert _covers(fit.bandwidth_ci_gbps, TRUTH.bandwidth_gbps)
    assert _covers(fit.per_descriptor_ci_us, TRUTH.per_descriptor_us)
    assert fit.r2 > 0.95
    assert fit.n_sizes == len(syn.DEFAULT_SIZES_BYTES)
    # 12 measured iterations x 2 layouts per size; warm-ups are not fitted
    assert fit.n_transfers == 12 * 2 * len(syn.DEFAULT_SIZES_BYTES)
    assert fit.n_outliers >= 1  # the injected 25 ms outliers are down-weighted


def test_outliers_do_not_move_the_fit():
    clean = syn.FabricTruth(outlier_share=0.0)
    dirty = syn.FabricTruth(outlier_share=0.10, outlier_ms=200.0)
    f_clean = fit_floor(transfers(syn.probe_spans(clean, seed=2)), n_boot=0)
    f_dirty = fit_floor(transfers(syn.probe_spans(dirty, seed=2)), n_boot=0)
    assert _within(f_dirty.floor_ms, f_clean.floor_ms, 0.05)
    assert _within(f_dirty.bandwidth_gbps, f_clean.bandwidth_gbps, 0.05)


def test_interval_coverage_over_seeds():
    """95% intervals: over 10 independent traces, each parameter's truth is covered >= 8 times."""
    hits = np.zeros(3, dtype=int)
    for seed in range(10):
        f = fit_floor(transfers(syn.probe_spans(TRUTH, seed=100 + seed)), n_boot=100, seed=seed)
        hits += [_covers(f.floor_ci_ms, TRUTH.floor_ms),
                 _covers(f.bandwidth_ci_gbps, TRUTH.bandwidth_gbps),
                 _covers(f.per_descriptor_ci_us, TRUTH.per_descriptor_us)]
    assert (hits >= 8).all(), hits


def test_hand_computed_exact_line():
    # 1 ms floor, 8 Gbit/s = 1 byte per ns = 1e6 bytes per ms, no descriptor term
    b = np.repeat([1e6, 2e6, 4e6], 3)
    ms = 1.0 + b / 1e6
    f = fit_floor_points(b, None, ms, n_boot=20)
    assert f.floor_ms == pytest.approx(1.0, abs=1e-6)
    assert f.bandwidth_gbps == pytest.approx(8.0, rel=1e-6)
    assert f.per_descriptor_us is None and f.per_descriptor_ci_us is None
    assert f.predict_ms(3e6) == pytest.approx(4.0, rel=1e-6)
    assert f.r2 == pytest.approx(1.0)


def test_descriptors_proportional_to_bytes_are_not_identifiable():
    b = np.repeat([1e6, 2e6, 4e6], 4)
    d = b / 16384
    ms = 1.0 + b / 1e6 + d * 0.005
    f = fit_floor_points(b, d, ms, n_boot=10)
    assert f.per_descriptor_us is None  # folded into the bandwidth
    assert f.predict_ms(2e6) == pytest.approx(1.0 + 2.0 + 2e6 / 16384 * 0.005, rel=1e-6)


def test_one_size_only_says_what_to_add():
    with pytest.raises(AnalysisError) as e:
        fit_floor_points([4096] * 10, None, [1.0] * 10)
    msg = str(e.value)
    assert "1 distinct size" in msg and "4096 B x10" in msg
    assert "3 each at 2 new distinct size(s) (e.g. 16384 B and 1024 B;" in msg


def test_two_sizes_say_which_to_top_up_and_add():
    with pytest.raises(AnalysisError) as e:
        fit_floor_points([1000, 1000, 1000, 2000], None, [1, 1, 1, 2])
    msg = str(e.value)
    assert "2 more at 2000 B" in msg and "3 each at 1 new distinct size(s) (e.g. 8000 B;" in msg


def test_enough_sizes_but_too_few_points_says_how_many():
    with pytest.raises(AnalysisError, match="add 6 more transfer"):
        fit_floor_points([1000, 2000, 3000], None, [1, 2, 3])


def test_many_sizes_one_each_fit():
    b = np.arange(1, 13) * 1e6
    f = fit_floor_points(b, None, 1.0 + b / 1e6, n_boot=10)
    assert f.floor_ms == pytest.approx(1.0, abs=1e-6) and f.n_sizes == 12


def test_time_not_growing_with_bytes_is_an_error():
    with pytest.raises(AnalysisError, match="does not grow with bytes"):
        fit_floor_points(np.repeat([1e3, 2e3, 3e3], 3), None, np.repeat([3.0, 2.0, 1.0], 3),
                         n_boot=0)


def test_bad_values_are_named():
    with pytest.raises(AnalysisError, match="bytes: expected finite values >= 0"):
        fit_floor_points([1, -2, 3], None, [1, 2, 3])
    with pytest.raises(AnalysisError, match="critical_ms: expected finite"):
        fit_floor_points([1, 2, 3], None, [1, math.nan, 3])


def test_mixed_fabrics_need_a_choice(probe_table):
    other = probe_table.copy()
    other["fabric"] = "efa"
    both = __import__("pandas").concat([probe_table, other], ignore_index=True)
    with pytest.raises(AnalysisError, match="2 fabrics"):
        fit_floor(both)
    assert fit_floor(both, fabric="efa", n_boot=0).n_transfers == len(other)


def test_mixed_ops_need_a_choice(probe_table):
    write = probe_table.copy()
    write["op"] = "WRITE"
    both = __import__("pandas").concat([probe_table, write], ignore_index=True)
    with pytest.raises(AnalysisError, match=r"mix NIXL operations \['READ', 'WRITE'\]"):
        fit_floor(both)
    assert fit_floor(both, op="WRITE", n_boot=0).n_transfers == len(write)


def test_floor_is_never_negative():
    # no fixed cost at all, noise around zero: the floor is pinned at 0, not fitted below it
    rng = np.random.default_rng(3)
    b = np.repeat([1e5, 1e6, 1e7], 6)
    ms = b / 1e6 * (1 + rng.normal(0, 0.02, len(b)))
    f = fit_floor_points(b, None, ms, n_boot=50)
    assert f.floor_ms >= 0 and f.floor_ci_ms[0] >= 0
    assert f.bandwidth_gbps == pytest.approx(8.0, rel=0.05)
