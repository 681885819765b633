"""Transfer mode: push vs pull vs pull + bidirectional reuse, by expected TTFT on the user's traffic.

Expected TTFT p50/p99 per mode come from the simulator (``kvtune.sim.expected_ttft``) when it is
importable, else from the analytic model here, per traced request (prompt P, history H, gap g):

- pull: queue + prefill(P) + ``PULL_HOP_MS`` (router -> decode, the decode schedules the read)
  + transfer(P) + ``DECODE_START_MS``;
- push: queue + prefill(P) + transfer(P) + ``DECODE_START_MS`` (the decode registered its blocks
  while the prefill ran); needs the decode chosen before the prefill (``early_decode_ok``);
- bidirectional: as pull, but a later turn with H >= threshold arriving within the router TTL
  computes only P - H after pulling H back: prefill(P - H | H) + transfer(H).

Queueing at the prefill is M/D/1 with the mode's mean prefill time at the traced request rate
spread over ``prefill_instances``. The mode with the lowest p50 wins if it beats pull by more than
``MIN_GAIN_SHARE``; otherwise pull (late, load-aware routing) stays.
"""
from __future__ import annotations

import inspect
import logging
import math
from typing import Any

import numpy as np

from kvtune import spans as sc
from kvtune.analysis.fit import FloorFit
from kvtune.analysis.prefill import PrefillCost
from kvtune.analysis.workload import Workload
from kvtune.recommend.results import NEVER, Finding, Recommendation
from kvtune.vllm_pd import router_margin_s

logger = logging.getLogger(__name__)

NAME = "mode"
PULL_HOP_MS = 2.0
"""Extra control hop of pull: the router hands the prefill's answer to the decode, which then
schedules the read (an HTTP round trip on a LAN plus one scheduler step)."""
DECODE_START_MS = 1.0
"""KV ready -> first decode step scheduled (same in every mode)."""
MIN_GAIN_SHARE = 0.02
"""Another mode must beat pull's p50 by more than 2% to be worth its constraints."""
MAX_UTILISATION = 0.95
"""Prefill utilisation is capped here for the queueing term (beyond it the queue has no mean)."""


def _analytic(workload: Workload, fit: FloorFit, prefill: PrefillCost, *, bytes_per_token: float,
              descriptors_per_token: float, threshold_tokens: float, ttl_s: float,
              prefill_instances: int) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    reqs = workload.requests or tuple((p, 0, math.nan) for p in workload.prompt_tokens)
    if not reqs:
        return {}, {}
    p = np.array([r[0] for r in reqs], dtype=float)
    h = np.array([r[1] for r in reqs], dtype=float)
    g = np.array([r[2] for r in reqs], dtype=float)

    def xfer(tokens: np.ndarray) -> np.ndarray:
        return np.array([fit.predict_ms(t * bytes_per_token, t * descriptors_per_token)
                         for t in tokens])

    full = np.array([prefill.predict_ms(x) for x in p])
    router_ttl = ttl_s - router_margin_s(ttl_s) if ttl_s > 0 else 0.0
    reuse = (h > 0) & (h >= threshold_tokens) & np.isfinite(g) & (g <= router_ttl)
    bidi_prefill = np.where(reuse, [prefill.predict_ms(x - y, y) for x, y in zip(p, h)], full)
    bidi_pull = np.where(reuse, xfer(h), 0.0)
    fwd = xfer(p)
    qps_each = (workload.qps if math.isfinite(workload.qps) else 0.0) / max(prefill_instances, 1)

    def wait(service_ms: np.ndarray) -> float:  # M/D/1 mean wait
        s = float(np.mean(service_ms))
        rho = min(qps_each * s / 1e3, MAX_UTILISATION)
        return rho / (2.0 * (1.0 - rho)) * s

    per_mode = {
        sc.Mode.PULL.value: wait(full) + full + PULL_HOP_MS + fwd + DECODE_START_MS,
        sc.Mode.PUSH.value: wait(full) + full + fwd + DECODE_START_MS,
        sc.Mode.BIDIRECTIONAL.value: (wait(bidi_prefill + bidi_pull) + bidi_prefill + bidi_pull
                                      + PULL_HOP_MS + fwd + DECODE_START_MS),
    }
    util = {"prefill_utilisation_pull": qps_each * float(np.mean(full)) / 1e3,
            "reused_share_bidirectional": float(np.mean(reuse))}
    return ({m: (float(np.percentile(v, 50)), float(np.percentile(v, 99)))
             for m, v in per_mode.items()}, util)


def _simulated(workload: Workload, fit: FloorFit, prefill: PrefillCost,
               **kwargs: Any) -> dict[str, tuple[float, float]] | None:
    """``kvtune.sim.expected_ttft`` when it exists (built in parallel); None otherwise."""
    try:
        from kvtune.sim.estimate import expected_ttft
    except ImportError:  # simulator absent: use the analytic model
        return None
    params = inspect.signature(expected_ttft).parameters
    extra = {k: v for k, v in kwargs.items() if k in params and v is not None}
    res = expected_ttft(workload, fit, prefill, **extra)
    out: dict[str, tuple[float, float]] = {}
    for m, v in res.items():
        p50, p99 = ((v.p50_ms, v.p99_ms) if hasattr(v, "p50_ms") else (v[0], v[1]))
        out[str(getattr(m, "value", m))] = (float(p50), float(p99))
    return out


