"""``kv.rdma`` time per transfer size from Tempo's TraceQL metrics, and the fabric's floor and
bandwidth fitted to it, without fetching traces.

Two instant queries (``kvtune.traces.tempo_metrics``) over the range::

    { name = "kv.rdma" } | quantile_over_time(duration, 0.5, 0.9) by (span.kv.mode, span.kv.direction, span.kv.bytes)
    { name = "kv.rdma" } | count_over_time() by (span.kv.mode, span.kv.direction, span.kv.bytes)

give, per mode, direction and transfer size, the p50 and p90 of the ``kv.rdma`` span's duration
and how many transfers it holds (a model's transfers are whole blocks, so there are as many sizes
as distinct block counts: few series). Per mode/direction, the floor and bandwidth are then fitted
to the p50s weighted by the counts (:func:`kvtune.analysis.fit.fit_floor_medians`), labelled
:data:`FIT_SOURCE`.

How exact: Tempo keeps durations in power-of-two buckets (of nanoseconds) and interpolates a
quantile exponentially between the top of the non-empty bucket below and the top of the bucket it
falls in (``Log2Quantile``, the same in Tempo 2.10.8 and 3.0.3), so a p50 can be off by a factor
of 2 or more from the transfers' true median (more where the non-empty bucket below is far: 3,
100, 100, 100 ns give a p50 of 12.7 ns; exact only where it lands on a bucket's edge). The
fit from these medians is a cross-check of the trace-based fit on a fleet's whole range, not a
replacement for it.

Quantiles of two pieces cannot be merged (the p50 of two halves is not the mean of their p50s),
so a range longer than :data:`~kvtune.traces.tempo_metrics.METRICS_WINDOW_S` is refused here,
saying so (``refused``), where the totals are still summed by pieces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtune import spans as sc
from kvtune.errors import AnalysisError
from kvtune.traces.tempo import _iso
from kvtune.traces.tempo_metrics import METRICS_WINDOW_S, query_total

if TYPE_CHECKING:
    import pandas as pd

    from kvtune.analysis.fit import FloorFit
    from kvtune.traces.tempo import TempoSource

QUANTILES = (0.5, 0.9)
"""The quantiles asked: the median the fit uses, and p90 for the spread."""
SIZE_ATTR = sc.BYTES
"""The size the series are grouped by (bytes: what the fit needs; one per block count)."""
FIT_SOURCE = "Tempo metrics: p50 per size"
"""The label of the fit from Tempo's medians (:attr:`FloorFit.source`)."""
TRACE_FIT_SOURCE = "traces: kv.rdma per transfer"
"""The label of the fit from the traces read, compared with it."""
_GROUP = (f"by (span.{sc.MODE}, span.{sc.DIRECTION}, span.{SIZE_ATTR})")


def rdma_queries() -> dict[str, str]:
    """The two queries, as Tempo receives them: ``quantiles`` and ``counts``."""
    spans = f'{{ name = "{sc.SpanName.RDMA.value}" }}'
    qs = ", ".join(str(q) for q in QUANTILES)
    return {"quantiles": f"{spans} | quantile_over_time(duration, {qs}) {_GROUP}",
            "counts": f"{spans} | count_over_time() {_GROUP}"}


@dataclass(frozen=True)
class SizeQuantiles:
    """One mode/direction/size: how many ``kv.rdma`` spans, and their duration's quantiles."""

    mode: str
    direction: str
    bytes: int
    count: int
    p50_ms: float
    p90_ms: float


