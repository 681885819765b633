"""Robust fit of KV transfer time against bytes and descriptors: the fabric's floor and bandwidth.

Model, per transfer ``i``::

    ms_i = floor_ms + bytes_i * 8 / (bandwidth_gbps * 1e9) * 1e3 + descriptors_i * per_descriptor_us / 1e3

fitted by iteratively reweighted least squares on relative residuals, Huber then Tukey bisquare
(outliers, e.g. a transfer that hit a scheduler hiccup, get down-weighted, gross ones to zero,
instead of dragging the line), with the floor and the per-descriptor cost constrained to be >= 0,
with percentile bootstrap confidence intervals resampled *within* each distinct (bytes,
descriptors) point so every bootstrap sample keeps the sweep's design. The floor is the model's
cost at zero bytes and zero descriptors.

When descriptors are constant or proportional to bytes (vLLM's per-block layout), the descriptor
cost cannot be told apart from the bandwidth: the fit then leaves it out and ``per_descriptor_us`` is
``None`` (the bandwidth then includes the per-descriptor cost).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

if TYPE_CHECKING:
    import pandas as pd

from kvtune.errors import AnalysisError

MIN_SIZES = 3
"""Distinct transfer sizes needed: two points fix a line, the third shows whether it is one."""
MIN_POINTS_PER_SIZE = 3
"""Transfers asked for at each new size, so one outlier cannot decide a size's time."""
MIN_POINTS = MIN_SIZES * MIN_POINTS_PER_SIZE
"""Transfers needed in all."""
HUBER_K = 1.345
"""Huber tuning constant (95% efficiency under normal noise)."""
BISQUARE_C = 4.685
"""Tukey bisquare constant (95% efficiency); residuals beyond 4.685 scales get zero weight."""
IRLS_MAX_ITER = 50
IRLS_TOL = 1e-9
MAD_TO_SIGMA = 1.4826
"""Scale of the median absolute deviation to a normal standard deviation."""
COLLINEAR_R2 = 0.999
"""Above this R^2 of descriptors on [1, bytes], the per-descriptor cost is not identifiable."""
CI_LEVEL = 0.95
PROGRESS_MIN_POINT_FITS = 500_000
"""Bootstraps over more point-fits than this (e.g. 200 x 2500 transfers) show a progress bar on a
terminal."""
BOOT_MAX_REDRAWS = 100
"""Whole-sample bootstrap draws with too few sizes are redrawn this often, then stratified."""
RELATIVE_FLOOR_SHARE = 0.1
"""Relative residuals divide by the fitted time, clamped at 10% of the smallest observed time."""
OUTLIER_WEIGHT = 0.5
"""A point whose final Huber weight is below this is counted as an outlier in ``n_outliers``."""

_BYTES_SCALE = 1e9  # fit in GB and thousands of descriptors, for conditioning
_DESC_SCALE = 1e3


