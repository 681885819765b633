"""``kvtune analyze``: the analysis of one trace source as a frozen summary and its text form."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pandas as pd

from kvtune.analysis.fit import FloorFit, fit_floor
from kvtune.analysis.prefill import PrefillCost, prefill_cost
from kvtune.analysis.transfers import transfers as transfers_table
from kvtune.analysis.workload import Workload, workload
from kvtune.errors import AnalysisError


@dataclass(frozen=True)
class AnalysisSummary:
    """What one trace says. A part that cannot be computed holds its error message instead."""

    source: str
    span_count: int
    transfers: pd.DataFrame
    fits: dict[str, FloorFit | str]
    """Per fabric and NIXL operation (``"fabric READ"``): the floor fit, or why it failed."""
    prefill: PrefillCost | str
    workload: Workload | str
    clock_offsets_ns: dict[str, int] = field(default_factory=dict)
    """Per host, the clock offset the loader subtracted (``kvtune.traces.load``)."""

    def format(self) -> str:
        t = self.transfers
        lines = [f"source: {self.source}  spans: {self.span_count}  transfers: {len(t)}"]
        moved = {h: o for h, o in self.clock_offsets_ns.items() if o}
        if moved:
            lines.append("clock offsets corrected (ms): " + ", ".join(
                f"{h} {o / 1e6:+.3f}" for h, o in sorted(moved.items())))
        if len(t):
            by = t.groupby([t["mode"].astype(object).fillna("-"),
                            t["direction"].astype(object).fillna("-")]).size()
            lines.append("transfers by mode/direction: " + ", ".join(
                f"{m}/{d} {n}" for (m, d), n in by.items()))
            phase = t[["registration_ms", "rendezvous_ms", "descriptor_setup_ms", "rdma_ms",
                       "notify_ms", "decode_start_ms", "total_ms"]].astype(float)
            lines.append("phase medians (ms): " + ", ".join(
                f"{c[:-3]} {v:.3f}" for c, v in phase.median().items() if pd.notna(v)))
        for fabric, fit in self.fits.items():
            if isinstance(fit, str):
                lines.append(f"fit [{fabric}]: unavailable: {fit}")
                continue
            desc = (f", {fit.per_descriptor_us:.3g} us/descriptor "
                    f"[{fit.per_descriptor_ci_us[0]:.3g}, {fit.per_descriptor_ci_us[1]:.3g}]"
                    if fit.per_descriptor_us is not None and fit.per_descriptor_ci_us else "")
            lines.append(
                f"fit [{fabric}]: floor {fit.floor_ms:.3f} ms [{fit.floor_ci_ms[0]:.3f}, "
                f"{fit.floor_ci_ms[1]:.3f}], bandwidth {fit.bandwidth_gbps:.3g} Gbit/s "
                f"[{fit.bandwidth_ci_gbps[0]:.3g}, {fit.bandwidth_ci_gbps[1]:.3g}]{desc}; "
                f"R^2 {fit.r2:.3f}, {fit.n_transfers} transfers, {fit.n_sizes} sizes, "
                f"{fit.n_outliers} outliers")
        p = self.prefill
        lines.append(f"prefill: unavailable: {p}" if isinstance(p, str) else
                     f"prefill ({p.source}, {p.n_observations} obs): {p.base_ms:.3g} ms + "
                     f"{p.per_token_ms * 1e3:.3g} us/token + {p.per_token_prefix_us:.3g} us/token "
                     f"per 1k context; R^2 {p.r2:.3f}")
        w = self.workload
        lines.append(f"workload: unavailable: {w}" if isinstance(w, str) else
                     f"workload ({w.source}): {w.n_requests} requests, {w.qps:.3g} req/s, prompt "
                     f"p50/p90/p99 {w.prompt_tokens_p50:.0f}/{w.prompt_tokens_p90:.0f}/"
                     f"{w.prompt_tokens_p99:.0f} tokens, {w.n_conversations} conversations, "
                     f"multi-turn share {w.multi_turn_share:.0%}, {len(w.gaps_s)} gaps, "
                     f"reuse {w.reuse_outcomes or '-'}")
        return "\n".join(lines)


def _try(fn, *a, **k):
    try:
        return fn(*a, **k)
    except AnalysisError as exc:
        return str(exc)


def summarize(spans: pd.DataFrame, *, n_boot: int = 200, seed: int = 0) -> AnalysisSummary:
    """Transfers table, a floor fit per fabric, prefill cost and workload of ``spans``. Raises
    :class:`AnalysisError` only when the spans hold no transfer at all."""
    t = transfers_table(spans)
    keys = t[["fabric", "op"]].astype(object).fillna("-").drop_duplicates()
    fits: dict[str, FloorFit | str] = {}
    for fabric, op in sorted(keys.itertuples(index=False, name=None)):
        sel = ((t["fabric"].astype(object).fillna("-") == fabric)
               & (t["op"].astype(object).fillna("-") == op))
        if not t.loc[sel.to_numpy(dtype=bool), "critical_ms"].notna().any():
            continue  # e.g. notify-only remnants of transfers that never ran
        fits[f"{fabric} {op}"] = _try(fit_floor, t[sel.to_numpy(dtype=bool)], n_boot=n_boot,
                                      seed=seed)
    src = spans.attrs.get("sources") or ["<DataFrame>"]
    return AnalysisSummary(source=", ".join(map(str, src)), span_count=len(spans), transfers=t,
                           fits=fits, prefill=_try(prefill_cost, spans),
                           workload=_try(workload, spans),
                           clock_offsets_ns=dict(spans.attrs.get("clock_offsets_ns") or {}))


def analyze_source(source: str | list[str], *, transfers_csv: str | os.PathLike[str] | None = None,
                   skip_bad: bool = False, n_boot: int = 200) -> AnalysisSummary:
    """Load ``source`` with ``kvtune.traces.load`` and :func:`summarize` it; optionally write the
    transfers table to ``transfers_csv``."""
    from kvtune.traces import load

    s = summarize(load(source, skip_bad=skip_bad), n_boot=n_boot)
    if transfers_csv is not None:
        s.transfers.to_csv(transfers_csv, index=False)
    return s
