"""``recommend(spans)``: the three settings from one trace, with evidence and findings."""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np
import pandas as pd

from kvtune.analysis.conversations import conversations as conversations_of
from kvtune.analysis.fit import FloorFit, fit_floor
from kvtune.analysis.hops import router_hops
from kvtune.analysis.modes import measured_ttft, split_modes, traced_settings
from kvtune.analysis.path import path_costs, without_reverse_wait
from kvtune.analysis.prefill import PrefillCost, local_prefix_hits, prefill_cost
from kvtune.analysis.prefill_lease import prefill_lease_holds
from kvtune.analysis.transfers import transfers as transfers_table
from kvtune.analysis.workload import Workload, workload as workload_of
from kvtune.errors import AnalysisError, ConfigError
from kvtune.recommend.findings import readiness, unnamed_time_finding, versions_in
from kvtune.recommend.mode import TracedPath, recommend_mode
from kvtune.recommend.prefill_lease import recommend_lease
from kvtune.recommend.results import NEVER, Finding, Tuning
from kvtune.recommend.retention import compare as compare_retention
from kvtune.recommend.threshold import pickup_of, recommend_threshold
from kvtune.recommend.ttl import recommend_ttl
from kvtune.sim.retention import DEFAULT_BLOCK_TOKENS
from kvtune.vllm_pd import KV_LEASE_DURATION

logger = logging.getLogger(__name__)

DEFAULT_HBM_BUDGET_GB = 10.0
"""Decode HBM per rank set aside for retained conversations (GB, 1e9 bytes) when not given."""
LARGE_TRANSFER_QUANTILE = 0.75
"""Bytes per token is read from the largest quarter of transfers, where partial blocks matter least
(and mis-attributed small transfers do not reach)."""


def _source(spans: pd.DataFrame) -> str:
    src = spans.attrs.get("sources") if hasattr(spans, "attrs") else None
    return ", ".join(str(s) for s in src) if src else "<DataFrame>"


def bytes_per_token_of(transfers: pd.DataFrame, geometry: Any = None) -> tuple[float, float, str]:
    """(bytes per token, descriptors per token, where from): the geometry's, else the smallest
    ``kv.bytes / kv.tokens`` over the largest quarter of serving (else probe) transfers (a partly filled last block
    moves whole, so every ratio over-states the truth; large, block-aligned ones the least)."""
    if geometry is not None:
        bpt = float(geometry.bytes_per_token)
        regions = getattr(geometry, "regions", None)
        block = getattr(geometry, "block_size_tokens", None)
        dpt = float(regions) / float(block) if regions and block else 0.0
        return bpt, dpt, "geometry"
    t = transfers[(transfers["tokens"].notna() & transfers["bytes"].notna()
                   & (transfers["tokens"] > 0)).to_numpy(dtype=bool)]
    serving = t[(t["mode"].astype(object) != "probe").to_numpy(dtype=bool)]
    if len(serving):  # the probe's geometry is a stand-in for the served model's
        t = serving
    if t.empty:
        raise AnalysisError(
            "recommend: cannot tell KV bytes per token: no transfer has both kv.tokens and kv.bytes "
            "(probe-only traces): pass geometry=KvGeometry(...) (kvtune.geometry)")
    big = t[(t["tokens"] >= t["tokens"].quantile(LARGE_TRANSFER_QUANTILE)).to_numpy(dtype=bool)]
    # bytes cover whole blocks, so each ratio is >= the true value: the smallest is the tightest
    bpt = float(np.min((big["bytes"] / big["tokens"]).astype(float)))
    d = big[big["descriptors"].notna().to_numpy(dtype=bool)]
    dpt = float(np.median((d["descriptors"] / d["tokens"]).astype(float))) if len(d) else 0.0
    return bpt, dpt, "transfers (kv.bytes / kv.tokens)"