@dataclass(frozen=True)
class FloorFit:
    """The fabric's fixed cost and bandwidth, with 95% bootstrap intervals.

    ``bandwidth_gbps`` is in gigabits per second (1e9 bit/s). ``per_descriptor_us`` is ``None`` when
    descriptors do not vary independently of bytes. ``r2`` is the robust-weighted coefficient of
    determination. ``n_outliers`` counts transfers the robust fit down-weighted below 0.5.
    """

    floor_ms: float
    bandwidth_gbps: float
    per_descriptor_us: float | None
    floor_ci_ms: tuple[float, float]
    bandwidth_ci_gbps: tuple[float, float]
    per_descriptor_ci_us: tuple[float, float] | None
    r2: float
    n_transfers: int
    n_sizes: int
    source: str = ""
    n_outliers: int = 0
    column: str = "critical_ms"

    def predict_ms(self, bytes: float, descriptors: float = 0) -> float:  # shadows bytes(): named for its unit
        """Predicted transfer time (ms) of ``bytes`` bytes in ``descriptors`` descriptors."""
        ms = self.floor_ms + float(bytes) * 8.0 / (self.bandwidth_gbps * 1e9) * 1e3
        if self.per_descriptor_us is not None:
            ms += float(descriptors) * self.per_descriptor_us / 1e3
        return ms

    def as_dict(self) -> dict:
        """Plain-JSON form (tuples become lists)."""
        return {
            "floor_ms": self.floor_ms, "bandwidth_gbps": self.bandwidth_gbps,
            "per_descriptor_us": self.per_descriptor_us, "floor_ci_ms": list(self.floor_ci_ms),
            "bandwidth_ci_gbps": list(self.bandwidth_ci_gbps),
            "per_descriptor_ci_us": (list(self.per_descriptor_ci_us)
                                     if self.per_descriptor_ci_us is not None else None),
            "r2": self.r2, "n_transfers": self.n_transfers, "n_sizes": self.n_sizes,
            "source": self.source, "n_outliers": self.n_outliers, "column": self.column,
        }

    @classmethod
    def from_dict(cls, d: dict) -> FloorFit:
        """The inverse of :meth:`as_dict` (lists become tuples); a missing field raises KeyError."""
        def pair(v: Any) -> tuple[float, float] | None:
            return None if v is None else (v[0], v[1])

        def unbounded(v: Any) -> float:
            # A bandwidth the fit could not bound above (slope interval reaching 0) is infinite;
            # strict JSON writes it as null.
            return math.inf if v is None else v

        bw_ci = d["bandwidth_ci_gbps"]
        return cls(floor_ms=d["floor_ms"], bandwidth_gbps=unbounded(d["bandwidth_gbps"]),
                   per_descriptor_us=d["per_descriptor_us"], floor_ci_ms=pair(d["floor_ci_ms"]),
                   bandwidth_ci_gbps=(unbounded(bw_ci[0]), unbounded(bw_ci[1])),
                   per_descriptor_ci_us=pair(d["per_descriptor_ci_us"]), r2=d["r2"],
                   n_transfers=d["n_transfers"], n_sizes=d["n_sizes"], source=d["source"],
                   n_outliers=d["n_outliers"], column=d["column"])


def _irls(x: np.ndarray, y: np.ndarray, beta: np.ndarray, floor_y: float, weight, *,
          scale: float | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """Iteratively reweighted least squares on relative residuals with ``weight(u)``; the scale is
    re-estimated (MAD) each step unless given. Returns (beta, weights, scale)."""
    w = np.ones_like(y)
    s = scale or 1e-12
    for _ in range(IRLS_MAX_ITER):
        fitted = np.maximum(x @ beta, floor_y)
        rel = (y - fitted) / fitted
        if scale is None:
            s = MAD_TO_SIGMA * float(np.median(np.abs(rel - np.median(rel))))
            if s <= 0.0 or not math.isfinite(s):
                s = float(np.std(rel)) or 1e-12
        w = weight(np.abs(rel) / s)
        if not np.any(w > 0):
            break
        sw = np.sqrt(w) / fitted
        new, *_ = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)
        done = np.max(np.abs(new - beta)) <= IRLS_TOL * (1.0 + np.max(np.abs(beta)))
        beta = new
        if done:
            break
    return beta, w, s


def _huber_w(u: np.ndarray) -> np.ndarray:
    return np.where(u <= HUBER_K, 1.0, HUBER_K / np.maximum(u, 1e-300))


def _bisquare_w(u: np.ndarray) -> np.ndarray:
    return np.where(u < BISQUARE_C, (1.0 - (u / BISQUARE_C) ** 2) ** 2, 0.0)


