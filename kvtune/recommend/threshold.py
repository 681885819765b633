"""``kv_recompute_threshold``: the history length above which pulling it back beats recomputing it.

Pulling R tokens costs ``floor + R * c`` (c: ms per token on the wire, from the fit's bandwidth and
per-descriptor cost); recomputing them costs ``R * a + R^2 / 2 * k`` (the prefill's per-token and
attention terms, :meth:`PrefillCost.recompute_ms`). The break-even R solves
``k R^2 + (a - c) R - floor = 0``. Its range comes from the fabric fit's and the prefill fit's
confidence intervals together: the high end where pulling is dearest and recomputing cheapest
(high floor, low bandwidth, high descriptor cost; low per-token and attention terms), the low end
at the opposite corner.
"""
from __future__ import annotations

import math
from dataclasses import replace

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


def recommend_threshold(fit: FloorFit, prefill: PrefillCost, *, bytes_per_token: float,
                        descriptors_per_token: float, max_context_tokens: int,
                        ) -> tuple[Recommendation, list[Finding]]:
    """The threshold (tokens, rounded up) or :data:`NEVER` when break-even lies beyond
    ``max_context_tokens`` (the longest history this traffic offers)."""
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
        floor_ms=fit.floor_ms, bandwidth_gbps=fit.bandwidth_gbps,
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
    )
    assumptions = (
        "pull cost = fitted floor + tokens x bytes_per_token / bandwidth (+ descriptors x "
        "per-descriptor cost), one transfer per history",
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