def block_tokens_of(transfers: pd.DataFrame, geometry: Any = None) -> int | None:
    """The engines' KV block size in tokens: the geometry's, else the one block size every serving
    transfer's ``kv.blocks = ceil(kv.tokens / size)`` agrees with (the smallest such, preferring a
    power of two), else None (no transfer with both counts, or they disagree)."""
    if geometry is not None and getattr(geometry, "block_size_tokens", None):
        return int(geometry.block_size_tokens)
    t = transfers[(transfers["tokens"].notna() & transfers["blocks"].notna()
                   & (transfers["blocks"] > 0) & (transfers["tokens"] > 0)
                   & (transfers["mode"].astype(object) != "probe")).to_numpy(dtype=bool)]
    if t.empty:
        return None
    tokens = t["tokens"].to_numpy(dtype=float)
    blocks = t["blocks"].to_numpy(dtype=float)
    lo = int(np.ceil(np.max(tokens / blocks)))  # tokens <= size * blocks
    multi = blocks > 1
    hi = float(np.min(tokens[multi] / (blocks[multi] - 1))) if multi.any() else math.inf  # size < hi
    if lo >= hi:
        return None
    power = 1 << max(0, lo - 1).bit_length()  # the smallest power of two >= lo
    return power if power < hi else lo


def _fit_with_probe_fallback(tr: pd.DataFrame, *, n_boot: int, seed: int, fabric: str | None,
                             op: str | None, source: str
                             ) -> tuple[FloorFit, str, list[Finding]]:
    """Fit the serving transfers; when they cannot support a fit (too few sizes, noise larger than
    the size effect) and the trace holds fabric-probe transfers, fit those instead, saying so.

    Returns (fit, where it came from, findings)."""
    is_probe = (tr["mode"].astype("object") == "probe").to_numpy(dtype=bool)
    serving, probe = tr[~is_probe], tr[is_probe]
    first = serving if len(serving) else tr
    try:
        fit = fit_floor(first, n_boot=n_boot, seed=seed, fabric=fabric if fabric in set(
            first["fabric"].dropna().astype(str)) else None, op=op, source=source)
        return fit, "serving transfers" if len(serving) else "probe transfers", []
    except AnalysisError as exc:
        if not len(serving) or probe.empty:
            raise
        p_fabrics = sorted(set(probe["fabric"].dropna().astype(str)))
        p_fabric = fabric if fabric in p_fabrics else (p_fabrics[0] if p_fabrics else None)
        p_ops = sorted(set(probe["op"].dropna().astype(str)))
        p_op = "READ" if "READ" in p_ops else (p_ops[0] if p_ops else None)
        try:
            fit = fit_floor(probe, n_boot=n_boot, seed=seed, fabric=p_fabric, op=p_op,
                            source=source)
        except AnalysisError as exc2:
            raise AnalysisError(f"{exc}; the fabric probe's transfers cannot stand in either: "
                                f"{exc2}") from None
        finding = Finding(
            "fit_from_probe", "warning",
            f"the {len(serving)} serving transfers cannot support a floor fit ({exc}); the floor "
            f"and bandwidth come from the fabric probe's {p_op} transfers"
            f"{f' on {p_fabric!r}' if p_fabric else ''} instead: they miss vLLM's own "
            f"per-transfer overhead, so the threshold may be low",
            {"serving_transfers": int(len(serving)), "probe_transfers": int(len(probe)),
             "serving_fit_error": str(exc), "probe_fabric": p_fabric, "probe_op": p_op})
        return fit, "probe transfers (fallback)", [finding]