def robust_irls(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Robust fit of ``y ~ x @ beta`` on *relative* residuals (timing noise grows with the time:
    a 2% wobble on a 100 ms transfer is not an outlier, 25 ms on a 2 ms one is): Huber IRLS from
    least squares, then Tukey bisquare from the Huber fit with the Huber scale fixed, so gross
    one-sided outliers (stalls) get zero weight instead of a small bias. Returns (beta, weights);
    the weights are the bisquare ones."""
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    floor_y = max(float(np.min(y[y > 0])) if np.any(y > 0) else 1.0, 1e-9) * RELATIVE_FLOOR_SHARE
    beta, _, scale = _irls(x, y, beta, floor_y, _huber_w)
    beta_b, w_b, _ = _irls(x, y, beta, floor_y, _bisquare_w, scale=scale)
    kept = x[w_b > 0]
    # the bisquare may only drop points, never the design: the kept ones must still fix every term
    if len(kept) > x.shape[1] and np.linalg.matrix_rank(kept) == x.shape[1]:
        return beta_b, w_b
    return beta, _huber_w(np.abs((y - np.maximum(x @ beta, floor_y)) / np.maximum(x @ beta, floor_y))
                          / scale)


def nonneg_irls(x: np.ndarray, y: np.ndarray,
                nonneg: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`robust_irls` with the coefficients in ``nonneg`` constrained to be >= 0 (a cost
    cannot be negative): the most negative of them is fixed at 0 and the rest refitted, until none
    is. Returns the full coefficient vector (zeros where fixed) and the weights."""
    active = list(range(x.shape[1]))
    while True:
        b_act, w = robust_irls(x[:, active], y)
        neg = [(b_act[i], i) for i, col in enumerate(active) if col in nonneg and b_act[i] < 0]
        if not neg or len(active) == 1:
            break
        active.pop(min(neg)[1])
    beta = np.zeros(x.shape[1])
    beta[active] = b_act
    return beta, w


def _design(b: np.ndarray, d: np.ndarray, with_desc: bool) -> np.ndarray:
    cols = [np.ones_like(b), b / _BYTES_SCALE]
    if with_desc:
        cols.append(d / _DESC_SCALE)
    return np.column_stack(cols)


def _descriptors_identifiable(b: np.ndarray, d: np.ndarray) -> bool:
    if np.ptp(d) == 0:
        return False
    x = _design(b, d, with_desc=False)
    coef, *_ = np.linalg.lstsq(x, d / _DESC_SCALE, rcond=None)
    resid = d / _DESC_SCALE - x @ coef
    tot = float(np.sum((d / _DESC_SCALE - np.mean(d / _DESC_SCALE)) ** 2))
    return tot > 0 and 1.0 - float(np.sum(resid ** 2)) / tot < COLLINEAR_R2


def _check_design(b: np.ndarray) -> None:
    """Raise unless there are >= MIN_SIZES distinct sizes and >= MIN_POINTS transfers; say what to
    add (a probe sweep has few sizes with many repeats, a serving trace many sizes with one each:
    both fit)."""
    sizes, counts = np.unique(b, return_counts=True)
    if len(sizes) >= MIN_SIZES and len(b) >= MIN_POINTS:
        return
    todo: list[str] = []
    need_sizes = MIN_SIZES - len(sizes)
    if need_sizes > 0:
        todo += [f"{MIN_POINTS_PER_SIZE - int(c)} more at {int(s)} B"
                 for s, c in zip(sizes, counts) if c < MIN_POINTS_PER_SIZE]
        top = int(sizes.max()) if len(sizes) else 0
        # alternate above and below what is there: 4x, 1/4x, 16x, 1/16x ...
        picks = [top * 4 ** (k // 2 + 1) if k % 2 == 0 else max(top // 4 ** (k // 2 + 1), 1)
                 for k in range(need_sizes)]
        hint = (" (e.g. " + " and ".join(f"{p} B" for p in picks) + "; `kvtune probe run` sweeps "
                "sizes)" if top > 0 else "")
        todo.append(f"{MIN_POINTS_PER_SIZE} each at {need_sizes} new distinct size(s){hint}")
    else:
        todo.append(f"{MIN_POINTS - len(b)} more transfer(s) at these or other sizes")
    have = ", ".join(f"{int(s)} B x{int(c)}" for s, c in zip(sizes, counts)) or "none"
    raise AnalysisError(
        f"cannot fit floor and bandwidth: {len(b)} transfer(s) at {len(sizes)} distinct size(s) "
        f"[{have[:400]}]; need >= {MIN_SIZES} distinct sizes and >= {MIN_POINTS} transfers: "
        f"add {'; '.join(todo)}")


def _params(beta: np.ndarray, with_desc: bool) -> tuple[float, float, float | None]:
    """(floor_ms, ms per byte, us per descriptor) from the scaled coefficients."""
    floor = float(beta[0])
    ms_per_byte = float(beta[1]) / _BYTES_SCALE
    us_per_desc = float(beta[2]) / _DESC_SCALE * 1e3 if with_desc else None
    return floor, ms_per_byte, us_per_desc


def _gbps(ms_per_byte: float) -> float:
    """Bandwidth in Gbit/s from a slope in ms per byte (inf for a non-positive slope)."""
    return 8.0 / (ms_per_byte * 1e-3) / 1e9 if ms_per_byte > 0 else math.inf


def _ci(values: np.ndarray) -> tuple[float, float]:
    a = (1.0 - CI_LEVEL) / 2.0
    lo, hi = np.quantile(values, [a, 1.0 - a])
    return float(lo), float(hi)


def fit_floor_points(bytes: Sequence[float] | np.ndarray,  # shadows bytes(): named for its unit
                     descriptors: Sequence[float] | np.ndarray | None,
                     ms: Sequence[float] | np.ndarray, *, n_boot: int = 200, seed: int = 0,
                     source: str = "", column: str = "critical_ms") -> FloorFit:
    """Fit ``ms ~ floor + bytes/bandwidth + descriptors*per_descriptor`` robustly (see module doc).

    ``descriptors`` may be ``None`` (no descriptor term). Raises :class:`AnalysisError` when there
    are fewer than ``MIN_SIZES`` distinct sizes or ``MIN_POINTS`` transfers (saying how many more
    of which sizes are needed), on non-finite or negative inputs, or when time does not grow with
    bytes.
    """
    b = np.asarray(bytes, dtype=float)
    y = np.asarray(ms, dtype=float)
    d = np.zeros_like(b) if descriptors is None else np.asarray(descriptors, dtype=float)
    if not (b.shape == y.shape == d.shape) or b.ndim != 1:
        raise AnalysisError(f"fit_floor_points: bytes, descriptors and ms must be 1-D of one length, "
                            f"got shapes {b.shape}, {d.shape}, {y.shape}")
    for name, arr in (("bytes", b), ("descriptors", d), (column, y)):
        bad = ~np.isfinite(arr) | (arr < 0)
        if bad.any():
            raise AnalysisError(f"fit_floor_points: {name}: expected finite values >= 0, "
                                f"got {int(bad.sum())} bad of {len(arr)} (first: {arr[bad][0]!r})")
    _check_design(b)
    with_desc = descriptors is not None and _descriptors_identifiable(b, d)
    x = _design(b, d, with_desc)
    nonneg = (0, 2) if with_desc else (0,)  # floor and per-descriptor cost
    beta, w = nonneg_irls(x, y, nonneg)
    floor, ms_per_byte, us_per_desc = _params(beta, with_desc)
    if ms_per_byte <= 0:
        raise AnalysisError(
            f"fit_floor_points: {column} does not grow with bytes (slope {ms_per_byte:.3g} ms/B over "
            f"{len(np.unique(b))} sizes from {int(b.min())} to {int(b.max())} B): the sizes are too "
            f"close together for this noise; add transfers at sizes >= 16x {int(b.max())} B")
    # R^2 in the fit's own metric: relative residuals with the robust weights (>= 0 for WLS).
    fitted = x @ beta
    wr = w / np.maximum(fitted, RELATIVE_FLOOR_SHARE * max(float(np.min(y[y > 0]))
                                                           if np.any(y > 0) else 1.0, 1e-9)) ** 2
    ybar = float(np.sum(wr * y) / np.sum(wr)) if np.sum(wr) > 0 else float(np.mean(y))
    ss_tot = float(np.sum(wr * (y - ybar) ** 2))
    r2 = 1.0 - float(np.sum(wr * (y - fitted) ** 2)) / ss_tot if ss_tot > 0 else 0.0

    rng = np.random.default_rng(seed)
    keys = np.column_stack([b, d])
    _, group = np.unique(keys, axis=0, return_inverse=True)
    group = group.ravel()
    counts = np.bincount(group)
    order = np.argsort(group, kind="stable")
    g_sorted = group[order]
    starts = (np.cumsum(counts) - counts)[g_sorted]
    sizes = counts[g_sorted]

    def stratified_draw() -> np.ndarray:  # resample within each (bytes, descriptors) point
        return order[starts + (rng.random(len(order)) * sizes).astype(np.int64)]

    # A sweep (few sizes, many repeats) is resampled within each size so every sample keeps the
    # design; a serving trace (many sizes, one or two each) is resampled as a whole.
    stratified = float(np.median(counts)) >= MIN_POINTS_PER_SIZE
    boots = np.empty((max(n_boot, 0), x.shape[1]))
    small = len(boots) * len(y) < PROGRESS_MIN_POINT_FITS
    for i in tqdm(range(len(boots)), desc="kvtune fit bootstrap", unit="fit", leave=False,
                  disable=True if small else None):
        if stratified:
            idx = stratified_draw()
        else:
            for _ in range(BOOT_MAX_REDRAWS):  # a sample must keep enough sizes to fit
                idx = rng.integers(0, len(y), len(y))
                if len(np.unique(b[idx])) >= MIN_SIZES:
                    break
            else:
                idx = stratified_draw()
        boots[i], _ = nonneg_irls(x[idx], y[idx], nonneg)
    if len(boots):
        floors = boots[:, 0]
        slopes = boots[:, 1] / _BYTES_SCALE
        floor_ci = _ci(floors)
        s_lo, s_hi = _ci(slopes)
        bw_ci = (_gbps(s_hi), _gbps(s_lo))
        desc_ci = _ci(boots[:, 2] / _DESC_SCALE * 1e3) if with_desc else None
    else:
        floor_ci, bw_ci = (floor, floor), (_gbps(ms_per_byte),) * 2
        desc_ci = (us_per_desc, us_per_desc) if with_desc else None
    return FloorFit(
        floor_ms=floor, bandwidth_gbps=_gbps(ms_per_byte), per_descriptor_us=us_per_desc,
        floor_ci_ms=floor_ci, bandwidth_ci_gbps=bw_ci, per_descriptor_ci_us=desc_ci,
        r2=r2, n_transfers=int(len(y)), n_sizes=int(len(np.unique(b))), source=source,
        n_outliers=int(np.sum(w < OUTLIER_WEIGHT)), column=column)


def fit_floor(transfers: pd.DataFrame, *, column: str = "critical_ms", n_boot: int = 200,
              seed: int = 0, fabric: str | None = None, op: str | None = None,
              source: str = "") -> FloorFit:
    """Fit the floor and bandwidth from a transfers table (``kvtune.analysis.transfers``).

    Uses rows with ``column`` and ``bytes`` present and a status other than ERROR. Descriptors
    enter the model only when every used row has them. A table mixing fabrics needs ``fabric`` to
    pick one, and one mixing NIXL operations ``op`` (``READ``/``WRITE``): the floors of two fabrics
    or two operations are not one number.
    """

    for c in (column, "bytes", "descriptors", "status", "fabric", "op"):
        if c not in transfers.columns:
            raise AnalysisError(f"fit_floor: transfers table has no column {c!r}; expected "
                                f"kvtune.analysis.TRANSFER_COLUMNS")
    t = transfers
    fabrics = sorted(set(t["fabric"].dropna().astype(str)))
    if fabric is not None:
        t = t[t["fabric"] == fabric]
        if t.empty:
            raise AnalysisError(f"fit_floor: no transfers on fabric {fabric!r}; fabrics: {fabrics}")
    elif len(fabrics) > 1:
        raise AnalysisError(f"fit_floor: transfers on {len(fabrics)} fabrics {fabrics}; pass "
                            f"fabric=... to fit one (each has its own floor)")
    ops = sorted(set(t["op"].dropna().astype(str)))
    if op is not None:
        t = t[(t["op"] == op).fillna(False).to_numpy(dtype=bool)]
        if t.empty:
            raise AnalysisError(f"fit_floor: no transfers with op {op!r}; ops: {ops}")
    elif len(ops) > 1:
        raise AnalysisError(f"fit_floor: transfers mix NIXL operations {ops}; pass op=... to fit "
                            f"one (READ and WRITE have their own floor)")
    ok = t[column].notna() & t["bytes"].notna() & (t["status"].astype("object") != "ERROR")
    t = t[ok.to_numpy(dtype=bool)]
    if t.empty:
        raise AnalysisError(f"fit_floor: no transfer has both {column!r} and bytes (of "
                            f"{len(transfers)} transfer(s)); need >= {MIN_POINTS} transfers at "
                            f">= {MIN_SIZES} distinct sizes")
    desc = None
    if t["descriptors"].notna().all():
        desc = t["descriptors"].to_numpy(dtype=float)
    return fit_floor_points(t["bytes"].to_numpy(dtype=float), desc,
                            t[column].to_numpy(dtype=float), n_boot=n_boot, seed=seed,
                            source=source, column=column)


def fit_floor_medians(bytes: Sequence[float] | np.ndarray,  # shadows bytes(): named for its unit
                      ms: Sequence[float] | np.ndarray, counts: Sequence[float] | np.ndarray, *,
                      source: str = "", column: str = "rdma_ms") -> FloorFit:
    """Fit ``ms ~ floor + bytes/bandwidth`` to one median time per size (e.g. Tempo's
    ``quantile_over_time`` p50 by ``kv.bytes``), each weighted by its transfer count.

    Least squares on relative residuals, as :func:`fit_floor_points` (a median of ``n`` transfers
    has a variance about ``ms**2 / n`` under relative noise: weight ``n / ms**2``), with the floor
    held >= 0; no robust reweighting (a median is already robust) and no bootstrap (there are no
    samples to resample): the intervals are the point (``n_outliers`` 0). Raises
    :class:`AnalysisError` below :data:`MIN_SIZES` sizes or :data:`MIN_POINTS` transfers, or when
    the time does not grow with bytes."""
    b = np.asarray(bytes, dtype=float)
    y = np.asarray(ms, dtype=float)
    n = np.asarray(counts, dtype=float)
    if not (b.shape == y.shape == n.shape) or b.ndim != 1:
        raise AnalysisError(f"fit_floor_medians: bytes, ms and counts must be 1-D of one length, "
                            f"got shapes {b.shape}, {y.shape}, {n.shape}")
    keep = np.isfinite(b) & np.isfinite(y) & np.isfinite(n) & (n > 0) & (y > 0) & (b >= 0)
    b, y, n = b[keep], y[keep], n[keep]
    if len(np.unique(b)) < MIN_SIZES or n.sum() < MIN_POINTS:
        have = ", ".join(f"{int(s)} B x{int(c)}" for s, c in zip(b, n)) or "none"
        raise AnalysisError(f"cannot fit floor and bandwidth from medians: {int(n.sum())} "
                            f"transfer(s) at {len(np.unique(b))} distinct size(s) [{have[:400]}]; "
                            f"need >= {MIN_SIZES} distinct sizes and >= {MIN_POINTS} transfers")
    x = _design(b, b, with_desc=False)
    sw = np.sqrt(n) / y
    beta, *_ = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)
    if beta[0] < 0:  # a cost cannot be negative: through the origin
        slope, *_ = np.linalg.lstsq(x[:, 1:] * sw[:, None], y * sw, rcond=None)
        beta = np.array([0.0, float(slope[0])])
    floor, ms_per_byte, _ = _params(beta, with_desc=False)
    if ms_per_byte <= 0:
        raise AnalysisError(f"fit_floor_medians: {column} does not grow with bytes (slope "
                            f"{ms_per_byte:.3g} ms/B over sizes {int(b.min())} .. {int(b.max())} B)")
    fitted = x @ beta
    wr = n / y ** 2
    ybar = float(np.sum(wr * y) / np.sum(wr))
    ss_tot = float(np.sum(wr * (y - ybar) ** 2))
    r2 = 1.0 - float(np.sum(wr * (y - fitted) ** 2)) / ss_tot if ss_tot > 0 else 0.0
    bw = _gbps(ms_per_byte)
    return FloorFit(floor_ms=floor, bandwidth_gbps=bw, per_descriptor_us=None,
                    floor_ci_ms=(floor, floor), bandwidth_ci_gbps=(bw, bw),
                    per_descriptor_ci_us=None, r2=r2, n_transfers=int(n.sum()),
                    n_sizes=int(len(np.unique(b))), source=source, n_outliers=0, column=column)
