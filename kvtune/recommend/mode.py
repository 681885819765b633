"""Transfer mode: push vs pull vs pull + bidirectional reuse, by expected TTFT on the user's traffic.

Expected TTFT p50/p99 per mode come from the simulator (``kvtune.sim``: the traced workload played
in each mode on the public preset calibrated with the fits, the router's hops, each engine's
intake and push's handover as traced (``kvtune.analysis.path``), per mode where the trace
measured a mode apart; every number it plays is listed with its source in the evidence), and,
beside it, from the analytic model here, per traced request
(prompt P, history H, gap g):

- pull: queue + prefill(P) + ``PULL_HOP_MS`` (router -> decode, the decode schedules the read)
  + transfer(P) + ``DECODE_START_MS``;
- push: queue + prefill(P) + transfer(P) + ``DECODE_START_MS`` (the decode registered its blocks
  while the prefill ran); needs the decode chosen before the prefill (``early_decode_ok``);
- bidirectional: as pull, but a later turn with H >= threshold arriving within the router TTL
  computes only P - H after pulling H back: prefill(P - H | H) + transfer(H).

Queueing at the prefill is M/D/1 with the mode's mean prefill time at the traced request rate
spread over ``prefill_instances``. The mode with the lowest p50 wins if it beats pull by more than
``MIN_GAIN_SHARE``; otherwise pull (late, load-aware routing) stays. When the two models pick
different winners, a ``mode_models_disagree`` finding says so and why, and the range holds both.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvtune import spans as sc
from kvtune.analysis.fit import FloorFit
from kvtune.analysis.hops import RouterHops
from kvtune.analysis.modes import MeasuredTtft, TracedSettings
from kvtune.analysis.path import PathCosts
from kvtune.analysis.prefill import PrefillCost
from kvtune.analysis.workload import TracedRequest, Workload
from kvtune.errors import SimError
from kvtune.recommend.evidence import ModeEvidence, TtftMs
from kvtune.recommend.results import MODE_NAME, NEVER, Finding, Recommendation
from kvtune.sim.calibrate import SimInput
from kvtune.sim.estimate import DEFAULT_MAX_REQUESTS, calibrate, ttft_per_mode
from kvtune.vllm_pd import router_ttl_s

logger = logging.getLogger(__name__)

NAME = MODE_NAME
PULL_HOP_MS = 2.0
"""Extra control hop of pull: the router hands the prefill's answer to the decode, which then
schedules the read (an HTTP round trip on a LAN plus one scheduler step)."""
DECODE_START_MS = 1.0
"""KV ready -> first decode step scheduled (same in every mode)."""
MIN_GAIN_SHARE = 0.02
"""Another mode must beat pull's p50 by more than 2% to be worth its constraints."""
MAX_UTILISATION = 0.95
"""Prefill utilisation is capped here for the queueing term (beyond it the queue has no mean)."""
CLOSE_CALL_SHARE = 0.02
"""Simulated p50s of the two fastest modes within 2% of each other: a call the default sample
cannot make (mode p50s move by about that much from one sample of the traffic to another)."""
CLOSE_CALL_MAX_REQUESTS = 4 * DEFAULT_MAX_REQUESTS
"""Requests per mode for a close call (a sample four times larger halves the noise)."""


def _analytic(workload: Workload, fit: FloorFit, prefill: PrefillCost, *, bytes_per_token: float,
              descriptors_per_token: float, threshold_tokens: float, ttl_s: float,
              prefill_instances: int) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    reqs = workload.requests or tuple(TracedRequest(p, 0, math.nan) for p in workload.prompt_tokens)
    if not reqs:
        return {}, {}
    p = np.array([r.prompt_tokens for r in reqs], dtype=float)
    h = np.array([r.history_tokens for r in reqs], dtype=float)
    g = np.array([r.gap_s for r in reqs], dtype=float)

    def xfer(tokens: np.ndarray) -> np.ndarray:
        return np.array([fit.predict_ms(t * bytes_per_token, t * descriptors_per_token)
                         for t in tokens])

    full = np.array([prefill.predict_ms(x) for x in p])
    router_ttl = router_ttl_s(ttl_s) if ttl_s > 0 else 0.0
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


SimTtft = dict[str, tuple[float, float]]