def split_with_probe(fit: FloorFit, tr: pd.DataFrame, *, bytes_per_token: float,
                     descriptors_per_token: float, n_boot: int, seed: int, op: str | None = None
                     ) -> tuple[FloorFit, float | None, list[Finding]]:
    """The serving fit with its per-token slope split into link time and per-descriptor work, by the
    fabric probe, for the simulator's mode comparison; and, where the serving transfers were READs
    (a decode's, or a prefill's reverse, built inline by the engine), the engine loop's share of
    that work.

    vLLM moves one descriptor per layer and block, so in serving transfers descriptors grow with
    bytes and the fit cannot tell the two apart (``per_descriptor_us`` is None): its bandwidth holds
    both. The simulator queues transfers on the link by bytes / bandwidth, so an understated
    bandwidth overstates queueing and push's overlap. The probe varies descriptors at fixed bytes
    and does tell them apart: the link keeps the probe's bandwidth, and what the serving slope has
    beyond it is charged per descriptor. Of that, the fabric's own cost is the probe's per
    descriptor; what READs pay beyond it is their engine loop's inline work (returned: the
    simulator charges it as ``loop_per_descriptor_us``, stalling the engine). Totals
    (``predict_ms``) stay the serving fit's. Returns (the serving fit, None, []) when there is no
    probe, the probe cannot separate them either, or its wire time alone exceeds the serving
    slope."""
    if fit.per_descriptor_us is not None or descriptors_per_token <= 0 or bytes_per_token <= 0:
        return fit, None, []
    probe = tr[(tr["mode"].astype("object") == "probe").to_numpy(dtype=bool)]
    if probe.empty:
        return fit, None, []
    try:
        pf = fit_floor(probe, n_boot=min(n_boot, 50), seed=seed,
                       op="READ" if "READ" in set(probe["op"].dropna().astype(str)) else None)
    except AnalysisError:
        return fit, None, []
    if pf.per_descriptor_us is None or not pf.bandwidth_gbps > 0:
        return fit, None, []
    slope_us = bytes_per_token * 8.0 / (fit.bandwidth_gbps * 1e9) * 1e6
    wire_us = bytes_per_token * 8.0 / (pf.bandwidth_gbps * 1e9) * 1e6
    if wire_us >= slope_us:
        return fit, None, []
    per_desc = (slope_us - wire_us) / descriptors_per_token
    serving = tr[(tr["mode"].astype("object") != "probe").to_numpy(dtype=bool)]
    reads = op == "READ" or (op is None and set(serving["op"].dropna().astype(str)) == {"READ"})
    loop = max(0.0, per_desc - pf.per_descriptor_us) if reads else None
    fabric = per_desc - loop if loop is not None else per_desc
    split = dataclasses.replace(fit, bandwidth_gbps=pf.bandwidth_gbps, per_descriptor_us=fabric,
                                bandwidth_ci_gbps=pf.bandwidth_ci_gbps, per_descriptor_ci_us=None)
    loop_words = (f", of which {loop:.3f} us is the engine loop's (beyond the probe's "
                  f"{pf.per_descriptor_us:.3f} us: the serving READs build their descriptors "
                  f"inline)" if loop is not None else "")
    return split, loop, [Finding(
        "slope_split_by_probe", "info",
        f"the serving transfers' per-token cost ({slope_us:.3f} us/token) is split for the "
        f"simulator into link time at the fabric probe's {pf.bandwidth_gbps:.3g} Gbit/s "
        f"({wire_us:.3f} us/token) and {per_desc:.3f} us per descriptor{loop_words} (the serving "
        f"fit cannot separate them: descriptors grow with bytes)",
        {"slope_us_per_token": slope_us, "probe_bandwidth_gbps": pf.bandwidth_gbps,
         "wire_us_per_token": wire_us, "per_descriptor_us": per_desc,
         "probe_per_descriptor_us": pf.per_descriptor_us, "engine_loop_per_descriptor_us": loop})]


