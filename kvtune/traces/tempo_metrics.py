"""Aggregates over a whole Tempo range from Tempo's TraceQL metrics, without fetching traces.

``GET /api/metrics/query_range?q=<TraceQL metrics query>&start=&end=&step=`` answers
``{"series": [{"labels": [{"key": .., "value": {"stringValue": ..}}], "samples":
[{"timestampMs": .., "value": ..}]}], "metrics": {"completedJobs": .., "totalJobs": ..}}`` (a sample
without ``value`` is 0: protobuf JSON leaves zeros out). The queries are the dashboards' own
(``kvtune.dashboards.generator``, with the variables at their "All" values), so what this reads is
what the dashboards' panels show, summed over the range: how many reuse decisions each outcome had,
how retained blocks ended, and how many bytes ``kv.rdma`` moved per mode and direction. Counted by
Tempo over every span in the range, these stay whole when the traces read are a sample or the
search was cut short.

Each request has the Tempo source's deadline and a size cap; ranges longer than
:data:`METRICS_WINDOW_S` (Tempo's default ``query_frontend.metrics.max_duration``) are asked in
pieces and summed. A piece Tempo answers in part (fewer jobs completed than started, or HTTP 206)
or not at all (metrics not enabled: the ``local-blocks`` processor) is said in a warning.
"""
from __future__ import annotations

import json
import math
import urllib.parse
from dataclasses import dataclass
from typing import Any

from kvtune.errors import TraceSourceError
from kvtune.traces.tempo import HTTP_PARTIAL, TempoSource, _as_int, _iso, first_notes

METRICS_WINDOW_S = 3 * 3600
"""Longest range asked in one metrics request: Tempo's default
``query_frontend.metrics.max_duration`` (3 h)."""
POINTS_PER_WINDOW = 60
"""Samples asked per piece (``step`` = piece / this, at least one second): the sums do not
depend on it, only the answer's size does."""
MAX_METRICS_BODY_BYTES = 16 * 2**20
"""Largest metrics answer read (16 MiB)."""


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


def query_range(source: TempoSource, query: str, start_s: int, end_s: int) -> MetricsAnswer:
    """The totals of a TraceQL metrics ``query`` over ``start_s .. end_s`` (see the module doc).

    A piece the server refuses, fails, answers past the deadline or with something that is not a
    metrics answer is recorded in ``missing`` (naming the URL), and the next piece is asked."""
    totals: dict[tuple[tuple[str, str], ...], float] = {}
    missing: list[str] = []
    requests = 0
    for lo in range(start_s, end_s, METRICS_WINDOW_S):
        hi = min(lo + METRICS_WINDOW_S, end_s)
        step = max(1, math.ceil((hi - lo) / POINTS_PER_WINDOW))
        params = {"q": query, "start": lo, "end": hi, "step": f"{step}s"}
        url = f"{source.base_url}/api/metrics/query_range?{urllib.parse.urlencode(params)}"
        requests += 1
        try:
            status, body = source._get("/api/metrics/query_range", params,
                                       max_bytes=MAX_METRICS_BODY_BYTES)
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
            missing.append(f"{_iso(lo)} .. {_iso(hi)}: {note}")
        for labels, total in series:
            totals[labels] = totals.get(labels, 0.0) + total
    return MetricsAnswer(query, tuple(SeriesTotal(k, v) for k, v in sorted(totals.items())),
                         requests, tuple(missing))


def _answer(body: bytes, url: str) -> tuple[list[tuple[tuple[tuple[str, str], ...], float]], str]:
    """(labels, sum of samples) per series, and a note when Tempo completed fewer jobs than it
    started."""
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
        total = 0.0
        for sample in s.get("samples") or []:
            v = sample.get("value", 0) if isinstance(sample, dict) else None
            try:
                x = float(v)
            except (TypeError, ValueError):
                raise TraceSourceError(f"{url}: series[{i}].samples: expected numbers, got "
                                       f"{sample!r}"[:500]) from None
            if math.isfinite(x):
                total += x
        out.append((tuple(sorted(labels)), total))
    note = ""
    metrics = doc.get("metrics")
    if isinstance(metrics, dict):
        done, total_jobs = _as_int(metrics.get("completedJobs")), _as_int(metrics.get("totalJobs"))
        if done is not None and total_jobs is not None and done < total_jobs:
            note = f"Tempo completed {done} of {total_jobs} metrics jobs"
    return out, note


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

    @property
    def complete(self) -> bool:
        return not self.missing

    def summary(self) -> str:
        return (f"Tempo metrics over {_iso(self.start_s)} .. {_iso(self.end_s)} (every span in the "
                f"range, not only the traces read): reuse decisions {self.reuse_outcomes or '{}'}, "
                f"retention outcomes {self.retention_outcomes or '{}'}, kv.rdma bytes by "
                f"mode/direction {self.rdma_bytes or '{}'}")

    def findings(self) -> list[dict[str, Any]]:
        evidence = self.as_dict()
        out = [{"code": "tempo_fleet_metrics", "severity": "info", "message": self.summary(),
                "evidence": evidence}]
        if self.missing:
            out.append({"code": "tempo_fleet_metrics_partial", "severity": "warning",
                        "message": f"Tempo's metrics over the range are incomplete, the fleet "
                                   f"totals above are short: {first_notes(self.missing, 5)}",
                        "evidence": evidence})
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"start_s": self.start_s, "end_s": self.end_s,
                "reuse_outcomes": dict(self.reuse_outcomes),
                "retention_outcomes": dict(self.retention_outcomes),
                "rdma_bytes": dict(self.rdma_bytes), "requests": self.requests,
                "missing": list(self.missing)}


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
    """Reuse outcomes, retention outcomes and ``kv.rdma`` bytes over ``start_s .. end_s`` from
    Tempo's metrics API (one request per :data:`METRICS_WINDOW_S` per query)."""
    from kvtune import spans as sc

    answers = {k: query_range(source, q, start_s, end_s) for k, q in fleet_queries().items()}
    rdma: dict[str, int] = {}
    for s in answers["rdma_bytes"].series:
        labels = dict(s.labels)
        key = f"{labels.get(f'span.{sc.MODE}', 'nil')}/{labels.get(f'span.{sc.DIRECTION}', 'nil')}"
        rdma[key] = rdma.get(key, 0) + round(s.total)
    missing = tuple(f"{k}: {m}" for k, a in answers.items() for m in a.missing)
    return FleetMetrics(
        start_s, end_s,
        reuse_outcomes={k: round(v) for k, v in sorted(answers["reuse"].by(
            f"span.{sc.REUSE_OUTCOME}").items())},
        retention_outcomes={k: round(v) for k, v in sorted(answers["retention"].by(
            f"span.{sc.RETENTION_OUTCOME}").items())},
        rdma_bytes=dict(sorted(rdma.items())),
        requests=sum(a.requests for a in answers.values()), missing=missing)


def fleet_summary(source: str | TempoSource, *, now_s: float | None = None) -> FleetMetrics:
    """:func:`fleet_metrics` over a Tempo source's range (``tempo+http://...?since=1d`` or
    ``start=&end=``), without fetching a trace."""
    src = source if isinstance(source, TempoSource) else TempoSource.from_url(source)
    start, end, _ = src.time_range(now_s)
    return fleet_metrics(src, start, end)