def _simulated(workload: Workload, fit: FloorFit, prefill: PrefillCost, *, bytes_per_token: float,
               descriptors_per_token: float, ttl_s: float | None, threshold_tokens: int | None,
               prefill_instances: int, fit_source: str, prefix_caching: bool | None = None,
               prefix_caching_source: str = "setting", first_step_ms: float | None = None,
               first_step_source: str = "measured", max_requests: int = DEFAULT_MAX_REQUESTS,
               hops: RouterHops | None = None, traced: TracedPath | None = None
               ) -> tuple[SimTtft, tuple[SimInput, ...]]:
    """(p50, p99) per mode from the simulator, and the numbers it played with their sources."""
    traced = traced or TracedPath()
    cal = calibrate(workload, fit, prefill, max_requests=max_requests, ttl_s=ttl_s,
                    threshold_tokens=threshold_tokens,
                    bytes_per_token=bytes_per_token,
                    descriptors_per_token=descriptors_per_token or None,  # 0: not measured
                    fit_source=fit_source, prefill_instances=prefill_instances,
                    prefix_caching=prefix_caching, prefix_caching_source=prefix_caching_source,
                    first_step_ms=first_step_ms, first_step_source=first_step_source,
                    hops=hops, hops_source=_hops_source(hops), path=traced.path or None,
                    main_mode=traced.main_mode, path_source=PATH_SOURCE,
                    mode_prefill=traced.mode_prefill or None, block_tokens=traced.block_tokens,
                    block_tokens_source=BLOCK_TOKENS_SOURCE,
                    loop_per_descriptor_us=traced.loop_per_descriptor_us,
                    loop_source=LOOP_SOURCE)
    res = ttft_per_mode(cal)
    return {m.value: (float(v.p50_ms), float(v.p99_ms)) for m, v in res.items()}, cal.inputs


def _with_measured(sim: SimTtft, inputs: tuple[SimInput, ...],
                   measured: Mapping[str, MeasuredTtft], main_mode: str | None,
                   traced: SimTtft | None = None
                   ) -> tuple[SimTtft, float | None, dict[str, str]]:
    """The TTFT per mode the choice uses, where the trace measured some: each traced mode's
    measured TTFT in place of its simulated one, and the simulator's other modes scaled by the
    ratio that makes the traced main mode's simulated TTFT match its measurement (the simulator's
    bias on this deployment, carried to the modes it could not see). Also: that scale (None: no
    main-mode measurement) and, per mode, where its number came from.

    The measurements end at the decode's first step; the simulator's TTFT also carries the first
    token back to the client (``overheads.hop_ms``): it is added to the measured values, and
    taken off the simulated ones before scaling. ``traced``: the simulator's TTFT at the settings
    the traced requests ran under (the main mode's is what its measurement is compared with;
    None: ``sim``'s)."""
    hop = next((float(i.value) for i in inputs if i.name == "overheads.hop_ms"
                and isinstance(i.value, (int, float))), 0.0)
    base = (traced or sim).get(main_mode) if main_mode is not None else None
    scale = None
    if main_mode in measured and base is not None and base[0] - hop > 0:
        scale = measured[main_mode].p50_ms / (base[0] - hop)
    out: SimTtft = {}
    how: dict[str, str] = {}
    for m, (p50, p99) in sim.items():
        got = measured.get(m)
        if got is not None:
            out[m] = (got.p50_ms + hop, got.p99_ms + hop)
            how[m] = (f"measured: {got.n_requests} traced {m} requests (router in -> the decode's "
                      f"first step) + the {hop:.1f} ms hop back")
        elif scale is not None:
            out[m] = ((p50 - hop) * scale + hop, (p99 - hop) * scale + hop)
            how[m] = (f"kvtune.sim x {scale:.2f} (the scale at which the simulated {main_mode} "
                      f"TTFT matches the measured one)")
        else:
            out[m] = (p50, p99)
            how[m] = "kvtune.sim"
    return out, scale, how


def _hops_source(hops: RouterHops | None) -> str:
    if hops is None:
        return "measured"
    return (f"measured: router hops (the prefill answer -> decode leg handoff of "
            f"{hops.n_handoffs} pull legs and the router intake of {hops.n_intakes} requests, "
            f"each against the prompt's kilotokens: kvtune.analysis.hops)")


