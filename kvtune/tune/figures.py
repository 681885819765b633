"""The data behind each notebook figure, computed from analysis results (so notebooks stay thin)."""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pandas as pd

from kvtune.errors import AnalysisError

log = logging.getLogger(__name__)


def fit_groups(tx: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The transfers of each group `fits_by_fabric` fits, by the same keys."""
    fabric = tx["fabric"].astype("object").where(tx["fabric"].notna(), "(unnamed)")
    op = tx["op"].astype("object").where(tx["op"].notna(), "?")
    kind = np.where((tx["mode"].astype("object") == "probe").to_numpy(dtype=bool), "probe",
                    "serving")
    return {f"{fab} {o} ({k})": grp
            for (fab, k, o), grp in tx.groupby([fabric.to_numpy(), kind, op.to_numpy()])}


def fits_by_fabric(tx: pd.DataFrame, *, seed: int = 0) -> dict[str, Any]:
    """One floor fit per fabric, NIXL op and kind (probe transfers apart from serving ones).

    A group the fit cannot support is reported as the AnalysisError's message instead of a fit."""
    from kvtune.analysis import fit_floor

    out: dict[str, Any] = {}
    for key, grp in fit_groups(tx).items():
        fab, o = grp["fabric"].iloc[0], grp["op"].iloc[0]
        fab = "(unnamed)" if pd.isna(fab) else str(fab)
        o = "?" if pd.isna(o) else str(o)
        try:
            out[key] = fit_floor(grp.assign(fabric=fab, op=o), seed=seed, fabric=fab, op=o)
        except AnalysisError as exc:
            out[key] = str(exc)
    return out


def ttl_curve(tuning: Any, workload: Any, *, points: int = 60) -> dict[str, Any]:
    """Captured reuse and HBM held over a TTL grid, from the workload's gaps (see recommend.ttl)."""
    from kvtune.recommend.ttl import captured_share, retained_gb

    gaps = np.asarray(workload.gaps_s, dtype=float)
    toks = (np.asarray(workload.gap_tokens, dtype=float) if workload.gap_tokens
            else np.zeros(len(gaps)))
    finals = np.asarray(workload.final_tokens, dtype=float)
    bpt = float(tuning.extra.get("bytes_per_token") or 0.0)
    thr = tuning.threshold.value
    thr_tokens = float(thr) if isinstance(thr, (int, float)) else float("inf")
    chosen = float(tuning.ttl.value)
    top = max(chosen * 1.5, float(gaps.max()) * 1.5 if len(gaps) else 0.0, 10.0)
    grid = np.linspace(0.0, top, points)
    captured = [captured_share(t, gaps, toks, thr_tokens) for t in grid]
    held = [retained_gb(t, gaps, toks, finals, bpt, workload.duration_s) for t in grid]
    return {"ttls_s": grid.tolist(), "captured": captured, "held_gb": held, "chosen_s": chosen,
            "router_s": tuning.ttl.evidence.router_params_ttl_s}