def recommend(spans: pd.DataFrame, *, geometry: Any = None,
              hbm_budget_gb: float = DEFAULT_HBM_BUDGET_GB, early_decode_ok: bool = True,
              fabric: str | None = None, prefill_instances: int = 1, n_boot: int = 200,
              seed: int = 0, max_context_tokens: int | None = None,
              use_simulator: bool = True) -> Tuning:
    """Recommend ``kv_recompute_threshold``, ``decoder_kv_blocks_ttl`` and the mode from a spans
    frame (``kvtune.traces.load``). The floor fit uses the transfers on ``fabric`` (needed when the
    trace holds several). Raises :class:`AnalysisError` when the spans cannot support the advice
    (no transfers, too few sizes, no prefill or request spans). Expected TTFT per mode comes from
    ``kvtune.sim`` unless ``use_simulator=False`` (analytic model)."""
    if not (isinstance(hbm_budget_gb, (int, float)) and math.isfinite(hbm_budget_gb)
            and hbm_budget_gb >= 0):
        raise ConfigError(f"recommend: hbm_budget_gb: expected a number of GB >= 0, "
                          f"got {hbm_budget_gb!r}")
    source = _source(spans)
    split = split_modes(spans)
    traced, spans = spans, split.main_spans  # the fabric is every mode's: tr reads them all
    findings: list[Finding] = []
    if split.others:
        findings.append(Finding(
            "modes_split", "info",
            f"the trace holds requests served in several modes ({split.requests}); the workload "
            f"and the prefill cost are read from the {split.main} spans, the fabric fit from "
            f"every mode's transfers; each mode's measured TTFT stands in the mode comparison",
            {"requests": split.requests, "main": split.main}))
    # A reduced read (kvtune.analysis.reduced): the fits read a larger sample than the frame.
    fit_in = traced.attrs.get("fit_inputs")
    tr = fit_in.transfers if fit_in is not None else transfers_table(traced)
    fabrics = sorted(set(tr["fabric"].dropna().astype(str)))
    if fabric is None and len(fabrics) > 1:
        serving = tr[(tr["mode"].astype("object") != "probe").to_numpy(dtype=bool)]
        counts = serving["fabric"].dropna().astype(str).value_counts()
        fabric = str(counts.index[0]) if len(counts) else fabrics[0]
        findings.append(Finding("fabric_chosen", "info",
                                f"the trace holds transfers on {fabrics}; the floor is fitted on "
                                f"{fabric!r} (most serving transfers); pass fabric=... to choose",
                                {"fabrics": fabrics, "fabric": fabric}))
    on_fabric = tr if fabric is None else tr[(tr["fabric"] == fabric).fillna(False).to_numpy(dtype=bool)]
    ops = sorted(set(on_fabric["op"].dropna().astype(str)))
    op = None
    if len(ops) > 1:
        op = "READ" if "READ" in ops else ops[0]
        findings.append(Finding("op_chosen", "info",
                                f"the transfers mix NIXL operations {ops}; the floor is fitted on "
                                f"{op} (what pull and bidirectional reuse use)",
                                {"ops": ops, "op": op}))
    fit, fit_source, f = _fit_with_probe_fallback(tr, n_boot=n_boot, seed=seed, fabric=fabric,
                                                  op=op, source=source)
    findings += f
    pre_main, pre_all = ((fit_in.prefill_of(split.main), fit_in.prefill_spans)
                         if fit_in is not None else (spans, traced))
    # The prefill cost is compute: a bidirectional prefill's kv.prefill span holds the reverse
    # READ it waited for, which the threshold prices with the fabric fit and the mode comparison
    # plays itself. Fitted with the wait left in, the attention term took the READ's growth with
    # the history and the per-token term fell to 0 (fleet lab: R^2 0.89 vs 0.99 compute only,
    # break-even 296 tokens where the paired sweep measured 148 [128, 230]).
    try:
        pc: PrefillCost = prefill_cost(without_reverse_wait(pre_main))
    except AnalysisError:
        if pre_main is pre_all:
            raise
        pc = prefill_cost(without_reverse_wait(pre_all))  # too few of the main mode's: every mode's
    wl: Workload = workload_of(spans)
    bpt, dpt, bpt_from = bytes_per_token_of(tr, geometry)
    if max_context_tokens is None:
        seen = list(wl.gap_tokens) + list(wl.prompt_tokens) + [pc.max_tokens_observed]
        max_context_tokens = int(max(seen)) if seen else 0
    first = tr["decode_start_ms"].dropna().astype(float) if "decode_start_ms" in tr else None
    pickup = pickup_of(first.to_numpy(), seed=seed) if first is not None else None
    thr, f = recommend_threshold(fit, pc, bytes_per_token=bpt, descriptors_per_token=dpt,
                                 max_context_tokens=max_context_tokens, pickup=pickup)
    findings += f
    thr_tokens = math.inf if thr.value == NEVER else float(thr.value)
    ttl, f = recommend_ttl(wl, bytes_per_token=bpt, hbm_budget_gb=hbm_budget_gb,
                           threshold_tokens=thr_tokens, seed=seed)
    findings += f
    mode_fit, loop_us, f = split_with_probe(fit, tr, bytes_per_token=bpt, descriptors_per_token=dpt,
                                            n_boot=n_boot, seed=seed, op=op)
    findings += f
    hits = local_prefix_hits(spans, tr)
    hops = router_hops(traced)  # the router's and the network's: the same in every mode
    measured = measured_ttft(traced)
    path = path_costs(traced)
    mode_prefill: dict[str, PrefillCost] = {}
    for m, other in split.others.items():  # engines sharing a host: each mode's own prefill
        try:
            mode_prefill[m] = prefill_cost(without_reverse_wait(other))
        except AnalysisError:
            continue
    block = block_tokens_of(tr, geometry)
    first_ms = float(first.median()) if first is not None and len(first) else None
    mode, f = recommend_mode(wl, mode_fit, pc, bytes_per_token=bpt, descriptors_per_token=dpt,
                             threshold=thr.value, ttl_s=float(ttl.value),
                             early_decode_ok=early_decode_ok, prefill_instances=prefill_instances,
                             use_simulator=use_simulator,
                             fit_source=f"floor fit ({fit_source}"
                             + ("; link bandwidth from the fabric probe)" if mode_fit is not fit
                                else ")"),
                             prefix_caching=hits.prefix_caching,
                             prefix_caching_source=(
                                 f"measured: the prefills' own prefix caches served "
                                 f"{hits.turns_with_local_hits} of {hits.later_turns} later turns "
                                 f"({hits.local_tokens} tokens)"),
                             first_step_ms=first_ms,
                             first_step_source=f"measured: KV ready -> first decode step "
                                               f"(kv.decode_start median of {0 if first is None else len(first)} "
                                               f"transfers); later steps take the same in the "
                                               f"simulator",
                             hops=hops if hops.hop_ms is not None else None,
                             measured=measured, main_mode=split.main,
                             traced_settings=traced_settings(spans),
                             traced_path=TracedPath(path, split.main, mode_prefill, block, loop_us))
    findings += f
    retention, f = _retention(spans, ttl_s=float(ttl.value), mode=str(mode.value),
                              threshold_tokens=thr_tokens, block_tokens=block)
    findings += f
    # vLLM's prefill lease (kv_lease_duration) from the prefills' holds: every mode's pulls
    lease, f = recommend_lease(prefill_lease_holds(traced))
    findings += f
    findings += readiness(tr, traced, fit=fit, workload=wl, fabric=fabric)
    unnamed = unnamed_time_finding(traced)  # where TTFT has no span's name (issue 33)
    findings += [unnamed] if unnamed is not None else []
    # What each Tempo source read (range, traces, spans) and whether its search was cut short.
    findings += [Finding(**f) for r in traced.attrs.get("tempo_reads", ()) for f in r.findings()]
    # A reduced read (kvtune.traces.reduce): what was sampled and how much wider the intervals are.
    sample = traced.attrs.get("sample")
    findings += [Finding(**f) for f in sample.findings()] if sample is not None else []
    extra = {
        "workload": wl.as_dict(), "prefill_cost": pc.as_dict(), "n_transfers": int(len(tr)),
        "bytes_per_token": bpt, "descriptors_per_token": dpt, "bytes_per_token_from": bpt_from,
        "hbm_budget_gb": hbm_budget_gb, "early_decode_ok": early_decode_ok,
        "fabric": fabric, "fit_source": fit_source, "router_hops": hops.as_dict(),
        "request_path": {m: v.as_dict() for m, v in path.items()}, "block_tokens": block,
        "clock_offsets_ns": dict(traced.attrs.get("clock_offsets_ns", {}) or {}),
        "skipped_records": len(traced.attrs.get("skipped", []) or []),
        "versions": versions_in(traced), "requests_by_mode": split.requests,
        "measured_ttft_ms": {m: v.as_dict() for m, v in measured.items()},
    }
    if sample is not None:
        extra["sample"] = sample.as_dict()
    if lease is not None:  # recommendation.json: extra.kv_lease_duration, shaped like the others
        extra[KV_LEASE_DURATION] = lease.as_dict()
    if traced.attrs.get("tempo_reads"):  # the source section: what each Tempo read got and missed
        extra["tempo_reads"] = [r.as_dict() for r in traced.attrs["tempo_reads"]]
    return Tuning(threshold=thr, ttl=ttl, mode=mode, findings=tuple(findings), fit=fit,
                  source=source, span_count=int(len(traced)), extra=extra, retention=retention)


def _retention(spans: pd.DataFrame, *, ttl_s: float, mode: str, threshold_tokens: float,
               block_tokens: int | None) -> tuple[dict[str, Any] | None, list[Finding]]:
    """Fixed TTL vs the renewable lease (:mod:`kvtune.recommend.retention`); a comparison that
    cannot be made, or fails, is a finding and leaves every other value as it is."""
    try:
        convs = conversations_of(spans)
        advice = compare_retention(convs, ttl_s=ttl_s, mode=mode, threshold_tokens=threshold_tokens,
                                   block_tokens=block_tokens or DEFAULT_BLOCK_TOKENS)
    except ValueError as exc:
        return None, [Finding("retention_not_compared", "info",
                              f"fixed TTL vs renewable lease not compared: {exc}", {})]
    except Exception as exc:  # advice on top of the TTL: never let it break the tuning
        logger.warning("retention comparison failed", exc_info=True)
        return None, [Finding("retention_comparison_failed", "warning",
                              f"fixed TTL vs renewable lease comparison failed "
                              f"({type(exc).__name__}: {exc}); the other values stand",
                              {"error": type(exc).__name__})]
    return advice.as_dict(), []
