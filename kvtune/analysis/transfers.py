"""The transfers table: one row per KV movement, one duration column per phase.

A KV movement is the set of phase spans (``spans.PHASES``) sharing ``kv.transfer_id``; spans without
a transfer id are ignored. A phase emitted by several spans (one per TP rank) lasts from the first
start to the last end. Sizes (tokens, blocks, bytes, descriptors) are per rank, preferring the
initiator's ``kv.rdma`` span. Missing phases are NA, never 0.
"""
from __future__ import annotations

import logging
import math

import numpy as np
import pandas as pd

from kvtune import spans as sc
from kvtune.errors import AnalysisError

logger = logging.getLogger(__name__)

TRANSFER_COLUMNS: tuple[str, ...] = (
    "transfer_id", "trace_id", "request_id", "base_request_id", "conversation_id", "turn", "mode",
    "direction", "op", "tokens", "blocks", "bytes", "descriptors", "initiator_host", "target_host",
    "fabric", "registration_ms", "rendezvous_ms", "first_arrival", "descriptor_setup_ms", "rdma_ms",
    "notify_ms", "decode_start_ms", "total_ms", "critical_ms", "start_ns", "end_ns", "nixl_post_us",
    "nixl_xfer_us", "status",
)
"""Columns of :func:`transfers`'s table, in order (docs/contracts.md)."""

CLOCK_TOLERANCE_NS = 1_000_000
"""A cross-host notify may end up to 1 ms before the RDMA post it confirms (residual clock error
after the loader's correction); beyond that it violates causality."""
SKEWED_SHARE = 0.2
"""If more than this share of a host pair's transfers violate causality, the hosts' clocks are
skewed (not a few stray spans): refuse instead of dropping phases."""
UNIT_RATIO_LIMIT = 100.0
"""``kv.nixl.xfer_us`` and the ``kv.rdma`` span time the same thing; when a producer's median
differs by a factor over 100 (ms or ns written into a ``_us`` attribute is 1000x) the units are mixed."""
BYTES_PER_BLOCK_SPREAD_LIMIT = 512.0
"""``kv.bytes / kv.blocks`` is fixed by the model; a spread over 512x within one fabric and mode
(KiB vs bytes is 1024x) means mixed units."""

_STRING = "string"
_SIZE_ATTRS = {"tokens": sc.TOKENS, "blocks": sc.BLOCKS, "bytes": sc.BYTES,
               "descriptors": sc.DESCRIPTORS}
_ID_ATTRS = {"trace_id": "trace_id", "request_id": sc.REQUEST_ID,
             "base_request_id": sc.BASE_REQUEST_ID, "conversation_id": sc.CONVERSATION_ID,
             "turn": sc.TURN, "mode": sc.MODE, "direction": sc.DIRECTION, "op": sc.NIXL_OP,
             "fabric": sc.FABRIC}
_DTYPES: dict[str, str] = {
    **{c: _STRING for c in ("transfer_id", "trace_id", "request_id", "base_request_id",
                            "conversation_id", "mode", "direction", "op", "initiator_host",
                            "target_host", "fabric", "first_arrival", "status")},
    **{c: "Int64" for c in ("turn", "tokens", "blocks", "bytes", "descriptors", "start_ns",
                            "end_ns")},
    **{c: "Float64" for c in ("registration_ms", "rendezvous_ms", "descriptor_setup_ms", "rdma_ms",
                              "notify_ms", "decode_start_ms", "total_ms", "critical_ms",
                              "nixl_post_us", "nixl_xfer_us")},
}


def empty_transfers() -> pd.DataFrame:
    """A transfers table with no rows and the contract's columns and dtypes."""
    return pd.DataFrame({c: pd.Series([], dtype=_DTYPES[c]) for c in TRANSFER_COLUMNS})


def _col(spans: pd.DataFrame, name: str) -> pd.Series:
    """A convention attribute column, or all-NA when the frame lacks it."""
    if name in spans.columns:
        return spans[name]
    return pd.Series(pd.NA, index=spans.index, dtype="object")


