"""Statistics of a verification: quantiles with bootstrap intervals, the paired difference of two
configurations' p50, and the measured recompute/pull crossover. Pure functions on numbers.

Bootstraps resample requests with replacement (percentile intervals) from a seeded generator, so
the same data give the same interval.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from kvtune.errors import AnalysisError

N_BOOTSTRAP: Final = 2000
"""Resamples per interval: enough for stable 2.5/97.5 percentiles at these sample sizes."""
CONFIDENCE: Final = 0.95
MIN_SAMPLES: Final = 2
"""Fewer values than this give no interval (a single request says nothing about spread)."""


@dataclass(frozen=True)
class QuantileEstimate:
    """One quantile of a sample with its bootstrap interval, milliseconds."""

    q: float
    value_ms: float
    low_ms: float
    high_ms: float
    n: int


@dataclass(frozen=True)
class PairedChange:
    """How much faster ``candidate`` is than ``baseline`` at a quantile, over matched requests.

    ``faster_pct`` = 100 * (1 - candidate_q / baseline_q): positive when the candidate is faster;
    the interval comes from resampling the matched pairs together (paired bootstrap).
    """

    q: float
    faster_pct: float
    low_pct: float
    high_pct: float
    n_pairs: int
    baseline_ms: float
    candidate_ms: float


def _clean(values: Sequence[float], what: str) -> np.ndarray:
    arr = np.asarray([float(v) for v in values if v is not None], dtype=float)
    arr = arr[np.isfinite(arr)]
    if arr.size < MIN_SAMPLES:
        raise AnalysisError(f"{what}: expected at least {MIN_SAMPLES} finite values, "
                            f"got {arr.size}")
    return arr


def _bounds(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(samples, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def quantile_ci(values: Sequence[float], q: float, *, n_boot: int = N_BOOTSTRAP,
                confidence: float = CONFIDENCE, seed: int = 0,
                what: str = "values") -> QuantileEstimate:
    """The ``q`` quantile of ``values`` with a percentile-bootstrap interval."""
    if not 0.0 <= q <= 1.0:
        raise AnalysisError(f"quantile_ci: q expected in [0, 1], got {q}")
    arr = _clean(values, what)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, arr.size, size=(n_boot, arr.size))
    boots = np.quantile(arr[idx], q, axis=1)
    lo, hi = _bounds(boots, confidence)
    return QuantileEstimate(q, float(np.quantile(arr, q)), lo, hi, int(arr.size))


def paired_change(baseline: Mapping[str, float], candidate: Mapping[str, float], q: float = 0.5,
                  *, n_boot: int = N_BOOTSTRAP, confidence: float = CONFIDENCE,
                  seed: int = 0) -> PairedChange:
    """``candidate`` against ``baseline`` at quantile ``q`` over the keys both hold (the same
    request of the same workload under each configuration)."""
    keys = sorted(k for k in set(baseline) & set(candidate)
                  if np.isfinite(baseline[k]) and np.isfinite(candidate[k]))
    if len(keys) < MIN_SAMPLES:
        raise AnalysisError(f"paired_change: expected at least {MIN_SAMPLES} requests measured "
                            f"under both configurations, got {len(keys)}")
    b = np.array([baseline[k] for k in keys], dtype=float)
    c = np.array([candidate[k] for k in keys], dtype=float)
    bq, cq = float(np.quantile(b, q)), float(np.quantile(c, q))
    if bq <= 0:
        raise AnalysisError(f"paired_change: baseline quantile {q} is {bq} ms; expected > 0")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(keys), size=(n_boot, len(keys)))
    bb = np.quantile(b[idx], q, axis=1)
    cb = np.quantile(c[idx], q, axis=1)
    pct = 100.0 * (1.0 - cb / np.where(bb > 0, bb, np.nan))
    lo, hi = _bounds(pct[np.isfinite(pct)], confidence)
    return PairedChange(q, 100.0 * (1.0 - cq / bq), lo, hi, len(keys), bq, cq)


@dataclass(frozen=True)
class CrossoverEstimate:
    """Where reuse (pull the history back) starts beating recompute, in history tokens.

    ``tokens`` is None when the difference does not change sign over the swept lengths;
    ``side`` then says which way it stayed: ``"reuse_always_faster"`` (crossover at or below the
    shortest length), ``"recompute_always_faster"`` (above the longest), else ``"crossed"``.
    The interval comes from resampling each length's requests (a draw that does not cross counts
    at the grid's edge on its side); there is none when the point estimate has no break-even
    shape (``"no_break_even"``: reuse faster on short histories, slower on long ones)."""

    tokens: float | None
    low_tokens: float | None
    high_tokens: float | None
    side: str
    lengths_tokens: tuple[int, ...]
    diff_p50_ms: tuple[float, ...]
    """Per swept length: median TTFT with reuse on minus median with reuse off (ms)."""


def _first_crossing(lengths: np.ndarray, diff: np.ndarray) -> tuple[float | None, str]:
    """The first length where ``diff`` (on - off) goes from > 0 (recompute faster) to <= 0,
    linearly interpolated; the last sign change is used when it crosses more than once."""
    if np.all(diff <= 0):
        return None, "reuse_always_faster"
    if np.all(diff > 0):
        return None, "recompute_always_faster"
    crossing = None
    for i in range(len(lengths) - 1):
        a, b = diff[i], diff[i + 1]
        if a > 0 >= b:
            crossing = float(lengths[i] + (lengths[i + 1] - lengths[i]) * a / (a - b))
    if crossing is None:  # reuse faster at short lengths, slower at long: no break-even shape
        return None, "no_break_even"
    return crossing, "crossed"


def crossover(on_ms: Mapping[int, Sequence[float]], off_ms: Mapping[int, Sequence[float]], *,
              n_boot: int = N_BOOTSTRAP, confidence: float = CONFIDENCE,
              seed: int = 0) -> CrossoverEstimate:
    """The measured crossover from turn-2 TTFT per history length with reuse forced on / off."""
    lengths = sorted(set(on_ms) & set(off_ms))
    if len(lengths) < 2:
        raise AnalysisError(f"crossover: expected at least 2 history lengths measured with reuse "
                            f"on and off, got {lengths}")
    on = [_clean(on_ms[n], f"crossover: reuse-on TTFT at {n} tokens") for n in lengths]
    off = [_clean(off_ms[n], f"crossover: reuse-off TTFT at {n} tokens") for n in lengths]
    x = np.array(lengths, dtype=float)
    diff = np.array([np.median(a) - np.median(b) for a, b in zip(on, off)])
    point, side = _first_crossing(x, diff)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n_boot):
        d = np.array([np.median(a[rng.integers(0, a.size, a.size)])
                      - np.median(b[rng.integers(0, b.size, b.size)]) for a, b in zip(on, off)])
        c, s = _first_crossing(x, d)
        if c is None:
            c = x[0] if s == "reuse_always_faster" else x[-1] if s == "recompute_always_faster" \
                else np.nan
        draws.append(c)
    arr = np.array(draws, dtype=float)
    arr = arr[np.isfinite(arr)]
    # No interval when the measured curves have no break-even shape (reuse faster on short
    # histories, slower on long ones): the draws that do cross say nothing about where.
    lo, hi = (_bounds(arr, confidence) if arr.size and side != "no_break_even"
              else (None, None))
    return CrossoverEstimate(point, lo, hi, side, tuple(int(n) for n in lengths),
                             tuple(float(d) for d in diff))
