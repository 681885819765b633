"""Statistics of a verification: quantiles with bootstrap intervals, the paired difference of two
configurations' p50, and the measured recompute/pull crossover. Pure functions on numbers.

Bootstraps resample with replacement from a seeded generator, so the same data give the same
interval. A configuration measured once: the paired bootstrap resamples requests (percentile
interval). Measured over several starts of its deployment (the configurations in alternating
order): the workload is a fixed design replayed in every start, not a sample of requests, so the
bootstrap resamples each request's measurements across the starts (the baseline's and the
candidate's from the same start together); a start also carries an offset of its own, which must
not be read as an effect, so the standard error is the larger of the bootstrap's and the one the
spread between the starts' own estimates gives (that spread holds each start's sampling noise
and its offset; the bootstrap stands in where a few starts agree by chance); the interval is
then the estimate +- z standard errors. Every paired change carries the
smallest effect the run could have detected (:func:`detectable_effect_pct`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Final

import numpy as np

from kvtune.errors import AnalysisError

N_BOOTSTRAP: Final = 2000
"""Resamples per interval: enough for stable 2.5/97.5 percentiles at these sample sizes."""
CONFIDENCE: Final = 0.95
MIN_SAMPLES: Final = 2
"""Fewer values than this give no interval (a single request says nothing about spread)."""
POWER: Final = 0.8
"""The power at which :func:`detectable_effect_pct` states the smallest detectable effect."""
TEST_LEVEL: Final = 0.05
"""Two-sided level of that test (the interval's ``1 - CONFIDENCE``)."""


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
    the interval comes from resampling the matched pairs together (paired bootstrap; over several
    starts, the starts too).
    """

    q: float
    faster_pct: float
    low_pct: float
    high_pct: float
    n_pairs: int
    baseline_ms: float
    candidate_ms: float
    detectable_pct: float | None = None
    """The smallest true change (either way) this run would have found with
    :data:`POWER` power at the :data:`TEST_LEVEL` level (:func:`detectable_effect_pct`); None in
    files written before it was measured."""
    starts: int = 1
    """Deployment starts per configuration the pairs came from."""

    @property
    def excludes_zero(self) -> bool:
        return self.low_pct > 0 or self.high_pct < 0


def detectable_effect_pct(boot_pct: np.ndarray | None = None, *, se: float | None = None,
                          power: float = POWER, level: float = TEST_LEVEL) -> float:
    """The smallest effect a two-sided test at ``level`` finds with ``power``: (z(1 - level/2) +
    z(power)) standard errors, the standard error being ``se`` or the spread of the bootstrap
    draws ``boot_pct``."""
    z = NormalDist()
    if se is None:
        if boot_pct is None:
            raise AnalysisError("detectable_effect_pct: expected bootstrap draws or a standard "
                                "error")
        se = float(np.std(boot_pct, ddof=1))
    return float((z.inv_cdf(1.0 - level / 2.0) + z.inv_cdf(power)) * se)


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
                  *, n_boot: int = N_BOOTSTRAP, confidence: float = CONFIDENCE, seed: int = 0,
                  starts: Mapping[str, int] | None = None,
                  units: Mapping[str, str] | None = None) -> PairedChange:
    """``candidate`` against ``baseline`` at quantile ``q`` over the keys both hold (the same
    request of the same workload under each configuration, in the same start).

    ``starts`` (key -> the start it was measured in) and ``units`` (key -> the workload's request
    it measures, the same in every start): with two or more starts, the replicated bootstrap of
    the module doc; else requests are resampled."""
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
    est = 100.0 * (1.0 - cq / bq)
    rng = np.random.default_rng(seed)
    n_starts = len({int(starts.get(k, 0)) for k in keys}) if starts else 1
    if n_starts >= 2:
        lo, hi, se = _replicated_interval(keys, b, c, q, starts or {}, units or {}, est, rng,
                                          n_boot=n_boot, confidence=confidence)
        return PairedChange(q, est, lo, hi, len(keys), bq, cq,
                            detectable_pct=detectable_effect_pct(se=se), starts=n_starts)
    idx = rng.integers(0, len(keys), size=(n_boot, len(keys)))
    bb = np.quantile(b[idx], q, axis=1)
    cb = np.quantile(c[idx], q, axis=1)
    pct = 100.0 * (1.0 - cb / np.where(bb > 0, bb, np.nan))
    pct = pct[np.isfinite(pct)]
    lo, hi = _bounds(pct, confidence)
    return PairedChange(q, est, lo, hi, len(keys), bq, cq,
                        detectable_pct=detectable_effect_pct(pct))


def _replicated_interval(keys: Sequence[str], b: np.ndarray, c: np.ndarray, q: float,
                         starts: Mapping[str, int], units: Mapping[str, str], est: float,
                         rng: np.random.Generator, *, n_boot: int,
                         confidence: float) -> tuple[float, float, float]:
    """(low, high, standard error) of the paired change over several starts: the larger of the
    bootstrap's (each request's (baseline, candidate) pairs resampled across its starts) and the
    standard error of the mean of the starts' own estimates."""
    by_unit: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        by_unit.setdefault(units.get(k, k), []).append(i)
    groups = list(by_unit.values())
    sizes = np.array([len(g) for g in groups])
    flat = np.concatenate([np.array(g) for g in groups])
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    pct = np.empty(n_boot)
    for i in range(n_boot):
        pick = flat[np.repeat(offsets, sizes) + (rng.random(sizes.sum())
                                                 * np.repeat(sizes, sizes)).astype(int)]
        bq, cq = np.quantile(b[pick], q), np.quantile(c[pick], q)
        pct[i] = 100.0 * (1.0 - cq / bq) if bq > 0 else np.nan
    pct = pct[np.isfinite(pct)]
    per_start = []
    for s in sorted({int(starts.get(k, 0)) for k in keys}):
        sel = np.array([int(starts.get(k, 0)) == s for k in keys])
        if sel.sum() >= MIN_SAMPLES and np.quantile(b[sel], q) > 0:
            per_start.append(100.0 * (1.0 - np.quantile(c[sel], q) / np.quantile(b[sel], q)))
    between = float(np.var(per_start, ddof=1)) / len(per_start) if len(per_start) > 1 else 0.0
    se = float(np.sqrt(max(np.var(pct, ddof=1), between)))
    z = NormalDist().inv_cdf(0.5 + confidence / 2.0)
    return est - z * se, est + z * se, se


def median_difference_ci(a: Sequence[float], b: Sequence[float], *, n_boot: int = N_BOOTSTRAP,
                         confidence: float = CONFIDENCE, seed: int = 0
                         ) -> tuple[float, float, float] | None:
    """(median(a) - median(b), its percentile-bootstrap interval), each sample resampled on its
    own; None when either has fewer than :data:`MIN_SAMPLES` finite values."""
    x = np.asarray([float(v) for v in a if v is not None], dtype=float)
    y = np.asarray([float(v) for v in b if v is not None], dtype=float)
    x, y = x[np.isfinite(x)], y[np.isfinite(y)]
    if x.size < MIN_SAMPLES or y.size < MIN_SAMPLES:
        return None
    rng = np.random.default_rng(seed)
    d = (np.median(x[rng.integers(0, x.size, (n_boot, x.size))], axis=1)
         - np.median(y[rng.integers(0, y.size, (n_boot, y.size))], axis=1))
    lo, hi = _bounds(d, confidence)
    return float(np.median(x) - np.median(y)), lo, hi


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