def _require(spans: pd.DataFrame, columns: tuple[str, ...]) -> None:
    missing = [c for c in columns if c not in spans.columns]
    if missing:
        raise AnalysisError(f"spans frame: missing column(s) {missing}; expected the shape of "
                            f"kvtune.traces.load (docs/contracts.md)")


def _phase_spans(spans: pd.DataFrame) -> pd.DataFrame:
    _require(spans, ("trace_id", "name", "host", "start_ns", "end_ns", "status"))
    phase_names = {p.value for p in sc.PHASES}
    tid = _col(spans, sc.TRANSFER_ID)
    sel = spans["name"].astype("object").isin(phase_names) & tid.notna()
    if not sel.any():
        counts = spans["name"].astype("object").value_counts().head(8).to_dict()
        with_tid = int(tid.notna().sum())
        raise AnalysisError(
            f"spans: no KV transfers: need phase spans ({', '.join(sorted(phase_names))}) carrying "
            f"{sc.TRANSFER_ID}; got {len(spans)} span(s), {with_tid} with a transfer id, "
            f"names {counts}")
    ph = spans.loc[sel].copy()
    ph["_tid"] = tid[sel].astype("object")
    backwards = (ph["end_ns"].astype("int64") < ph["start_ns"].astype("int64")).to_numpy(dtype=bool)
    if backwards.any():
        bad = ph[backwards].iloc[0]
        raise AnalysisError(
            f"spans: {int(backwards.sum())} phase span(s) end before they start (e.g. "
            f"{bad['name']} of {bad['_tid']} on host {bad['host']!r}: start {int(bad['start_ns'])}, "
            f"end {int(bad['end_ns'])}); expected endTimeUnixNano >= startTimeUnixNano")
    warm = _col(ph, sc.PROBE_WARMUP).astype("boolean").fillna(False)
    warm_ids = set(ph.loc[warm.to_numpy(dtype=bool), "_tid"])
    if warm_ids:
        logger.debug("dropping %d probe warm-up transfer(s)", len(warm_ids))
        ph = ph[~ph["_tid"].isin(warm_ids)]
    if ph.empty:
        raise AnalysisError(f"spans: no KV transfers left after dropping {len(warm_ids)} probe "
                            f"warm-up transfer(s) ({sc.PROBE_WARMUP}=true)")
    return ph


def _drop_acausal_notifies(ph: pd.DataFrame) -> pd.DataFrame:
    """Drop notify spans that end before their transfer's RDMA started (same host: warn; many on a
    host pair: clocks are skewed -> AnalysisError)."""
    rdma = ph[ph["name"].astype("object") == sc.SpanName.RDMA.value]
    notify = ph[ph["name"].astype("object") == sc.SpanName.NOTIFY.value]
    if rdma.empty or notify.empty:
        return ph
    r = rdma.groupby("_tid").agg(r_start=("start_ns", "min"), r_host=("host", "first"))
    n = notify[["_tid", "end_ns", "host"]].join(r, on="_tid", how="inner")
    if n.empty:
        return ph
    same = n["host"].astype("object") == n["r_host"].astype("object")
    gap = n["end_ns"].astype("int64") - n["r_start"].astype("int64")
    bad_same = same & (gap < 0)
    bad_cross = ~same & (gap < -CLOCK_TOLERANCE_NS)
    pair = n["r_host"].astype("object") + " -> " + n["host"].astype("object")
    for p in sorted(set(pair[~same])):
        in_pair = (pair == p) & ~same
        n_bad = int((bad_cross & in_pair).sum())
        if n_bad and n_bad > SKEWED_SHARE * int(in_pair.sum()):
            worst_ms = float(-gap[bad_cross & in_pair].min()) / 1e6
            raise AnalysisError(
                f"spans: clocks of hosts {p} look skewed: {n_bad} of {int(in_pair.sum())} "
                f"transfer(s) have the target's {sc.SpanName.NOTIFY.value} end before the "
                f"initiator's {sc.SpanName.RDMA.value} started (by up to {worst_ms:.3f} ms); load the "
                f"spans with kvtune.traces.load(..., correct_clocks=True) or sync the hosts' clocks")
    bad = bad_same | bad_cross
    if bad.any():
        logger.warning("dropping %d %s span(s) that end before their transfer's %s started "
                       "(%d same-host, %d cross-host); their notify_ms is NA",
                       int(bad.sum()), sc.SpanName.NOTIFY.value, sc.SpanName.RDMA.value,
                       int(bad_same.sum()), int(bad_cross.sum()))
        ph = ph.drop(index=n.index[bad.to_numpy(dtype=bool)])
    return ph


