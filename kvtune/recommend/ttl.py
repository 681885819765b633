"""``decoder_kv_blocks_ttl``: how long the decode keeps a conversation's KV for its next turn.

A next turn is reused only if it arrives within the router's TTL (the decode's TTL minus the
router's margin) and its history is at least the threshold. Retained blocks cost HBM for
``min(gap, TTL)`` after every turn and for the full TTL after a conversation's last turn; by Little's
law the mean HBM held is ``bytes_per_token * sum(tokens * held_s) / duration_s``. The TTL is the
smallest one capturing every reusable gap (plus slack), lowered until ``PEAK_TO_MEAN`` times the
mean fits the HBM budget. The range is a bootstrap over conversations' gaps.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from kvtune.analysis.workload import Workload
from kvtune.recommend.evidence import TtlEvidence
from kvtune.recommend.results import Finding, Recommendation
from kvtune.vllm_pd import (DECODER_KV_BLOCKS_TTL, decoder_ttl_for_router_ttl_s, router_margin_s,
                             router_ttl_s)

NAME = DECODER_KV_BLOCKS_TTL
UNIT = "s"
GAP_SLACK_SHARE = 0.1
"""The router TTL covers the longest reusable gap plus 10% (the next day's gaps are not these)."""
PEAK_TO_MEAN = 2.0
"""Retained HBM is bursty (arrivals cluster); budget for twice the Little's-law mean."""
NO_MULTI_TURN_TTL_S = 0
"""TTL when no conversation has a second turn: retain nothing."""
N_BOOT = 200
CI = (2.5, 97.5)


def retained_gb(ttl_s: float, gaps_s: np.ndarray, gap_tokens: np.ndarray,
                final_tokens: np.ndarray, bytes_per_token: float, duration_s: float) -> float:
    """Mean decode HBM (GB, 1e9 bytes) held by retained history at ``ttl_s`` (Little's law)."""
    if duration_s <= 0:
        return math.inf if (len(gaps_s) or len(final_tokens)) and ttl_s > 0 else 0.0
    token_s = float(np.sum(gap_tokens * np.minimum(gaps_s, ttl_s)) + np.sum(final_tokens) * ttl_s)
    return bytes_per_token * token_s / duration_s / 1e9


def _ttl_for(gaps: np.ndarray, toks: np.ndarray, finals: np.ndarray, threshold: float,
             bytes_per_token: float, duration_s: float, budget_gb: float) -> tuple[float, float, float]:
    """(ttl_s, uncapped ttl_s, memory-capped max ttl_s) for one sample of gaps."""
    reusable = toks >= threshold
    if not reusable.any():
        return float(NO_MULTI_TURN_TTL_S), float(NO_MULTI_TURN_TTL_S), math.inf
    router_ttl = float(gaps[reusable].max()) * (1.0 + GAP_SLACK_SHARE)
    want = decoder_ttl_for_router_ttl_s(router_ttl)

    def mem(t: float) -> float:
        return PEAK_TO_MEAN * retained_gb(t, gaps, toks, finals, bytes_per_token, duration_s)

    if mem(want) <= budget_gb:
        return want, want, math.inf
    lo, hi = 0.0, want  # mem is increasing in t: bisect for the largest t within budget
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mem(mid) <= budget_gb else (lo, mid)
    return lo, want, lo


def captured_share(ttl_s: float, gaps: np.ndarray, toks: np.ndarray, threshold: float) -> float:
    """Share of reusable history tokens whose next turn comes within the router's TTL."""
    reusable = toks >= threshold
    total = float(np.sum(toks[reusable]))
    if total <= 0:
        return 0.0
    within = reusable & (gaps <= router_ttl_s(ttl_s))
    return float(np.sum(toks[within])) / total


def recommend_ttl(workload: Workload, *, bytes_per_token: float, hbm_budget_gb: float,
                  threshold_tokens: float, seed: int = 0) -> tuple[Recommendation, list[Finding]]:
    """The TTL in whole seconds with its bootstrap range (see module doc)."""
    gaps = np.asarray(workload.gaps_s, dtype=float)
    toks = np.asarray(workload.gap_tokens, dtype=float) if workload.gap_tokens else np.zeros(len(gaps))
    finals = np.asarray(workload.final_tokens, dtype=float)
    thr = float(threshold_tokens) if math.isfinite(float(threshold_tokens)) else math.inf
    assumptions = (
        "a next turn is reused when it arrives within the router TTL (decode TTL minus the "
        "router margin) and its history is >= the threshold",
        f"HBM held = {PEAK_TO_MEAN:g} x the Little's-law mean of retained tokens x bytes_per_token "
        f"(retained for min(gap, TTL) after each turn, the full TTL after the last)",
        "future inter-turn gaps look like the traced ones",
    )
    base = TtlEvidence(n_gaps=int(len(gaps)), hbm_budget_gb=hbm_budget_gb,
                       bytes_per_token=bytes_per_token, threshold_tokens=threshold_tokens,
                       duration_s=workload.duration_s, peak_to_mean=PEAK_TO_MEAN)
    findings: list[Finding] = []
    if len(gaps) == 0:
        findings.append(Finding(
            "no_multi_turn", "info",
            f"no conversation in the trace has a second turn ({workload.n_requests} request(s), "
            f"{workload.n_conversations} conversation(s)): nothing is worth retaining, so the TTL is "
            f"{NO_MULTI_TURN_TTL_S} s and bidirectional KV transfer stays off",
            {"n_requests": workload.n_requests, "n_conversations": workload.n_conversations}))
        return Recommendation(NAME, NO_MULTI_TURN_TTL_S, (NO_MULTI_TURN_TTL_S, NO_MULTI_TURN_TTL_S),
                              UNIT, base, assumptions), findings

    ttl, want, cap = _ttl_for(gaps, toks, finals, thr, bytes_per_token, workload.duration_s,
                              hbm_budget_gb)
    value = int(math.floor(ttl)) if cap < want else int(math.ceil(ttl))
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(N_BOOT):
        i = rng.integers(0, len(gaps), len(gaps))
        j = rng.integers(0, len(finals), len(finals)) if len(finals) else np.array([], dtype=int)
        boots.append(_ttl_for(gaps[i], toks[i], finals[j], thr, bytes_per_token,
                              workload.duration_s, hbm_budget_gb)[0])
    lo, hi = np.percentile(boots, CI)
    share = captured_share(value, gaps, toks, thr)
    share_want = captured_share(want, gaps, toks, thr)
    margin = router_margin_s(value)
    evidence = replace(
        base, gap_s_p50=float(np.median(gaps)), gap_s_p90=float(np.quantile(gaps, 0.9)),
        gap_s_max=float(gaps.max()), uncapped_ttl_s=want,
        memory_cap_ttl_s=cap if math.isfinite(cap) else None,
        retained_gb_at_ttl=PEAK_TO_MEAN * retained_gb(value, gaps, toks, finals, bytes_per_token,
                                                      workload.duration_s),
        captured_share=share, captured_share_uncapped=share_want,
        router_decoder_ttl_s=value, router_margin_s=margin, router_params_ttl_s=value - margin)
    if want <= 0:
        findings.append(Finding(
            "ttl_no_reusable_turn", "info",
            ("reuse never pays (threshold 'never'): retained history would never be pulled back"
             if thr == math.inf else
             f"no next turn carries >= {threshold_tokens} tokens of history: retention would never "
             f"be reused") + f"; TTL {value} s",
            {"threshold_tokens": threshold_tokens if thr != math.inf else None}))
    elif cap < want:
        findings.append(Finding(
            "ttl_capped_by_memory", "warning",
            f"the HBM budget ({hbm_budget_gb:g} GB) caps the TTL at {value} s instead of "
            f"{want:.0f} s: it captures {share:.0%} of reusable history instead of {share_want:.0%}; "
            f"a larger retention budget on the decode would capture more",
            {"ttl_s": value, "uncapped_ttl_s": want, "captured_share": share,
             "captured_share_uncapped": share_want}))
    rec = Recommendation(NAME, value, (int(math.floor(lo)), int(math.ceil(hi))), UNIT, evidence,
                         assumptions)
    return rec, findings