@dataclass(frozen=True)
class RdmaQuantiles:
    """``kv.rdma`` quantiles per size over a range, and the fit from the medians per
    ``mode/direction`` (or why there is none)."""

    start_s: int
    end_s: int
    rows: tuple[SizeQuantiles, ...]
    fits: dict[str, FloorFit] = field(default_factory=dict)
    unfitted: dict[str, str] = field(default_factory=dict)
    """``mode/direction``: why no fit (too few sizes or transfers)."""
    requests: int = 0
    missing: tuple[str, ...] = ()
    refused: str = ""
    """Why nothing was asked (a range longer than Tempo's metrics window)."""

    def summary(self) -> str:
        if self.refused:
            return f"kv.rdma quantiles per size: not asked: {self.refused}"
        lines = [f"kv.rdma duration per size (Tempo metrics, p50/p90 from Tempo's power-of-2 "
                 f"buckets) over {_iso(self.start_s)} .. {_iso(self.end_s)}:"]
        lines += [f"  {r.mode}/{r.direction} {r.bytes} B: n={r.count} p50={r.p50_ms:.3f} ms "
                  f"p90={r.p90_ms:.3f} ms" for r in self.rows]
        for key, fit in self.fits.items():
            lines.append(f"  fit {key} ({fit.source}): {format_fit(fit)}")
        lines += [f"  fit {key}: none: {why}" for key, why in self.unfitted.items()]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"start_s": self.start_s, "end_s": self.end_s,
                "queries": rdma_queries(),
                "rows": [vars(r).copy() for r in self.rows],
                "fits": {k: f.as_dict() for k, f in self.fits.items()},
                "unfitted": dict(self.unfitted), "requests": self.requests,
                "missing": list(self.missing), "refused": self.refused}


def format_fit(fit: FloorFit) -> str:
    """``floor 1.234 ms, bandwidth 56.7 Gbit/s (n=.., sizes=..)``."""
    return (f"floor {fit.floor_ms:.3f} ms, bandwidth {fit.bandwidth_gbps:.3g} Gbit/s "
            f"({fit.n_transfers} transfers at {fit.n_sizes} sizes)")


def rdma_quantiles(source: TempoSource, start_s: int, end_s: int) -> RdmaQuantiles:
    """The ``kv.rdma`` quantiles and counts per size of the spans that start in ``start_s ..
    end_s`` (one instant query each), and the fit per mode/direction; refused (nothing asked)
    when the range is longer than one metrics request may be."""
    if end_s - start_s > METRICS_WINDOW_S:
        return RdmaQuantiles(start_s, end_s, (), refused=(
            f"the range is {(end_s - start_s) / 3600:.3g} h, longer than one Tempo metrics "
            f"request ({METRICS_WINDOW_S // 3600} h), and quantiles of pieces cannot be merged; "
            f"ask a range of at most {METRICS_WINDOW_S // 3600} h (e.g. since=3h) for them"))
    queries = rdma_queries()
    q_ans = query_total(source, queries["quantiles"], start_s, end_s)
    c_ans = query_total(source, queries["counts"], start_s, end_s)
    counts: dict[tuple[str, str, str], float] = {}
    for s in c_ans.series:
        counts[_key(dict(s.labels))] = s.total
    quant: dict[tuple[str, str, str], dict[float, float]] = {}
    for s in q_ans.series:
        labels = dict(s.labels)
        try:
            p = float(labels.get("p", "nan"))
        except ValueError:
            continue
        quant.setdefault(_key(labels), {})[p] = s.total * 1e3  # seconds -> ms
    rows = []
    for key in sorted(set(counts) | set(quant), key=lambda k: (k[0], k[1], _as_bytes(k[2]))):
        size = _as_bytes(key[2])
        if size is None:  # a span without kv.bytes: no size to fit
            continue
        qs = quant.get(key, {})
        rows.append(SizeQuantiles(key[0], key[1], size, round(counts.get(key, 0)),
                                  qs.get(QUANTILES[0], math.nan), qs.get(QUANTILES[1], math.nan)))
    fits, unfitted = fit_by_mode(rows)
    missing = tuple(f"rdma {k}: {m}" for k, a in (("quantiles", q_ans), ("counts", c_ans))
                    for m in a.missing)
    return RdmaQuantiles(start_s, end_s, tuple(rows), fits, unfitted,
                         q_ans.requests + c_ans.requests, missing)