PATH_SOURCE = ("measured: engine intakes on idle engines and push's handover and notification "
               "(kvtune.analysis.path)")
BLOCK_TOKENS_SOURCE = "measured: kv.tokens / kv.blocks of the transfers"
LOOP_SOURCE = ("measured: the serving READs' per-descriptor cost beyond the fabric probe's "
               "(slope_split_by_probe); the prefill's reverse READs run the same code")


@dataclass(frozen=True)
class TracedPath:
    """What the trace measured of each mode's path for the simulator, beyond the fits and hops."""

    path: Mapping[str, PathCosts] = field(default_factory=dict)
    """Per mode: the engines' intakes and push's handover and notification."""
    main_mode: str | None = None
    """The mode whose path every mode without its own plays."""
    mode_prefill: Mapping[str, PrefillCost] = field(default_factory=dict)
    """Per mode other than the main one: its own prefill cost (the engines share a host)."""
    block_tokens: int | None = None
    """The engines' KV block size (None: the preset's)."""
    loop_per_descriptor_us: float | None = None
    """The engine loop's inline work per READ descriptor, split from the serving transfers by the
    fabric probe (None: the preset's)."""


def _close(sim: SimTtft) -> bool:
    """Whether the two fastest simulated modes' p50 lie within :data:`CLOSE_CALL_SHARE`."""
    p50s = sorted(v[0] for v in sim.values() if math.isfinite(v[0]))
    return len(p50s) >= 2 and p50s[1] <= p50s[0] * (1.0 + CLOSE_CALL_SHARE)


def _pick(ttft: dict[str, tuple[float, float]], allowed: list[str],
          measured: Mapping[str, MeasuredTtft] | None = None) -> str:
    """The allowed mode with the lowest p50, unless it beats pull by no more than
    ``MIN_GAIN_SHARE``, or (both measured) its p50's 95% interval reaches pull's p50: then pull,
    vLLM's default, which nothing measured to beat it."""
    pull = sc.Mode.PULL.value
    pull_p50 = ttft[pull][0]
    best = min(allowed, key=lambda m: (ttft[m][0], ttft[m][1]))
    if best != pull and ttft[best][0] > pull_p50 * (1.0 - MIN_GAIN_SHARE):
        best = pull
    if best != pull and measured and best in measured and pull in measured \
            and not measured[best].p50_ci_ms[1] < measured[pull].p50_ms:
        best = pull
    return best


PRESET_MECHANISMS: dict[str, str] = {
    "decode.loop_per_descriptor_us": "the pull decode's engine loop building READ descriptors "
                                     "inline while running decodes wait",
    "prefill.parallel_requests": "prompts batched on the prefill",
    "decode.step_base_ms": "decode step time (first token after KV arrives)",
    "overheads.hop_ms": "HTTP hops between router and instances",
    "overheads.registration_base_ms": "push's destination-block registration",
    "overheads.prefill_intake_ms": "the prefill engine taking a request in (API server -> scheduler)",
    "overheads.decode_intake_ms": "the decode engine taking a leg in before it acts on it",
    "overheads.tokenize_per_kilotoken_ms": "each API server tokenising the whole prompt",
    "prefill.loop_per_descriptor_us": "the prefill's engine loop building reverse READ descriptors",
}
"""Simulator inputs the analytic model has no term for, and what they stand for."""


def _disagreement(sim_best: str, analytic_best: str, sim: SimTtft, analytic: SimTtft,
                  inputs: tuple[SimInput, ...]) -> Finding:
    from_preset = [i for i in inputs if i.name in PRESET_MECHANISMS
                   and not i.source.startswith("measured")]
    named = "; ".join(f"{i.name} = {i.value} ({i.source}): {PRESET_MECHANISMS[i.name]}"
                      for i in from_preset)
    return Finding(
        "mode_models_disagree", "warning",
        f"the simulator and the analytic model pick different modes: the simulator {sim_best} "
        f"(p50 {sim[sim_best][0]:.1f} ms against {sim[analytic_best][0]:.1f} ms for "
        f"{analytic_best}), the analytic model {analytic_best} (p50 "
        f"{analytic[analytic_best][0]:.1f} ms against {analytic[sim_best][0]:.1f} ms for "
        f"{sim_best}). The advice follows the simulator, which models queueing in the engines; "
        f"the analytic model has no term for "
        + (named if named else "the decode loop, prefill batching and decode steps")
        + ". Values not measured from this trace come from the preset: the mode's range holds "
        "both modes; verify with kvtune verify before relying on it",
        {"simulated_best": sim_best, "analytic_best": analytic_best,
         "simulated_p50_ms": {m: v[0] for m, v in sim.items()},
         "analytic_p50_ms": {m: v[0] for m, v in analytic.items()},
         "preset_inputs": [i.as_dict() for i in from_preset]})


