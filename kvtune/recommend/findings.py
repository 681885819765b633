"""Readiness findings from the transfers table and spans: stalls, TCP fallback, errors, fit quality,
mixed vLLM/NIXL releases."""
from __future__ import annotations

import numpy as np
import pandas as pd

from kvtune import spans as sc
from kvtune.analysis.attribution import named_shares, request_attribution
from kvtune.analysis.fit import FloorFit
from kvtune.analysis.stalls import EXTRA_COLS, STALL_MS, stall_diagnosis
from kvtune.analysis.workload import Workload
from kvtune.local.layout import ONE_PROCESS_ENV, QUIET
from kvtune.errors import AnalysisError
from kvtune.recommend.results import Finding

RDMA_FABRIC_WORDS = ("rdma", "efa", "ib", "infiniband", "roce", "rc", "ud", "dc")
"""A fabric whose name holds one of these words is meant to run over RDMA (not TCP)."""
TCP_TRANSPORTS = ("tcp",)
LOW_R2 = 0.9
"""Below this, the floor/bandwidth line explains too little of the transfer times to trust."""
OUTLIER_SHARE = 0.1
EXPIRED_SHARE = 0.2
"""More than this share of reuse decisions finding expired history suggests a too-short TTL."""
UNNAMED_SHARE_LIMIT = 0.05
"""Unnamed time above this share of TTFT at the per-request median is a finding (issue 33: every
millisecond of TTFT named, 95% at the median)."""
STARVED_SHARE = 0.05
"""At least this share of requests over 1 s, with the time outside the transfer, is a finding."""
OUTSIDE_TRANSFER_COLS = EXTRA_COLS
"""Stall-diagnosis columns that are not the KV transfer itself."""


VERSIONED = {"vllm": sc.VLLM_VERSION, "nixl": sc.NIXL_VERSION}
"""Software whose version the spans' resources carry (``kvtune.telemetry.build_resource``)."""


def versions_in(spans: pd.DataFrame) -> dict[str, dict[str, list[str]]]:
    """``{"vllm": {version: [services]}, "nixl": {...}}`` from the spans' resource attributes
    (empty inner dicts when the trace does not say)."""
    out: dict[str, dict[str, set[str]]] = {k: {} for k in VERSIONED}
    if "resource" in spans.columns and len(spans):
        res = spans["resource"].to_numpy()
        svc = (spans["service"].astype("object").to_numpy() if "service" in spans.columns
               else np.full(len(res), "", dtype=object))
        ids = np.fromiter((id(r) for r in res), dtype=np.int64, count=len(res))
        # Rows of one resource share one dict: look at each (resource, service) run once.
        first = np.r_[True, (ids[1:] != ids[:-1]) | (svc[1:] != svc[:-1])]
        for r, service in zip(res[first], svc[first]):
            if not isinstance(r, dict):
                continue
            for name, key in VERSIONED.items():
                if r.get(key) is not None:
                    out[name].setdefault(str(r[key]), set()).add(str(service or "?"))
    return {name: {v: sorted(s) for v, s in sorted(d.items())} for name, d in out.items()}


def mixed_versions(versions: dict[str, dict[str, list[str]]]) -> Finding | None:
    """A finding when the trace's processes ran more than one vLLM or NIXL release."""
    mixed = {name: by_version for name, by_version in versions.items() if len(by_version) > 1}
    if not mixed:
        return None
    parts = [f"{name} " + ", ".join(f"{v} ({', '.join(svcs)})" for v, svcs in by_version.items())
             for name, by_version in mixed.items()]
    return Finding(
        "mixed_versions", "warning",
        f"the trace mixes releases: {'; '.join(parts)}. Engines of one P/D pair should run the same "
        f"vLLM and NIXL (their connector metadata and handshake change between releases), and "
        f"timings from different releases do not fit one line: re-measure with one release",
        {"versions": mixed})


def _is_rdma_fabric(name: str) -> bool:
    words = name.lower().replace("_", "-").replace(".", "-").split("-")
    return any(w in RDMA_FABRIC_WORDS for w in words)