def _key(labels: dict[str, str]) -> tuple[str, str, str]:
    return (labels.get(f"span.{sc.MODE}", "nil"), labels.get(f"span.{sc.DIRECTION}", "nil"),
            labels.get(f"span.{SIZE_ATTR}", "nil"))


def _as_bytes(text: str) -> int | None:
    try:
        v = float(text)
    except ValueError:
        return None
    return int(v) if math.isfinite(v) and v >= 0 else None


def fit_by_mode(rows: tuple[SizeQuantiles, ...] | list[SizeQuantiles]
                ) -> tuple[dict[str, FloorFit], dict[str, str]]:
    """Per ``mode/direction``: the fit to the p50s weighted by counts, or why there is none."""
    from kvtune.analysis.fit import fit_floor_medians

    fits: dict[str, FloorFit] = {}
    unfitted: dict[str, str] = {}
    for key in sorted({f"{r.mode}/{r.direction}" for r in rows}):
        mine = [r for r in rows if f"{r.mode}/{r.direction}" == key]
        try:
            fits[key] = fit_floor_medians([r.bytes for r in mine], [r.p50_ms for r in mine],
                                          [r.count for r in mine], source=FIT_SOURCE)
        except AnalysisError as exc:
            unfitted[key] = str(exc)
    return fits, unfitted


def trace_fits(transfers: pd.DataFrame) -> tuple[dict[str, FloorFit], dict[str, str]]:
    """Per ``mode/direction``: the trace-based fit of ``rdma_ms`` (:func:`kvtune.analysis.fit.
    fit_floor` on a transfers table), to set beside the one from Tempo's medians."""
    from kvtune.analysis.fit import fit_floor

    fits: dict[str, FloorFit] = {}
    unfitted: dict[str, str] = {}
    t = transfers[transfers["mode"].notna() & transfers["direction"].notna()]
    for (mode, direction), g in t.groupby(["mode", "direction"], sort=True):
        key = f"{mode}/{direction}"
        try:
            fits[key] = fit_floor(g, column="rdma_ms", n_boot=0, source=TRACE_FIT_SOURCE)
        except AnalysisError as exc:
            unfitted[key] = str(exc)
    return fits, unfitted


def compare_fits(metrics: RdmaQuantiles, transfers: pd.DataFrame) -> str:
    """Each mode/direction's fit from Tempo's medians beside the trace-based one."""
    t_fits, t_unfitted = trace_fits(transfers)
    lines = ["fabric fit per mode/direction, Tempo's medians vs the traces read:"]
    for key in sorted(set(metrics.fits) | set(metrics.unfitted) | set(t_fits) | set(t_unfitted)):
        m = metrics.fits.get(key)
        t = t_fits.get(key)
        lines.append(f"  {key}: {FIT_SOURCE}: "
                     f"{format_fit(m) if m else 'none: ' + metrics.unfitted.get(key, 'no rows')[:160]}")
        lines.append(f"  {' ' * len(key)}  {TRACE_FIT_SOURCE}: "
                     f"{format_fit(t) if t else 'none: ' + t_unfitted.get(key, 'no rows')[:160]}")
    return "\n".join(lines)


def compare_with_traces(source: str, metrics: RdmaQuantiles) -> str:
    """:func:`compare_fits` with the traces of ``source`` (a ``tempo+http://`` URL) over the same
    range as ``metrics``, read with every span (``q={}``)."""
    import urllib.parse

    from kvtune import traces
    from kvtune.analysis.transfers import transfers

    parts = urllib.parse.urlsplit(source)
    query = {k: v for k, v in urllib.parse.parse_qsl(parts.query) if k not in
             ("since", "start", "end", "metrics", "q")}
    query.update(q="{}", start=str(metrics.start_s), end=str(metrics.end_s))
    url = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))
    return compare_fits(metrics, transfers(traces.load(url)))