def _groups(out: pd.DataFrame, cols: tuple[str, ...]):
    keys = [out[c].astype(object).fillna("-") for c in cols]
    return out.groupby(keys, sort=True)


def _check_units(out: pd.DataFrame) -> None:
    """Mixed units are systematic (one producer writes ms into a ``_us`` attribute, KiB into
    ``kv.bytes``): judge each producer group's median, so a single stalled transfer whose span
    outlasts NIXL's own timing is not mistaken for a unit error."""
    both = (out["rdma_ms"].notna() & out["nixl_xfer_us"].notna() & (out["rdma_ms"] > 0)
            & (out["nixl_xfer_us"] > 0)).to_numpy(dtype=bool)
    if both.any():
        sub = out[both].assign(_ratio=(out.loc[both, "nixl_xfer_us"] / 1e3
                                       / out.loc[both, "rdma_ms"]).astype(float))
        for key, g in _groups(sub, ("initiator_host", "mode")):
            med = float(g["_ratio"].median())
            if med > UNIT_RATIO_LIMIT or med < 1.0 / UNIT_RATIO_LIMIT:
                raise AnalysisError(
                    f"spans: mixed units: on {len(g)} transfer(s) initiated by {key[0]} "
                    f"(mode {key[1]}) {sc.NIXL_XFER_US} is {med:.3g}x the {sc.SpanName.RDMA.value} "
                    f"span's duration (e.g. {g['transfer_id'].iloc[0]}: "
                    f"{float(g['nixl_xfer_us'].iloc[0]):.6g} us vs {float(g['rdma_ms'].iloc[0]):.6g} "
                    f"ms); expected microseconds in {sc.NIXL_XFER_US}")
    ok = (out["bytes"].notna() & out["blocks"].notna() & (out["blocks"] > 0)
          & (out["bytes"] > 0)).to_numpy(dtype=bool)
    if ok.sum() >= 2:
        sub = out[ok].assign(_bpb=(out.loc[ok, "bytes"] / out.loc[ok, "blocks"]).astype(float))
        for key, g in _groups(sub, ("fabric", "mode")):
            lo, hi = float(g["_bpb"].min()), float(g["_bpb"].max())
            if hi / lo > BYTES_PER_BLOCK_SPREAD_LIMIT:
                raise AnalysisError(
                    f"spans: mixed units: {sc.BYTES}/{sc.BLOCKS} ranges from {lo:.6g} to {hi:.6g} "
                    f"bytes per block across {len(g)} transfer(s) on fabric {key[0]} (mode "
                    f"{key[1]}); one model's block size is fixed: expected {sc.BYTES} in bytes on "
                    f"every span")


