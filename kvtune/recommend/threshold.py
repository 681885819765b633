"""``kv_recompute_threshold``: the history length above which pulling it back beats recomputing it.

Pulling R tokens costs ``floor + pickup + R * c`` (c: ms per token on the wire, from the fit's
bandwidth and per-descriptor cost; pickup: the wait from the READ done to the engine's next step
taking the request up, :class:`Pickup`); recomputing them costs ``R * a + R^2 / 2 * k`` (the prefill's per-token and
attention terms, :meth:`PrefillCost.recompute_ms`). The break-even R solves
``k R^2 + (a - c) R - floor = 0``. Its range comes from the fabric fit's and the prefill fit's
confidence intervals together: the high end where pulling is dearest and recomputing cheapest
(high floor, low bandwidth, high descriptor cost; low per-token and attention terms), the low end
at the opposite corner.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final

import numpy as np

from kvtune.analysis.fit import FloorFit
from kvtune.analysis.prefill import PrefillCost
from kvtune.recommend.evidence import ThresholdEvidence
from kvtune.recommend.results import NEVER, Finding, Recommendation
from kvtune.vllm_pd import KV_RECOMPUTE_THRESHOLD

NAME = KV_RECOMPUTE_THRESHOLD
UNIT = "tokens"


def wire_ms_per_token(bandwidth_gbps: float, per_descriptor_us: float | None,
                      bytes_per_token: float, descriptors_per_token: float) -> float:
    """Transfer time per token (ms) beyond the floor."""
    ms = bytes_per_token * 8.0 / (bandwidth_gbps * 1e9) * 1e3
    if per_descriptor_us is not None:
        ms += descriptors_per_token * per_descriptor_us / 1e3
    return ms


def break_even_tokens(floor_ms: float, wire_ms_per_tok: float, prefill: PrefillCost) -> float:
    """Smallest R (tokens, real) at which pulling costs no more than recomputing; ``inf`` if never."""
    a = prefill.per_token_ms
    k = prefill.per_token_prefix_us / 1e3 / 2000.0  # ms per token^2 (R^2/2 per 1000 tokens)
    b = a - wire_ms_per_tok
    if floor_ms <= 0:
        return 0.0 if (b >= 0 or k > 0) else math.inf
    if k > 0:
        return (-b + math.sqrt(b * b + 4.0 * k * floor_ms)) / (2.0 * k)
    return floor_ms / b if b > 0 else math.inf


@dataclass(frozen=True)
class Pickup:
    """A pulled-back history's wait from its READ done to the engine's next step scheduling the
    request: vLLM notices finished transfers once per step, as it does for a decode's pull
    (measured there as ``kv.decode_start``). The fabric floor does not hold it; serving pays it on
    every pull (the lab's paired sweep measured pull ~1.3 ms dearer at one block than the floor
    priced it, about the decode's median ``kv.decode_start``)."""

    ms: float
    ci_ms: tuple[float, float]
    n: int
    source: str


PICKUP_MIN_SAMPLES: Final = 8
"""Fewer measured pickups than this and none is priced (the floor alone, as before)."""


def pickup_of(first_step_ms: Sequence[float], *, n_boot: int = 200, seed: int = 0,
              what: str = "kv.decode_start") -> Pickup | None:
    """The median of measured KV-ready -> scheduled waits with a bootstrap 95% interval; None
    with fewer than :data:`PICKUP_MIN_SAMPLES` finite values."""
    x = np.asarray([float(v) for v in first_step_ms], dtype=float)
    x = x[np.isfinite(x) & (x >= 0)]
    if x.size < PICKUP_MIN_SAMPLES:
        return None
    rng = np.random.default_rng(seed)
    boots = np.median(x[rng.integers(0, x.size, size=(n_boot, x.size))], axis=1)
    lo, hi = (float(v) for v in np.quantile(boots, [0.025, 0.975]))
    return Pickup(float(np.median(x)), (lo, hi), int(x.size),
                  f"measured: KV ready -> scheduled ({what} median of {x.size} transfers); a "
                  f"pulled-back history waits for the prefill's next step the same way")


def recommend_threshold(fit: FloorFit, prefill: PrefillCost, *, bytes_per_token: float,
                        descriptors_per_token: float, max_context_tokens: int,
                        pickup: Pickup | None = None,
                        ) -> tuple[Recommendation, list[Finding]]:
    """The threshold (tokens, rounded up) or :data:`NEVER` when break-even lies beyond
    ``max_context_tokens`` (the longest history this traffic offers). ``pickup`` (None: not
    priced) is added to the floor, its interval to the floor's."""
    if pickup is not None:
        fit = replace(fit, floor_ms=fit.floor_ms + pickup.ms,
                      floor_ci_ms=(fit.floor_ci_ms[0] + pickup.ci_ms[0],
                                   fit.floor_ci_ms[1] + pickup.ci_ms[1]))
    c = wire_ms_per_token(fit.bandwidth_gbps, fit.per_descriptor_us, bytes_per_token,
                          descriptors_per_token)
    r = break_even_tokens(fit.floor_ms, c, prefill)
    desc_ci = fit.per_descriptor_ci_us or (fit.per_descriptor_us, fit.per_descriptor_us)
    c_hi = wire_ms_per_token(fit.bandwidth_ci_gbps[0], desc_ci[1], bytes_per_token,
                             descriptors_per_token)
    c_lo = wire_ms_per_token(fit.bandwidth_ci_gbps[1], desc_ci[0], bytes_per_token,
                             descriptors_per_token)
    cheap, dear = _prefill_corners(prefill)  # recomputing cheapest / dearest
    r_hi = break_even_tokens(fit.floor_ci_ms[1], c_hi, cheap)
    r_lo = break_even_tokens(fit.floor_ci_ms[0], c_lo, dear)

    def tok(x: float) -> int | str:
        return NEVER if not math.isfinite(x) or x > max_context_tokens else max(1, math.ceil(x))

    def real(x: float) -> float | None:
        return x if math.isfinite(x) else None

    evidence = ThresholdEvidence(
        break_even_tokens=real(r),
        floor_ms=fit.floor_ms - (pickup.ms if pickup is not None else 0.0),
        bandwidth_gbps=fit.bandwidth_gbps,
        per_descriptor_us=fit.per_descriptor_us, bytes_per_token=bytes_per_token,
        descriptors_per_token=descriptors_per_token, wire_ms_per_token=c,
        prefill_per_token_ms=prefill.per_token_ms,
        prefill_per_token_prefix_us=prefill.per_token_prefix_us,
        max_context_tokens=max_context_tokens, fit_r2=fit.r2,
        fit_n_transfers=fit.n_transfers, prefill_n_observations=prefill.n_observations,
        pull_ms_at_break_even=fit.floor_ms + r * c if math.isfinite(r) else None,
        recompute_ms_at_break_even=prefill.recompute_ms(r) if math.isfinite(r) else None,
        prefill_per_token_ci_ms=prefill.per_token_ci_ms,
        prefill_per_token_prefix_ci_us=prefill.per_token_prefix_ci_us,
        break_even_range_fabric_tokens=(
            real(break_even_tokens(fit.floor_ci_ms[0], c_lo, prefill)),
            real(break_even_tokens(fit.floor_ci_ms[1], c_hi, prefill))),
        break_even_range_prefill_tokens=(real(break_even_tokens(fit.floor_ms, c, dear)),
                                         real(break_even_tokens(fit.floor_ms, c, cheap))),
        pickup_ms=pickup.ms if pickup is not None else None,
        pickup_ci_ms=pickup.ci_ms if pickup is not None else None,
        pickup_source=pickup.source if pickup is not None else None,
    )
    assumptions = (
        "pull cost = fitted floor + tokens x bytes_per_token / bandwidth (+ descriptors x "
        "per-descriptor cost), one transfer per history"
        + (" + the engine's pickup of the finished READ (its next step)" if pickup is not None
           else "; the engine's pickup of the finished READ not measured, not priced"),
        "recompute cost = the fitted prefill per-token and attention terms for the history alone "
        "(the new tokens' cost is paid either way)",
        "range from the fabric fit's and the prefill fit's 95% intervals together (the corners "
        "where pulling is dearest and recomputing cheapest, and the opposite)"
        + ("" if prefill.per_token_ci_ms is not None else
           "; the prefill fit gave no interval, so only the fabric fit's uncertainty is included"),
        f"'{NEVER}' when break-even exceeds the longest history seen ({max_context_tokens} tokens)",
    )
    value = tok(r)
    findings: list[Finding] = []
    if value == NEVER:
        findings.append(Finding(
            "reuse_never_pays", "warning",
            f"pulling history back never beats recomputing it on this traffic: break-even "
            f"{'is never reached' if not math.isfinite(r) else f'is {r:.0f} tokens'}, longer than "
            f"the longest history seen ({max_context_tokens} tokens) (floor {fit.floor_ms:.3g} ms, "
            f"{c * 1e3:.3g} us/token on the wire vs {prefill.per_token_ms * 1e3:.3g} us/token to "
            f"recompute); keep bidirectional KV transfer off",
            {"break_even_tokens": r if math.isfinite(r) else None,
             "max_context_tokens": max_context_tokens}))
    rec = Recommendation(NAME, value, (tok(r_lo), tok(r_hi)), UNIT, evidence, assumptions)
    return rec, findings


def _prefill_corners(prefill: PrefillCost) -> tuple[PrefillCost, PrefillCost]:
    """(cheapest, dearest) recompute cost within the prefill fit's 95% intervals (the fit itself
    twice when it has none)."""
    a_ci = prefill.per_token_ci_ms or (prefill.per_token_ms, prefill.per_token_ms)
    k_ci = prefill.per_token_prefix_ci_us or (prefill.per_token_prefix_us,
                                              prefill.per_token_prefix_us)
    return (replace(prefill, per_token_ms=a_ci[0], per_token_prefix_us=k_ci[0]),
            replace(prefill, per_token_ms=a_ci[1], per_token_prefix_us=k_ci[1]))