def recommend_mode(workload: Workload, fit: FloorFit, prefill: PrefillCost, *,
                   bytes_per_token: float, descriptors_per_token: float,
                   threshold: int | str, ttl_s: float, early_decode_ok: bool = True,
                   prefill_instances: int = 1, use_simulator: bool = True,
                   ) -> tuple[Recommendation, list[Finding]]:
    """Compare the modes' expected TTFT and pick one (see module doc). ``use_simulator=False``
    keeps to the analytic model."""
    thr = math.inf if threshold == NEVER else float(threshold)
    findings: list[Finding] = []
    kw = dict(bytes_per_token=bytes_per_token, descriptors_per_token=descriptors_per_token,
              threshold_tokens=thr, ttl_s=ttl_s, prefill_instances=prefill_instances)
    ttft, util = _analytic(workload, fit, prefill, **kw)
    analytic = dict(ttft)
    model = "analytic"
    try:
        sim = None if not use_simulator else _simulated(workload, fit, prefill, ttl_s=ttl_s if ttl_s > 0 else None,
                         threshold_tokens=None if thr == math.inf else int(thr))
    except Exception as exc:  # noqa: BLE001 - a simulator failure must not stop the advice
        logger.warning("kvtune.sim.expected_ttft failed; using the analytic model", exc_info=True)
        findings.append(Finding("simulator_failed", "info",
                                f"the simulator failed ({type(exc).__name__}: {exc}); expected "
                                f"TTFT per mode comes from the analytic model", {}))
        sim = None
    if sim and all(math.isfinite(v[0]) for v in sim.values()):
        ttft, model = {**ttft, **sim}, "kvtune.sim"
    allowed = [sc.Mode.PULL.value]
    excluded: dict[str, str] = {}
    if early_decode_ok:
        allowed.append(sc.Mode.PUSH.value)
    else:
        excluded[sc.Mode.PUSH.value] = "needs the decode chosen before the prefill (early_decode_ok=False)"
    if thr == math.inf:
        excluded[sc.Mode.BIDIRECTIONAL.value] = "reuse never pays (threshold 'never')"
    elif ttl_s <= 0 or not workload.gaps_s:
        excluded[sc.Mode.BIDIRECTIONAL.value] = "no multi-turn traffic to reuse"
    else:
        allowed.append(sc.Mode.BIDIRECTIONAL.value)
    if not ttft:
        raise_msg = "no request with a known prompt length: cannot compare modes"
        findings.append(Finding("mode_no_requests", "warning", raise_msg, {}))
        return Recommendation(NAME, sc.Mode.PULL.value, (sc.Mode.PULL.value, sc.Mode.PULL.value),
                              "mode", {"model": model, "excluded": excluded},
                              ("pull by default when nothing can be compared",)), findings
    pull_p50 = ttft[sc.Mode.PULL.value][0]
    best = min(allowed, key=lambda m: (ttft[m][0], ttft[m][1]))
    if best != sc.Mode.PULL.value and ttft[best][0] > pull_p50 * (1.0 - MIN_GAIN_SHARE):
        best = sc.Mode.PULL.value
    ranked = sorted(allowed, key=lambda m: ttft[m][0])
    runner_up = next((m for m in ranked if m != best), best)
    evidence = {
        "model": model,
        "expected_ttft_ms": {m: {"p50": v[0], "p99": v[1]} for m, v in ttft.items()},
        "analytic_ttft_ms": {m: {"p50": v[0], "p99": v[1]} for m, v in analytic.items()},
        "allowed": allowed, "excluded": excluded, "multi_turn_share": workload.multi_turn_share,
        "prompt_tokens_p50": workload.prompt_tokens_p50, "qps": workload.qps,
        "early_decode_ok": early_decode_ok, **util,
    }
    if model == "analytic":
        assumptions: tuple[str, ...] = (
            "expected TTFT from the analytic model on the traced requests",
            f"pull pays one more control hop ({PULL_HOP_MS:g} ms) than push; push binds the decode "
            f"before the prefill and loses load-aware decode choice (not modelled)",
            f"prefill queueing M/D/1 over {prefill_instances} prefill instance(s) at the traced "
            f"rate",
        )
    else:
        assumptions = (
            "expected TTFT from kvtune.sim.expected_ttft: the traced workload summary replayed "
            "through each mode on the simulator calibrated with the floor and prefill fits "
            "(what the fits leave open comes from the simulator's preset)",
        )
    assumptions += (f"another mode must beat pull's p50 by more than {MIN_GAIN_SHARE:.0%}",)
    return Recommendation(NAME, best, (best, runner_up), "mode", evidence, assumptions), findings