def transfers(spans: pd.DataFrame) -> pd.DataFrame:
    """One row per KV movement with exactly :data:`TRANSFER_COLUMNS` (see docs/contracts.md).

    Raises :class:`AnalysisError` when the spans hold no transfer, on mixed units, or when hosts'
    clocks are skewed. Probe warm-ups are dropped; a notify that ends before its RDMA started is
    dropped with a warning (its phase becomes NA). The input is not modified.
    """
    ph = _phase_spans(spans)
    ph = _drop_acausal_notifies(ph)
    ph["_name"] = ph["name"].astype("object")
    ph["_start"] = ph["start_ns"].astype("int64")
    ph["_end"] = ph["end_ns"].astype("int64")

    # Phase durations: first start -> last end of each phase's spans.
    g = ph.groupby(["_tid", "_name"], sort=False).agg(s=("_start", "min"), e=("_end", "max"))
    dur = ((g["e"] - g["s"]) / 1e6).unstack("_name")
    st = ph["status"].astype(object)
    ph["_err"] = (st == "ERROR").to_numpy(dtype=bool)
    ph["_ok"] = (st == "OK").to_numpy(dtype=bool)
    bounds = ph.groupby("_tid", sort=False).agg(start_ns=("_start", "min"), end_ns=("_end", "max"),
                                                err=("_err", "any"), ok=("_ok", "any"))
    bounds["status"] = np.where(bounds["err"], "ERROR", np.where(bounds["ok"], "OK", "UNSET"))
    ids = bounds.index

    # Attributes: prefer the initiator's rdma span, then descriptor setup, then anything.
    prio = {sc.SpanName.RDMA.value: 0, sc.SpanName.DESCRIPTOR_SETUP.value: 1}
    ordered = ph.assign(_p=ph["_name"].map(prio).fillna(9)).sort_values(["_p", "_start"],
                                                                          kind="stable")
    attr_cols = {**_ID_ATTRS, **_SIZE_ATTRS, "nixl_post_us": sc.NIXL_POST_US,
                 "nixl_xfer_us": sc.NIXL_XFER_US}
    pick = pd.DataFrame({out: _col(ordered, src) for out, src in attr_cols.items()}, index=ordered.index)
    pick = pick.astype("object").where(pick.notna(), None)
    pick["_tid"] = ordered["_tid"]
    first = pick.groupby("_tid", sort=False).first().reindex(ids)

    def host_of(name: sc.SpanName) -> pd.Series:
        sub = ordered[ordered["_name"] == name.value]
        return sub.groupby("_tid", sort=False)["host"].first().reindex(ids)

    rend = ordered[ordered["_name"] == sc.SpanName.RENDEZVOUS.value]
    first_arrival = _col(rend, sc.FIRST_ARRIVAL).astype("object")
    first_arrival = first_arrival.where(first_arrival.notna(), None)
    fa = pd.Series(first_arrival.to_numpy(), index=rend["_tid"].to_numpy()).groupby(level=0).first()

    initiator = host_of(sc.SpanName.RDMA).combine_first(host_of(sc.SpanName.DESCRIPTOR_SETUP))
    target = host_of(sc.SpanName.NOTIFY).combine_first(host_of(sc.SpanName.REGISTRATION))

    cols: dict[str, object] = {"transfer_id": ids.to_numpy(dtype=object)}
    for c in list(_ID_ATTRS) + list(_SIZE_ATTRS):
        cols[c] = first[c].to_numpy(dtype=object)
    cols["initiator_host"] = initiator.to_numpy(dtype=object)
    cols["target_host"] = target.to_numpy(dtype=object)
    for phase in sc.PHASES:
        c = sc.PHASE_COLUMNS[phase]
        cols[c] = (dur[phase.value].reindex(ids).to_numpy(dtype=float)
                   if phase.value in dur.columns else np.full(len(ids), math.nan))
    cols["first_arrival"] = fa.reindex(ids).to_numpy(dtype=object)
    cols["total_ms"] = ((bounds["end_ns"] - bounds["start_ns"]) / 1e6).to_numpy(dtype=float)
    setup = np.asarray(cols["descriptor_setup_ms"], dtype=float)
    rdma = np.asarray(cols["rdma_ms"], dtype=float)
    crit = np.where(np.isnan(setup) & np.isnan(rdma), np.nan,
                    np.nan_to_num(setup) + np.nan_to_num(rdma))
    cols["critical_ms"] = crit
    cols["start_ns"] = bounds["start_ns"].to_numpy()
    cols["end_ns"] = bounds["end_ns"].to_numpy()
    cols["nixl_post_us"] = first["nixl_post_us"].to_numpy(dtype=object)
    cols["nixl_xfer_us"] = first["nixl_xfer_us"].to_numpy(dtype=object)
    cols["status"] = bounds["status"].to_numpy(dtype=object)

    out = pd.DataFrame({c: pd.array(_na(cols[c]), dtype=_DTYPES[c]) for c in TRANSFER_COLUMNS})
    out = out.sort_values(["start_ns", "transfer_id"], kind="stable").reset_index(drop=True)
    _check_units(out)
    return out


def _na(values: object) -> list:
    """Values with None/NaN as pd.NA, ready for a nullable array."""
    res = []
    for v in np.asarray(values, dtype=object):
        if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
            res.append(pd.NA)
        else:
            res.append(v.item() if isinstance(v, np.generic) else v)
    return res