def recommend_mode(workload: Workload, fit: FloorFit, prefill: PrefillCost, *,
                   bytes_per_token: float, descriptors_per_token: float,
                   threshold: int | str, ttl_s: float, early_decode_ok: bool = True,
                   prefill_instances: int = 1, use_simulator: bool = True,
                   fit_source: str = "floor fit", prefix_caching: bool | None = None,
                   prefix_caching_source: str = "setting", first_step_ms: float | None = None,
                   first_step_source: str = "measured", hops: RouterHops | None = None,
                   measured: Mapping[str, MeasuredTtft] | None = None, main_mode: str | None = None,
                   traced_settings: TracedSettings | None = None,
                   traced_path: TracedPath | None = None
                   ) -> tuple[Recommendation, list[Finding]]:
    """Compare the modes' expected TTFT and pick one (see module doc). ``use_simulator=False``
    keeps to the analytic model; ``fit_source`` names where the floor fit came from (for the list
    of simulator inputs); ``prefix_caching`` (None: the preset's) whether the engines cache
    prefixes, as the traces showed (``prefix_caching_source`` says how it is known);
    ``first_step_ms`` (None: the preset's decode step) the decode's time from KV ready to the first
    token, as traced; ``hops`` (None: the preset's) the router's hop and intake, as traced;
    ``measured`` the TTFT (to the decode's first step) of each mode the trace served, with
    ``main_mode`` the one the fits were read from and ``traced_settings`` the reuse settings it
    ran under (see :func:`_with_measured`); ``traced_path`` what the trace measured of each
    mode's path (engine intakes, push's handover and notification, per-mode prefill costs, the
    KV block size: :class:`TracedPath`)."""
    thr = math.inf if threshold == NEVER else float(threshold)
    findings: list[Finding] = []
    ttft, util = _analytic(workload, fit, prefill, bytes_per_token=bytes_per_token,
                           descriptors_per_token=descriptors_per_token, threshold_tokens=thr,
                           ttl_s=ttl_s, prefill_instances=prefill_instances)
    analytic = dict(ttft)
    model = "analytic"
    sim: SimTtft | None = None
    inputs: tuple[SimInput, ...] | None = None
    close_call = False
    rec_ttl_s = ttl_s if ttl_s > 0 else None
    rec_threshold = None if thr == math.inf else int(thr)

    def simulated(n: int, *, at_ttl_s: float | None = rec_ttl_s,
                  at_threshold: int | None = rec_threshold
                  ) -> tuple[SimTtft, tuple[SimInput, ...]]:
        """The simulator's TTFT per mode on ``n`` requests, at the recommended settings unless
        told others."""
        return _simulated(
            workload, fit, prefill, bytes_per_token=bytes_per_token,
            descriptors_per_token=descriptors_per_token, ttl_s=at_ttl_s,
            threshold_tokens=at_threshold, prefill_instances=prefill_instances,
            fit_source=fit_source, prefix_caching=prefix_caching,
            prefix_caching_source=prefix_caching_source, first_step_ms=first_step_ms,
            first_step_source=first_step_source, max_requests=n, hops=hops,
            traced=traced_path)

    if use_simulator and ttft:
        try:
            sim, inputs = simulated(DEFAULT_MAX_REQUESTS)
            if _close(sim):  # two modes within the sample's noise: settle it on a larger sample
                close_call = True
                sim, inputs = simulated(CLOSE_CALL_MAX_REQUESTS)
        except SimError as exc:  # the traced workload cannot be simulated: keep to the analytic
            logger.warning("kvtune.sim failed; using the analytic model", exc_info=True)
            findings.append(Finding("simulator_failed", "info",
                                    f"the simulator failed ({exc}); expected TTFT per mode comes "
                                    f"from the analytic model", {}))
    sim_scale: float | None = None
    sources: dict[str, str] | None = None
    raw_sim = sim
    if sim and all(math.isfinite(v[0]) for v in sim.values()):
        if measured:
            at_traced = None
            if traced_settings is not None and main_mode == sc.Mode.BIDIRECTIONAL.value and (
                    traced_settings.threshold_tokens is not None or traced_settings.ttl_s):
                try:  # the main mode as it was traced (tune pulls every history back)
                    at_traced, _ = simulated(
                        DEFAULT_MAX_REQUESTS, at_ttl_s=traced_settings.ttl_s or rec_ttl_s,
                        at_threshold=(traced_settings.threshold_tokens
                                      if traced_settings.threshold_tokens is not None
                                      else rec_threshold))
                except SimError:
                    at_traced = None
            sim, sim_scale, sources = _with_measured(sim, inputs or (), measured, main_mode,
                                                     at_traced)
        ttft, model = {**ttft, **sim}, "kvtune.sim"
    else:
        sim = raw_sim = None
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
                              "mode", ModeEvidence(model=model, excluded=excluded),
                              ("pull by default when nothing can be compared",)), findings
    best = _pick(ttft, allowed, measured if sources else None)
    analytic_best = _pick(analytic, allowed)
    ranked = sorted(allowed, key=lambda m: ttft[m][0])
    runner_up = next((m for m in ranked if m != best), best)
    agree = None if sim is None else analytic_best == best
    if agree is False:
        runner_up = analytic_best  # the range holds both models' winners
        findings.append(_disagreement(best, analytic_best, sim or {}, analytic, inputs or ()))
    evidence = ModeEvidence(
        model=model,
        expected_ttft_ms={m: TtftMs(*v) for m, v in ttft.items()},
        analytic_ttft_ms={m: TtftMs(*v) for m, v in analytic.items()},
        allowed=tuple(allowed), excluded=excluded, multi_turn_share=workload.multi_turn_share,
        prompt_tokens_p50=workload.prompt_tokens_p50, qps=workload.qps,
        early_decode_ok=early_decode_ok,
        prefill_utilisation_pull=util.get("prefill_utilisation_pull"),
        reused_share_bidirectional=util.get("reused_share_bidirectional"),
        analytic_best=analytic_best, simulated_best=best if sim is not None else None,
        models_agree=agree, sim_inputs=inputs if sim is not None else None,
        simulated_ttft_ms=({m: TtftMs(*v) for m, v in raw_sim.items()}
                           if raw_sim is not None and sources else None),
        ttft_sources=sources, sim_scale=sim_scale,
    )
    if model == "analytic":
        assumptions: tuple[str, ...] = (
            "expected TTFT from the analytic model on the traced requests",
            f"pull pays one more control hop ({PULL_HOP_MS:g} ms) than push; push binds the decode "
            f"before the prefill and loses load-aware decode choice (not modelled)",
            f"prefill queueing M/D/1 over {prefill_instances} prefill instance(s) at the traced "
            f"rate",
        )
    else:
        n_preset = sum(1 for i in inputs or () if i.source.startswith("preset"))
        assumptions = (
            "expected TTFT from kvtune.sim: the traced workload summary replayed through each mode "
            "on the simulator calibrated with the floor and prefill fits; "
            f"{n_preset} of its inputs come from the preset (listed in evidence.sim_inputs)",
        )
        if sources:
            assumptions += ("per mode, where its expected TTFT came from: " + "; ".join(
                f"{m}: {v}" for m, v in sources.items()),)
        if close_call:
            assumptions += (f"the two fastest modes came within {CLOSE_CALL_SHARE:.0%} of each "
                            f"other on {DEFAULT_MAX_REQUESTS} simulated requests: compared again "
                            f"on {CLOSE_CALL_MAX_REQUESTS}",)
        if agree is False:
            assumptions += (f"the analytic model picks {analytic_best}: the range holds both",)
    assumptions += (f"another mode must beat pull's p50 by more than {MIN_GAIN_SHARE:.0%}"
                    + (", and where both were measured, with the whole 95% interval of its "
                       "measured p50" if sources else ""),)
    return Recommendation(NAME, best, (best, runner_up), "mode", evidence, assumptions), findings