def readiness(transfers: pd.DataFrame, spans: pd.DataFrame, *, fit: FloorFit | None,
              workload: Workload | None, fabric: str | None = None) -> list[Finding]:
    """Findings about the deployment's readiness (see module constants)."""
    out: list[Finding] = []
    mixed = mixed_versions(versions_in(spans))
    if mixed is not None:
        out.append(mixed)
    phase_cols = [sc.PHASE_COLUMNS[p] for p in sc.PHASES]
    phases = transfers[phase_cols].astype(float).copy()
    # A push rendezvous that began with the registration waits for the prefill to compute: long
    # prompts make it long without anything being stuck.
    waiting = (transfers["first_arrival"] == sc.FirstArrival.REGISTRATION.value).fillna(False)
    phases.loc[waiting.to_numpy(dtype=bool), "rendezvous_ms"] = float("nan")
    stalled_mask = (phases.fillna(0) > STALL_MS).any(axis=1).to_numpy(dtype=bool)
    stalled = transfers[stalled_mask]
    if len(stalled):
        sp = phases[stalled_mask]
        worst_col = sp.max().idxmax()
        worst = stalled.loc[sp[worst_col].idxmax()]
        out.append(Finding(
            "stalled_transfers", "warning",
            f"{len(stalled)} of {len(transfers)} transfer(s) have a phase longer than "
            f"{STALL_MS:g} ms (worst: {worst['transfer_id']} {worst_col} = "
            f"{float(worst[worst_col]):.0f} ms)",
            {"count": len(stalled), "worst_transfer_id": str(worst["transfer_id"]),
             "worst_phase": worst_col, "worst_ms": float(worst[worst_col])}))
    starved = _stalls_outside_transfer(transfers, spans)
    if starved is not None:
        out.append(starved)
    errors = transfers[(transfers["status"].astype("object") == "ERROR").to_numpy(dtype=bool)]
    if len(errors):
        out.append(Finding("transfer_errors", "warning",
                           f"{len(errors)} of {len(transfers)} transfer(s) ended in ERROR",
                           {"count": len(errors),
                            "transfer_ids": [str(x) for x in errors["transfer_id"].head(5)]}))
    if sc.TRANSPORT in spans.columns:
        sub = spans[spans[sc.TRANSPORT].notna().to_numpy(dtype=bool)]
        fabrics = (sub[sc.FABRIC].astype("object") if sc.FABRIC in sub.columns
                   else pd.Series(None, index=sub.index, dtype="object"))
        if fabric is not None:
            fabrics = fabrics.where(fabrics.notna(), fabric)
        tcp = sub[sc.TRANSPORT].astype(str).str.lower().str.contains("|".join(TCP_TRANSPORTS))
        rdma = fabrics.map(lambda f: isinstance(f, str) and _is_rdma_fabric(f))
        bad = (tcp & rdma).to_numpy(dtype=bool)
        if bad.any():
            names = sorted(set(fabrics[bad].astype(str)))
            out.append(Finding(
                "tcp_fallback", "warning",
                f"{int(bad.sum())} span(s) on fabric(s) {names} report transport "
                f"{sorted(set(sub.loc[bad, sc.TRANSPORT].astype(str)))}: UCX fell back to TCP on a "
                f"fabric meant for RDMA; check UCX_TLS, the RDMA devices and the NIXL backend",
                {"count": int(bad.sum()), "fabrics": names}))
    if fit is not None:
        if fit.r2 < LOW_R2:
            out.append(Finding("fit_low_r2", "warning",
                               f"the floor/bandwidth fit explains little (R^2 {fit.r2:.2f} < "
                               f"{LOW_R2}); transfer times vary for reasons other than size",
                               {"r2": fit.r2}))
        if fit.n_outliers > OUTLIER_SHARE * fit.n_transfers:
            out.append(Finding("fit_outliers", "info",
                               f"{fit.n_outliers} of {fit.n_transfers} transfers were down-weighted "
                               f"as outliers", {"n_outliers": fit.n_outliers}))
        if fit.per_descriptor_us is None:
            out.append(Finding("per_descriptor_not_identifiable", "info",
                               "descriptor counts do not vary apart from bytes: the per-descriptor "
                               "cost is folded into the bandwidth (run the probe with both "
                               "layouts to separate them)", {}))
    if workload is not None and workload.reuse_outcomes:
        total = sum(workload.reuse_outcomes.values())
        expired = workload.reuse_outcomes.get(sc.ReuseOutcome.EXPIRED.value, 0)
        if total and expired / total > EXPIRED_SHARE:
            out.append(Finding("reuse_expired", "info",
                               f"{expired} of {total} reuse decisions found the history expired: "
                               f"the TTL in force was shorter than the gaps",
                               {"expired": expired, "total": total}))
    return out


