"""Aggregates over a whole Tempo range from Tempo's TraceQL metrics, without fetching traces.

``GET /api/metrics/query?q=<TraceQL metrics query>&start=<ns>&end=<ns>`` (an *instant* query)
answers ``{"series": [{"labels": [{"key": .., "value": {"stringValue": ..}}], "value": ..}],
"metrics": {"completedJobs": .., "totalJobs": ..}}`` (a series without ``value`` is 0: protobuf
JSON leaves zeros out). The queries are the dashboards' own (``kvtune.dashboards.generator``, with
the variables at their "All" values), so what this reads is what the dashboards' panels show,
summed over the range: how many reuse decisions each outcome had, how retained blocks ended, and
how many bytes ``kv.rdma`` moved per mode and direction. Counted by Tempo over every span in the
range, these stay whole when the traces read are a sample or the search was cut short.

Instant, not ``query_range``: Tempo aligns a range query to its step (start rounded down to a step
and one more step added before it, end rounded up), so the sum of its samples counts spans from
up to two steps before the range and one after, and pieces of a long range overlap. Measured on
Tempo 2.10.8, a range ending a minute before the newest spans counted 32 reuse decisions where 14
started in it; the instant query counted 14. An instant query counts the spans that start in
``[start, end]`` (nanoseconds, both ends included): a piece ``lo .. hi`` is asked as
``lo * 1e9 .. hi * 1e9 - 1``, so pieces neither overlap nor leave a gap.

Each request has the Tempo source's deadline and a size cap; ranges longer than
:data:`METRICS_WINDOW_S` (Tempo 2.x's default ``query_frontend.metrics.max_duration``; 3.x's is
24 h) are asked in pieces and summed. A piece Tempo answers in part (fewer jobs completed than
started, ``"status": "PARTIAL"`` such as its series limit, or HTTP 206) or not at all (metrics not
enabled: the ``local-blocks`` processor on 2.x) is said in a warning.

What Tempo cannot say: its metrics read only blocks whose time range overlaps the query, and
Tempo dates a trace that arrived more than ``ingestion_time_range_slack`` (2 min) after it started
by its arrival, so spans of a long trace (or one replayed late) can be missing from a piece that
ends before the trace arrived (measured: 3 of 32 reuse decisions, in the three traces longer than
70 s of a replayed run, on both 2.10.8 and 3.0.3, for ranges ending before the replay). And on 3.x
the live-store counts spans a few seconds after search finds them.
"""
from __future__ import annotations

import json
import math
import urllib.parse
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvtune.errors import TraceSourceError
from kvtune.traces.tempo import HTTP_PARTIAL, TempoSource, _as_int, _iso, first_notes

if TYPE_CHECKING:
    from kvtune.traces.tempo_rdma import RdmaQuantiles

METRICS_WINDOW_S = 3 * 3600
"""Longest range asked in one metrics request: Tempo's default
``query_frontend.metrics.max_duration`` (3 h)."""
MAX_METRICS_BODY_BYTES = 16 * 2**20
"""Largest metrics answer read (16 MiB)."""
INSTANT_PATH = "/api/metrics/query"
NS = 10**9


@dataclass(frozen=True)
class SeriesTotal:
    """One series of a metrics answer summed over the range: its labels and the sum."""

    labels: tuple[tuple[str, str], ...]
    total: float


@dataclass(frozen=True)
class MetricsAnswer:
    """One metrics query over a range: every series' total, the requests, and what is missing."""

    query: str
    series: tuple[SeriesTotal, ...]
    requests: int
    missing: tuple[str, ...] = ()
    """Why the totals may be short (pieces answered in part or not at all)."""

    def by(self, label: str) -> dict[str, float]:
        """Totals keyed by one label's value (``nil`` when a series lacks it)."""
        out: dict[str, float] = {}
        for s in self.series:
            key = dict(s.labels).get(label, "nil")
            out[key] = out.get(key, 0.0) + s.total
        return out


def query_total(source: TempoSource, query: str, start_s: int, end_s: int) -> MetricsAnswer:
    """The totals of a TraceQL metrics ``query`` over the spans that start in ``start_s ..
    end_s`` (end excluded), one instant query per :data:`METRICS_WINDOW_S` (see the module doc).

    A piece the server refuses, fails, answers past the deadline or with something that is not a
    metrics answer is recorded in ``missing`` (naming the URL), and the next piece is asked."""
    totals: dict[tuple[tuple[str, str], ...], float] = {}
    missing: list[str] = []
    requests = 0
    for lo in range(start_s, end_s, METRICS_WINDOW_S):
        hi = min(lo + METRICS_WINDOW_S, end_s)
        params = {"q": query, "start": lo * NS, "end": hi * NS - 1}
        url = f"{source.base_url}{INSTANT_PATH}?{urllib.parse.urlencode(params)}"
        requests += 1
        try:
            status, body = source._get(INSTANT_PATH, params, max_bytes=MAX_METRICS_BODY_BYTES)
            if status not in (200, HTTP_PARTIAL):
                missing.append(f"{_iso(lo)} .. {_iso(hi)}: HTTP {status}: "
                               f"{body[:200].decode('utf-8', 'replace').strip()}")
                continue
            series, note = _answer(body, url)
        except TraceSourceError as exc:  # unreachable, past the deadline, not a metrics answer
            missing.append(f"{_iso(lo)} .. {_iso(hi)}: {exc}"[:500])
            continue
        if status == HTTP_PARTIAL:
            note = "; ".join(x for x in (note, "HTTP 206 (partial content)") if x)
        if note:
            missing.append(f"{_iso(lo)} .. {_iso(hi)}: {note}"[:500])
        for labels, total in series:
            totals[labels] = totals.get(labels, 0.0) + total
    return MetricsAnswer(query, tuple(SeriesTotal(k, v) for k, v in sorted(totals.items())),
                         requests, tuple(missing))


