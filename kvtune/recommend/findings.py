"""Readiness findings from the transfers table and spans: stalls, TCP fallback, errors, fit quality."""
from __future__ import annotations

import pandas as pd

from kvtune import spans as sc
from kvtune.analysis.fit import FloorFit
from kvtune.analysis.workload import Workload
from kvtune.recommend.results import Finding

STALL_MS = 1000.0
"""A transfer phase longer than 1 s is a stall (a lost notification, a hung registration...)."""
RDMA_FABRIC_WORDS = ("rdma", "efa", "ib", "infiniband", "roce", "rc", "ud", "dc")
"""A fabric whose name holds one of these words is meant to run over RDMA (not TCP)."""
TCP_TRANSPORTS = ("tcp",)
LOW_R2 = 0.9
"""Below this, the floor/bandwidth line explains too little of the transfer times to trust."""
OUTLIER_SHARE = 0.1
EXPIRED_SHARE = 0.2
"""More than this share of reuse decisions finding expired history suggests a too-short TTL."""


def _is_rdma_fabric(name: str) -> bool:
    words = name.lower().replace("_", "-").replace(".", "-").split("-")
    return any(w in RDMA_FABRIC_WORDS for w in words)


def readiness(transfers: pd.DataFrame, spans: pd.DataFrame, *, fit: FloorFit | None,
              workload: Workload | None, fabric: str | None = None) -> list[Finding]:
    """Findings about the deployment's readiness (see module constants)."""
    out: list[Finding] = []
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
