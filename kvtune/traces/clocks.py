"""Clock offsets between hosts, estimated from causal pairs of spans.

Each host h has an offset ``o_h``: its clock reads ``true + o_h``; correcting subtracts ``o_h``.
Causal pairs bound the difference ``d = o_B - o_A`` of two hosts:

(a) a ``kv.notify`` span on the target host T is received after the same transfer's ``kv.rdma``
    started on the initiator host I (``notify.end - o_T >= rdma.start - o_I``), and after the
    sender's ``kv.notify.sent_ns`` when present (sender = the rdma span's host, else the host whose
    ``kv.engine_id`` is the notify span's ``kv.remote_engine_id``): ``o_T - o_I <= notify.end - sent``;
(b) a child span on host B of a parent on host A starts after the parent starts and ends before
    it ends: ``c.end - p.end <= o_B - o_A <= c.start - p.start`` (only the start for the spans in
    :data:`OUTLIVES_PARENT`).

The least correction is chosen: the reference host (the router's, else the one with most spans)
stays at 0, and each other host, in order of span count, takes the offset nearest 0 that keeps
every constraint satisfiable (0 when the constraints hold uncorrected).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvtune import spans

_logger = logging.getLogger(__name__)

Pair = tuple[str, str]

OUTLIVES_PARENT = frozenset({spans.SpanName.RETENTION.value})
"""Span names that may end after their parent (retained blocks live on after the request):
only their start bounds the clock offset."""


@dataclass(frozen=True)
class ClockOffsets:
    """Estimated offsets (ns to subtract from each host's timestamps) and the bounds behind them.

    ``bounds_ns[(a, b)] = (lo, hi)``: the causal pairs say ``lo <= o_b - o_a <= hi`` (None: no
    bound on that side), for host pairs with ``a < b``. ``consistent`` is False when the bounds
    contradict each other (then offsets are a best effort and a warning is logged).
    """

    offsets_ns: dict[str, int]
    bounds_ns: dict[Pair, tuple[int | None, int | None]]
    n_constraints: int
    reference_host: str | None
    consistent: bool = True
    n_constraints_by_kind: dict[str, int] = field(default_factory=dict)


def _host_of_router(df: pd.DataFrame) -> str | None:
    router = df.loc[(df["service"] == spans.service_name(spans.Role.ROUTER))
                    | (df["name"] == spans.SpanName.REQUEST.value), "host"]
    router = router[router != ""]
    if len(router):
        return str(router.value_counts().index[0])
    return None


_HEX_LUT = np.zeros(256, dtype=np.uint64)
_HEX_LUT[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10, dtype=np.uint64)
_HEX_LUT[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16, dtype=np.uint64)
_SPAN_ID_DIGITS = 16
_SHIFTS = (4 * np.arange(_SPAN_ID_DIGITS - 1, -1, -1)).astype(np.uint64)


def _id_keys(ids: pd.Series) -> np.ndarray:
    """16-hex-digit span ids as uint64 join keys (0 for NA), parsed vectorized, so joins hash
    integers, not strings."""
    raw = np.array(ids.fillna("").to_numpy(dtype=object), dtype=f"S{_SPAN_ID_DIGITS}")
    digits = raw.view(np.uint8).reshape(-1, _SPAN_ID_DIGITS)
    return np.bitwise_or.reduce(_HEX_LUT[digits] << _SHIFTS, axis=1)


def _bounds_frame(a: np.ndarray, b: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame({"a": a.astype(np.int64), "b": b.astype(np.int64),
                         "lo": lo.astype(np.float64), "hi": hi.astype(np.float64)})


_EMPTY = _bounds_frame(*(np.zeros(0),) * 4)


def _parent_child_bounds(df: pd.DataFrame, host: np.ndarray) -> pd.DataFrame:
    """Rows (a, b, lo, hi) bounding o_b - o_a from parent (host code a) / child (host code b)
    pairs; ``host`` holds each row's host code (-1: unknown host)."""
    child_rows = np.flatnonzero(df["parent_span_id"].notna().to_numpy() & (host >= 0))
    if not len(child_rows):
        return _EMPTY
    keys = pd.DataFrame({"k": _id_keys(df["span_id"]), "p": np.arange(len(df))})
    kids = pd.DataFrame({"k": _id_keys(df["parent_span_id"].iloc[child_rows]), "c": child_rows})
    m = kids.merge(keys, on="k")
    c, p = m["c"].to_numpy(), m["p"].to_numpy()
    keep = (host[c] != host[p]) & (host[p] >= 0)
    c, p = c[keep], p[keep]
    trace = df["trace_id"].to_numpy(dtype=object)
    keep = trace[c] == trace[p]
    c, p = c[keep], p[keep]
    start = df["start_ns"].to_numpy()
    end = df["end_ns"].to_numpy()
    lo = (end[c] - end[p]).astype(np.float64)
    outlives = np.isin(df["name"].to_numpy(dtype=object)[c], list(OUTLIVES_PARENT))
    lo[outlives] = -math.inf  # only "starts after the parent starts" holds for these
    return _bounds_frame(host[p], host[c], lo, start[c] - start[p])


def _notify_bounds(df: pd.DataFrame, host: np.ndarray) -> pd.DataFrame:
    """Rows (a=initiator, b=target, lo=-inf, hi) from notify spans received after the send."""
    tid = spans.TRANSFER_ID
    names = df["name"].to_numpy(dtype=object)
    notify_rows = np.flatnonzero((names == spans.SpanName.NOTIFY.value) & (host >= 0))
    if not len(notify_rows) or tid not in df.columns:
        return _EMPTY
    rdma_rows = np.flatnonzero((names == spans.SpanName.RDMA.value) & (host >= 0))
    rdma_rows = rdma_rows[df[tid].iloc[rdma_rows].notna().to_numpy()]
    rdma = pd.DataFrame({"t": df[tid].iloc[rdma_rows].to_numpy(dtype=object), "r": rdma_rows})
    notify = pd.DataFrame({"t": df[tid].iloc[notify_rows].to_numpy(dtype=object), "n": notify_rows})
    start = df["start_ns"].to_numpy()
    end = df["end_ns"].to_numpy()
    parts = []
    m = notify[notify["t"].notna()].merge(rdma, on="t")
    n, r = m["n"].to_numpy(), m["r"].to_numpy()
    keep = host[n] != host[r]
    n, r = n[keep], r[keep]
    parts.append(_bounds_frame(host[r], host[n], np.full(len(n), -math.inf), end[n] - start[r]))
    # kv.notify.sent_ns: the sender's clock; sender = the rdma span's host, else the host whose
    # kv.engine_id is the notify's kv.remote_engine_id
    sent_ns = df[spans.NOTIFY_SENT_NS].iloc[notify_rows]
    has_sent = sent_ns.notna().to_numpy()
    if has_sent.any():
        rows = notify_rows[has_sent]
        sender = np.full(len(rows), -1, dtype=np.int64)
        by_tid = rdma.drop_duplicates("t").set_index("t")["r"]
        r = pd.Series(df[tid].iloc[rows].to_numpy(dtype=object)).map(by_tid).to_numpy(dtype=np.float64)
        found = ~np.isnan(r)
        sender[found] = host[r[found].astype(np.int64)]
        if (~found).any() and spans.ENGINE_ID in df.columns:
            eng = df[spans.ENGINE_ID].to_numpy(dtype=object)
            with_engine = np.flatnonzero(df[spans.ENGINE_ID].notna().to_numpy() & (host >= 0))
            by_engine = pd.Series(host[with_engine], index=eng[with_engine])
            by_engine = by_engine[~by_engine.index.duplicated()]
            remote = pd.Series(df[spans.REMOTE_ENGINE_ID].iloc[rows[~found]].to_numpy(dtype=object))
            sender[~found] = remote.map(by_engine).fillna(-1).to_numpy(dtype=np.int64)
        keep = (sender >= 0) & (sender != host[rows])
        sent_vals = sent_ns.to_numpy(dtype=np.int64, na_value=0)[has_sent]  # int64: ns exact
        parts.append(_bounds_frame(sender[keep], host[rows[keep]], np.full(int(keep.sum()), -math.inf),
                                   end[rows[keep]] - sent_vals[keep]))
    return pd.concat(parts, ignore_index=True)


def _pair_bounds(rows: pd.DataFrame, names: np.ndarray) -> dict[Pair, tuple[float, float]]:
    """Tightest (lo, hi) on o_b - o_a per pair of host names (a < b)."""
    if rows.empty:
        return {}
    rank = np.argsort(np.argsort(names.astype(str)))  # host code -> rank of its name
    a, b = rows["a"].to_numpy(), rows["b"].to_numpy()
    flip = rank[a] > rank[b]
    lo = np.where(flip, -rows["hi"].to_numpy(), rows["lo"].to_numpy())
    hi = np.where(flip, -rows["lo"].to_numpy(), rows["hi"].to_numpy())
    norm = pd.DataFrame({"a": np.where(flip, b, a), "b": np.where(flip, a, b), "lo": lo, "hi": hi})
    agg = norm.groupby(["a", "b"], sort=False).agg(lo=("lo", "max"), hi=("hi", "min"))
    return {(str(names[k[0]]), str(names[k[1]])): (float(r.lo), float(r.hi))
            for k, r in agg.iterrows()}


def _feasible_range(host: str, fixed: dict[str, float], bounds: dict[Pair, tuple[float, float]],
                    hosts: list[str]) -> tuple[float, float] | None:
    """[L, U] for o_host given fixed offsets, by shortest paths (Bellman-Ford) over the
    difference constraints; None when the constraints are contradictory."""
    # edges u -> v with weight w mean o_v - o_u <= w
    edges: list[tuple[str, str, float]] = []
    for (a, b), (lo, hi) in bounds.items():
        if math.isfinite(hi):
            edges.append((a, b, hi))
        if math.isfinite(lo):
            edges.append((b, a, -lo))
    src = "\0origin"  # o_src = 0; fixed hosts are pinned by two edges
    for h, val in fixed.items():
        edges.append((src, h, val))
        edges.append((h, src, -val))
    nodes = [src, *hosts]

    def shortest(from_node: str, reverse: bool) -> dict[str, float] | None:
        dist = {n: math.inf for n in nodes}
        dist[from_node] = 0.0
        es = [(v, u, w) for u, v, w in edges] if reverse else edges
        for _ in range(len(nodes)):
            changed = False
            for u, v, w in es:
                if dist[u] + w < dist[v] - 1e-9:
                    dist[v] = dist[u] + w
                    changed = True
            if not changed:
                return dist
        return None  # still relaxing: a negative cycle, i.e. contradictory constraints

    up = shortest(src, reverse=False)  # o_h - o_src <= up[h]
    down = shortest(src, reverse=True)  # o_src - o_h <= down[h]
    if up is None or down is None:
        return None
    return -down[host], up[host]


def estimate_offsets(df: pd.DataFrame) -> ClockOffsets:
    """Per-host clock offsets (ns) from the causal pairs in a spans DataFrame (see module doc)."""
    hosts_counts = df.loc[df["host"] != "", "host"].value_counts()
    hosts = [str(h) for h in hosts_counts.index]
    if len(hosts) <= 1:
        return ClockOffsets({h: 0 for h in hosts}, {}, 0, hosts[0] if hosts else None)
    codes, names = pd.factorize(df["host"].to_numpy(dtype=object))
    names = np.asarray(names, dtype=object)
    host = np.where(names[codes] == "", -1, codes) if len(names) else codes
    pc = _parent_child_bounds(df, host)
    nt = _notify_bounds(df, host)
    bounds = _pair_bounds(pd.concat([pc, nt], ignore_index=True), names)
    n = int(len(pc) + len(nt))
    reference = _host_of_router(df) or hosts[0]
    order = [reference] + [h for h in hosts if h != reference]
    fixed: dict[str, float] = {reference: 0.0}
    consistent = True
    for h in order[1:]:
        rng = _feasible_range(h, fixed, bounds, hosts)
        if rng is None:
            consistent = False
            break
        lo, hi = rng
        fixed[h] = min(max(0.0, lo), hi)
    if not consistent:
        # contradictory bounds (jitter, or a span outliving its parent): per pair with the
        # reference only, the midpoint of a crossed interval, else the least correction
        _logger.warning("clock offsets: causal constraints contradict each other; using per-pair "
                        "estimates against the reference host %s", reference)
        fixed = {reference: 0.0}
        for h in order[1:]:
            a, b = sorted((reference, h))
            lo, hi = bounds.get((a, b), (-math.inf, math.inf))
            if h == a:  # bounds are on o_b - o_a = o_ref - o_h
                lo, hi = -hi, -lo
            fixed[h] = (lo + hi) / 2 if lo > hi else min(max(0.0, lo), hi)
    offsets = {h: int(round(fixed.get(h, 0.0))) for h in hosts}
    report = {k: (None if not math.isfinite(lo) else int(lo), None if not math.isfinite(hi) else int(hi))
              for k, (lo, hi) in bounds.items()}
    return ClockOffsets(offsets, report, n, reference, consistent,
                        {"parent_child": int(len(pc)), "notify": int(len(nt))})


def apply_offsets(df: pd.DataFrame, offsets_ns: dict[str, int]) -> pd.DataFrame:
    """A copy of ``df`` with each host's offset subtracted from ``start_ns`` and ``end_ns``."""
    if not any(offsets_ns.values()):
        return df
    shift = df["host"].map(offsets_ns).fillna(0).astype(np.int64).to_numpy()
    out = df.copy(deep=False)
    out["start_ns"] = df["start_ns"].to_numpy() - shift
    out["end_ns"] = df["end_ns"].to_numpy() - shift
    return out