def _answer(body: bytes, url: str) -> tuple[list[tuple[tuple[tuple[str, str], ...], float]], str]:
    """(labels, value) per series of an instant answer, and a note when Tempo says the answer is
    partial (fewer jobs completed than started, or ``"status": "PARTIAL"`` with its message)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise TraceSourceError(f"{url}: not a JSON metrics answer: {exc}"[:500]) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("series", []), list):
        raise TraceSourceError(f"{url}: expected {{\"series\": [...]}}, got {str(doc)[:200]}")
    out = []
    for i, s in enumerate(doc.get("series") or []):
        if not isinstance(s, dict):
            raise TraceSourceError(f"{url}: series[{i}]: expected an object, got {s!r}"[:500])
        labels = []
        for kv in s.get("labels") or []:
            if not isinstance(kv, dict) or not isinstance(kv.get("key"), str):
                raise TraceSourceError(f"{url}: series[{i}].labels: expected {{\"key\", "
                                       f"\"value\"}}, got {kv!r}"[:500])
            val = kv.get("value")
            text = str(next(iter(val.values()))) if isinstance(val, dict) and val else "nil"
            labels.append((kv["key"], text))
        if "samples" in s:
            raise TraceSourceError(f"{url}: series[{i}]: a range answer (\"samples\") where an "
                                   f"instant answer (\"value\") was expected")
        try:
            x = float(s.get("value", 0))
        except (TypeError, ValueError):
            raise TraceSourceError(f"{url}: series[{i}].value: expected a number, got "
                                   f"{s.get('value')!r}"[:500]) from None
        out.append((tuple(sorted(labels)), x if math.isfinite(x) else 0.0))
    notes = []
    metrics = doc.get("metrics")
    if isinstance(metrics, dict):
        done, total_jobs = _as_int(metrics.get("completedJobs")), _as_int(metrics.get("totalJobs"))
        if done is not None and total_jobs is not None and done < total_jobs:
            notes.append(f"Tempo completed {done} of {total_jobs} metrics jobs")
    if doc.get("status") in ("PARTIAL", 1):
        notes.append(f"Tempo answered PARTIAL: {str(doc.get('message') or '(no message)')[:300]}")
    return out, "; ".join(notes)


@dataclass(frozen=True)
class FleetMetrics:
    """Tempo's own aggregates over a read's whole range (see the module doc)."""

    start_s: int
    end_s: int
    reuse_outcomes: dict[str, int]
    """``kv.reuse_decision`` spans per ``kv.reuse.outcome``."""
    retention_outcomes: dict[str, int]
    """``kv.retention`` spans per ``kv.retention.outcome``."""
    rdma_bytes: dict[str, int]
    """Bytes ``kv.rdma`` moved per ``mode/direction``."""
    requests: int
    missing: tuple[str, ...] = ()
    """``query: why`` for each piece answered in part or not at all."""
    rdma: RdmaQuantiles | None = None
    """``kv.rdma`` time quantiles per size and the fabric fit from them, or None."""

    @property
    def complete(self) -> bool:
        return not self.missing

    def summary(self) -> str:
        return (f"Tempo metrics over {_iso(self.start_s)} .. {_iso(self.end_s)} (every span in the "
                f"range, not only the traces read): reuse decisions {self.reuse_outcomes or '{}'}, "
                f"retention outcomes {self.retention_outcomes or '{}'}, kv.rdma bytes by "
                f"mode/direction {self.rdma_bytes or '{}'}"
                + ("" if self.rdma is None else "\n" + self.rdma.summary()))

    def findings(self) -> list[dict[str, Any]]:
        evidence = self.as_dict()
        out = [{"code": "tempo_fleet_metrics", "severity": "info", "message": self.summary(),
                "evidence": evidence}]
        if self.missing:
            out.append({"code": "tempo_fleet_metrics_partial", "severity": "warning",
                        "message": f"Tempo's metrics over the range are incomplete, the fleet "
                                   f"totals above are short: {first_notes(self.missing, 5)}",
                        "evidence": evidence})
        if self.rdma is not None and self.rdma.refused:
            out.append({"code": "tempo_rdma_quantiles_not_asked", "severity": "info",
                        "message": f"kv.rdma quantiles per size: {self.rdma.refused}",
                        "evidence": {"refused": self.rdma.refused}})
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"start_s": self.start_s, "end_s": self.end_s,
                "reuse_outcomes": dict(self.reuse_outcomes),
                "retention_outcomes": dict(self.retention_outcomes),
                "rdma_bytes": dict(self.rdma_bytes), "requests": self.requests,
                "missing": list(self.missing),
                "rdma_quantiles": None if self.rdma is None else self.rdma.as_dict()}


def short_of_read(fleet: FleetMetrics, read_outcomes: dict[str, int],
                  read_rdma: dict[tuple[str, str, int], int] | None = None) -> FleetMetrics:
    """``fleet`` with a note in ``missing`` when the traces a read fetched hold more reuse
    decisions of an outcome (``read_outcomes``, of the spans that start in the range), or more
    ``kv.rdma`` spans of a ``(mode, direction, bytes)`` (``read_rdma``), than Tempo's metrics
    counted: Tempo's metrics left spans out (a long or late trace; the module doc) and no answer
    of Tempo's said so."""
    notes = []
    short = {k: (n, fleet.reuse_outcomes.get(k, 0)) for k, n in sorted(read_outcomes.items())
             if n > fleet.reuse_outcomes.get(k, 0)}
    if short:
        notes.append("reuse: the traces read hold more reuse decisions than Tempo's metrics "
                     "counted (" + ", ".join(f"{k}: {n} read, {m} counted"
                                              for k, (n, m) in short.items())
                     + "): Tempo's metrics left out spans of traces it dated by their arrival")
    if read_rdma and fleet.rdma is not None and not fleet.rdma.refused:
        counted = {(r.mode, r.direction, r.bytes): r.count for r in fleet.rdma.rows}
        rdma_short = {k: (n, counted.get(k, 0)) for k, n in sorted(read_rdma.items())
                      if n > counted.get(k, 0)}
        if rdma_short:
            notes.append("rdma: the traces read hold more kv.rdma spans than Tempo's metrics "
                         "counted, so those sizes' quantiles leave them out (" + ", ".join(
                             f"{m}/{d} {b} B: {n} read, {c} counted"
                             for (m, d, b), (n, c) in rdma_short.items()) + ")")
    if not notes:
        return fleet
    return replace(fleet, missing=(*fleet.missing, *notes))