def _stalls_outside_transfer(transfers: pd.DataFrame, spans: pd.DataFrame) -> Finding | None:
    """Requests over 1 s whose extra time is not in the transfer: the engines waited for CPU.

    The pattern kvtune found on its own CPU pair: NIXL's UCX progress thread spins a whole core per
    agent (``pthrDelay = 0``) and vLLM's CPU worker process busy-polls its order queue, and where
    each engine has about one core they starve the engine's own threads. The spans show it as time
    in the engines' queues and between phases, while READ/WRITE and descriptor setup stay short."""
    try:
        diag = stall_diagnosis(transfers, spans)
    except AnalysisError:
        return None
    if (diag.n_stalled == 0 or diag.stalled_share < STARVED_SHARE
            or diag.dominant_phase not in OUTSIDE_TRANSFER_COLS):
        return None
    table = diag.table[diag.table["stalled"]]
    phase_cols = [c for c in (sc.PHASE_COLUMNS[p] for p in sc.PHASES) if c in table.columns]
    transfer_ms = float(table[phase_cols].fillna(0).sum(axis=1).median()) if phase_cols else 0.0
    delays: list[int] = []
    decode_delays: list[int] = []
    if sc.NIXL_PROGRESS_DELAY_US in spans.columns:
        seen = spans[spans[sc.NIXL_PROGRESS_DELAY_US].notna().to_numpy(dtype=bool)]
        delays = sorted({int(d) for d in seen[sc.NIXL_PROGRESS_DELAY_US]})
        if sc.ROLE in seen.columns:
            dec = seen[(seen[sc.ROLE].astype("object") == sc.Role.DECODE.value).to_numpy()]
            decode_delays = [int(d) for d in dec[sc.NIXL_PROGRESS_DELAY_US]]
    spinning = not decode_delays or min(decode_delays) == 0
    setting = QUIET.kv_extra_config("pull")
    env = " ".join(f"{k}={v}" for k, v in ONE_PROCESS_ENV.items())
    advice = (f"if each engine has about one CPU core, two busy-pollers are the likely cause: "
              f"NIXL's progress thread spinning a core per agent, and, on vLLM's CPU platform, the "
              f"separate worker process polling its shared-memory queue for 1 s after every step. "
              f"Set kv_connector_extra_config {setting} (kvtune connectors: no NIXL progress thread, "
              f"UCX advances inside the engine's calls; an idle engine holding blocks waits for "
              f"work instead of stepping) and, on CPU engines, {env} (the model runs in the engine "
              f"process, as on a one-GPU engine); kvtune's local pair went from 3-19 of 30 requests "
              f"over 1 s to none in every mode with both (examples/stalls-side-by-side), or give "
              f"each engine spare cores" if spinning else
              "NIXL's agents here do not spin (their progress threads sleep, or they have none): "
              "look for other CPU-bound work on the engines' cores (on vLLM's CPU platform, the "
              f"worker process's polling: {env})")
    return Finding(
        "stalls_outside_transfer", "warning",
        f"{diag.n_stalled} of {diag.n_requests} requests took over {diag.threshold_ms:g} ms "
        f"(p50 {diag.p50_ms:.0f} ms, p99 {diag.p99_ms:.0f} ms); their extra time is in "
        f"{diag.dominant_phase.removesuffix('_ms')} "
        f"(+{diag.phase_excess_ms[diag.dominant_phase]:.0f} ms median over fast requests) while "
        f"their transfer phases took {transfer_ms:.1f} ms: the engines waited for CPU, not for "
        f"the fabric; {advice}",
        {"stalled": diag.n_stalled, "requests": diag.n_requests,
         "stalled_share": diag.stalled_share, "p50_ms": diag.p50_ms, "p99_ms": diag.p99_ms,
         "dominant_phase": diag.dominant_phase,
         "phase_excess_ms": diag.phase_excess_ms, "stalled_transfer_ms_median": transfer_ms,
         "slow_trace": diag.slow_trace, "fast_trace": diag.fast_trace,
         "progress_delay_us_seen": delays,
         "setting": setting if spinning else None,
         "setting_env_cpu": dict(ONE_PROCESS_ENV)})


def unnamed_time_finding(spans: pd.DataFrame) -> Finding | None:
    """Finding ``ttft_unnamed`` when, in some serving mode, the median request leaves more than
    :data:`UNNAMED_SHARE_LIMIT` of its TTFT unnamed; it names where that time sits."""
    by_mode = named_shares(request_attribution(spans))
    over = {m: s for m, s in by_mode.items()
            if m != sc.Mode.PROBE.value and 1.0 - s.named_share_p50 > UNNAMED_SHARE_LIMIT}
    if not over:
        return None
    parts = [f"{m}: {1 - s.named_share_p50:.0%} of TTFT at the median ({s.unnamed_ms_p50:.3g} ms "
             f"of {s.ttft_ms_p50:.3g} ms), mostly between {s.gap_after} and {s.gap_before}"
             for m, s in sorted(over.items())]
    return Finding(
        "ttft_unnamed", "info",
        "time to first token no span names: " + "; ".join(parts) + ". The router's leg spans "
        f"({sc.SpanName.PREFILL_LEG.value}, {sc.SpanName.HANDOFF.value}, "
        f"{sc.SpanName.DECODE_LEG.value}) name the legs' hops and the API servers' intake; a trace "
        "without them leaves these unexplained",
        {"limit_share": UNNAMED_SHARE_LIMIT,
         "modes": {m: s.as_dict() for m, s in sorted(over.items())}})