def fleet_queries() -> dict[str, str]:
    """The dashboards' queries this reads, by what they count, as Tempo receives them."""
    from kvtune.dashboards import generator as gen
    from kvtune.dashboards.templating import interpolate
    from kvtune.dashboards.traceql import parse

    def text(q: str) -> str:
        return parse(interpolate(q, gen.DEFAULT_VARIABLE_VALUES, all_values=gen.ALL_VALUES)).text

    return {"reuse": text(gen.reuse_decisions_query()),
            "retention": text(gen.retention_outcomes_query()),
            "rdma_bytes": text(gen.transfer_bytes_query())}


def fleet_metrics(source: TempoSource, start_s: int, end_s: int) -> FleetMetrics:
    """Reuse outcomes, retention outcomes and ``kv.rdma`` bytes of the spans that start in
    ``start_s .. end_s`` from Tempo's metrics API (one request per :data:`METRICS_WINDOW_S` per
    query), and ``kv.rdma`` time quantiles per size with the fabric fit from them
    (``kvtune.traces.tempo_rdma``)."""
    from kvtune import spans as sc
    from kvtune.traces.tempo_rdma import rdma_quantiles

    answers = {k: query_total(source, q, start_s, end_s) for k, q in fleet_queries().items()}
    rdma: dict[str, int] = {}
    for s in answers["rdma_bytes"].series:
        labels = dict(s.labels)
        key = f"{labels.get(f'span.{sc.MODE}', 'nil')}/{labels.get(f'span.{sc.DIRECTION}', 'nil')}"
        rdma[key] = rdma.get(key, 0) + round(s.total)
    rdma_q = rdma_quantiles(source, start_s, end_s)
    missing = tuple(f"{k}: {m}" for k, a in answers.items() for m in a.missing) + rdma_q.missing
    return FleetMetrics(
        start_s, end_s,
        reuse_outcomes={k: round(v) for k, v in sorted(answers["reuse"].by(
            f"span.{sc.REUSE_OUTCOME}").items())},
        retention_outcomes={k: round(v) for k, v in sorted(answers["retention"].by(
            f"span.{sc.RETENTION_OUTCOME}").items())},
        rdma_bytes=dict(sorted(rdma.items())),
        requests=sum(a.requests for a in answers.values()) + rdma_q.requests, missing=missing,
        rdma=rdma_q)


def fleet_summary(source: str | TempoSource, *, now_s: float | None = None) -> FleetMetrics:
    """:func:`fleet_metrics` over a Tempo source's range (``tempo+http://...?since=1d`` or
    ``start=&end=``), without fetching a trace."""
    src = source if isinstance(source, TempoSource) else TempoSource.from_url(source)
    start, end, _ = src.time_range(now_s)
    return fleet_metrics(src, start, end)
