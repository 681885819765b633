"""A stand-in for Grafana Tempo's HTTP API that serves responses recorded from a real Tempo.

``tests/fixtures/traces/tempo_real/`` holds what a real Tempo (version in ``recording.json``)
answered for kvtune spans sent to it over OTLP/HTTP (``tests/test_traces_tempo_real.py`` records
them with ``KVTUNE_TEMPO_RECORD=DIR``): a search with a time range, the same search without one,
each trace (``/api/v2/traces/<id>``), TraceQL metrics ``query_range`` answers (the panels'), instant
``/api/metrics/query`` answers (``metrics_instant.json``: the fleet totals' queries over the
recorded range, recorded later from the same Tempo version, spans and settings) and the server's
``400`` answers to a too-long range and a too-high limit.

The stand-in answers as that Tempo did: a search without ``start``/``end`` gets the recorded
no-range answer verbatim (Tempo then reads only its ingesters: a subset); a search with a range
gets the recorded ranged answer's traces whose start falls in the range (times moved so the
recording ends at the moment the stand-in starts), at most ``limit`` of them, most recent first;
ranges longer than ``max_duration_s`` and limits above ``max_limit`` get the recorded 400 bodies,
rewritten with the request's numbers. It records every request.

The ``kv.rdma`` quantile and count queries per size (``kvtune.traces.tempo_rdma.rdma_queries``)
are not recorded but computed from the recorded spans that start in the request's ``[start,
end]`` (nanoseconds, moved as the traces), as Tempo computes them (:func:`tempo_log2_quantile`).
"""
from __future__ import annotations

import gzip
import json
import math
import re
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

RECORDED = Path(__file__).parent / "fixtures" / "traces" / "tempo_real"


@dataclass
class Recording:
    meta: dict[str, Any]
    search_range: dict[str, Any]
    search_norange: dict[str, Any]
    traces: dict[str, bytes]
    metrics: dict[str, Any]
    errors: dict[str, str]
    metrics_instant: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, root: Path = RECORDED) -> Recording:
        with gzip.open(root / "traces.json.gz", "rt", encoding="utf-8") as f:
            traces = {k: v.encode() for k, v in json.load(f).items()}
        return cls(meta=json.loads((root / "recording.json").read_text()),
                   search_range=json.loads((root / "search_range.json").read_text()),
                   search_norange=json.loads((root / "search_norange.json").read_text()),
                   traces=traces, metrics=json.loads((root / "metrics.json").read_text()),
                   errors=json.loads((root / "errors.json").read_text()),
                   metrics_instant=json.loads((root / "metrics_instant.json").read_text()))

    def trace_ids(self) -> list[str]:
        return [t["traceID"] for t in self.search_range.get("traces", [])]


@dataclass
class StandInState:
    rec: Recording
    shift_ns: int
    max_duration_s: int = 168 * 3600
    max_limit: int = 256 * 1024
    requests: list[tuple[str, dict[str, list[str]]]] = field(default_factory=list)
    cut_body_at: int | None = None
    """Send only this many bytes of each trace body (Content-Length says the whole): IncompleteRead."""
    search_override: bytes | None = None
    fail_search_from_s: int | None = None
    """Answer HTTP 503 to a ranged search starting at or after this unix second (a Tempo that
    fails part way through a long read)."""
    search_metrics: dict[str, Any] | None = None
    """The ``metrics`` of every ranged search answer (default: the recorded ones)."""
    search_status: int = 200
    """Status of every ranged search answer (206: Tempo's partial content)."""
    partial_trace_message: str | None = None
    """Answer every trace as Tempo answers one over its size limit: ``"status": "PARTIAL"`` and
    this message beside the trace."""
    trace_status: int = 200
    """Status of every trace answer (206: Tempo's partial content)."""
    match_before_s: int = 0
    """Also answer traces that started up to this many seconds before a search's start (a trace
    still running when the window opens, as Tempo matches a trace whose spans overlap it)."""
    arrival_delay_s: int = 0
    """Answer a trace only to a window that also reaches this many seconds past its start (as
    Tempo 2.10.8 and 3.0.3 did for traces that reached them minutes after they started: a window
    must overlap the time the trace arrived)."""
    refuse_from_s: int | None = None
    """Answer HTTP 400 "start must be before end" to a ranged search starting at or after this
    unix second, as Tempo 2.10.8 and 3.0.3 did to windows past their clock (their frontend clamps a
    search's end to now)."""
    metrics_status: int = 200
    metrics_jobs: tuple[int, int] | None = None
    """(completed, total) jobs in every metrics answer (default: the recorded ones)."""
    metrics_partial_message: str | None = None
    """Answer every metrics query as Tempo answers one over its series limit: ``"status":
    "PARTIAL"`` and this message."""

    def search(self, q: dict[str, list[str]]) -> tuple[int, bytes]:
        if self.search_override is not None:
            return 200, self.search_override
        if (self.fail_search_from_s is not None and "start" in q
                and int(q["start"][0]) >= self.fail_search_from_s):
            return 503, b"the querier is unavailable (stand-in)"
        limit = int(q.get("limit", ["20"])[0])
        if limit > self.max_limit:
            msg = re.sub(r"limit \d+ exceeds max limit \d+", f"limit {limit} exceeds max limit "
                         f"{self.max_limit}", self.rec.errors["limit_too_high"])
            return 400, msg.encode()
        if "start" not in q or "end" not in q:
            return 200, json.dumps(self.rec.search_norange).encode()
        start, end = int(q["start"][0]), int(q["end"][0])
        if self.refuse_from_s is not None and start >= self.refuse_from_s:
            return 400, (f"http parameter start must be before end. received start={start} "
                         f"end={self.refuse_from_s}").encode()
        if end - start > self.max_duration_s:
            msg = re.sub(r"exceeds \S+ received start=\d+ end=\d+",
                         f"exceeds {_go_duration(self.max_duration_s)}. received start={start} "
                         f"end={end}",
                         self.rec.errors["range_too_long"])
            return 400, msg.encode()
        hits = []
        for t in self.rec.search_range.get("traces", []):
            t_s = (int(t["startTimeUnixNano"]) + self.shift_ns) / 1e9
            if start - self.match_before_s <= t_s < end and end > t_s + self.arrival_delay_s:
                # as the moved recording: its start time moved with it
                hits.append({**t, "startTimeUnixNano": str(int(t["startTimeUnixNano"])
                                                           + self.shift_ns)})
        hits.sort(key=lambda t: -int(t["startTimeUnixNano"]))
        doc = {"traces": hits[:limit], "metrics": self.rec.search_range.get("metrics", {})
               if self.search_metrics is None else self.search_metrics}
        return self.search_status, json.dumps(doc).encode()


def tempo_log2_bucket(ns: int) -> float:
    """Tempo's ``Log2Bucketize``: the power of two at or above ``ns`` (-1 below 2)."""
    return -1.0 if ns < 2 else float(1 << (ns - 1).bit_length())


def tempo_log2_quantile(p: float, durations_ns: list[int]) -> float:
    """Tempo's ``Log2Quantile`` (2.10.8 and 3.0.3, ``pkg/traceql/engine_metrics.go``) over the
    durations' power-of-two buckets, in nanoseconds: the bucket holding the ``ceil(p*n)``-th
    duration, interpolated exponentially from the top of the non-empty bucket below it."""
    buckets: dict[float, int] = {}
    for d in durations_ns:
        b = tempo_log2_bucket(d)
        buckets[b] = buckets.get(b, 0) + 1
    tops = sorted(buckets)
    n = sum(buckets.values())
    want = max(math.ceil(p * n), 1)
    total, i = 0, 0
    for i, top in enumerate(tops):
        if total + buckets[top] > want:
            break
        total += buckets[top]
        if total == want:
            return top
    hi = math.log2(tops[i])
    lo = math.log2(tops[i - 1]) if i > 0 else hi - 1
    return 2 ** (lo + (hi - lo) * (want - total) / buckets[tops[i]])


def rdma_spans(rec: Recording) -> list[dict]:
    """Every recorded ``kv.rdma`` span (OTLP JSON, times as recorded)."""
    out = []
    for body in rec.traces.values():
        for rs in json.loads(body)["trace"].get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                out += [sp for sp in ss.get("spans", []) if sp["name"] == "kv.rdma"]
    return out


def _attr(span: dict, key: str) -> str:
    for kv in span.get("attributes", []):
        if kv["key"] == key:
            return str(next(iter(kv["value"].values())))
    return "nil"


def _computed_rdma_answer(state: StandInState, query: str, q: dict[str, list[str]]
                          ) -> dict[str, Any] | None:
    """Tempo's instant answer to one of the ``kv.rdma`` per-size queries, or None."""
    from kvtune.traces.tempo_rdma import QUANTILES, SIZE_ATTR, rdma_queries

    kind = {v: k for k, v in rdma_queries().items()}.get(query)
    if kind is None:
        return None
    start, end = int(q["start"][0]), int(q["end"][0])
    groups: dict[tuple[str, str, str], list[int]] = {}
    for sp in rdma_spans(state.rec):
        t0 = int(sp["startTimeUnixNano"]) + state.shift_ns
        if start <= t0 <= end:
            key = (_attr(sp, "kv.mode"), _attr(sp, "kv.direction"), _attr(sp, SIZE_ATTR))
            groups.setdefault(key, []).append(int(sp["endTimeUnixNano"])
                                              - int(sp["startTimeUnixNano"]))

    def labels(key: tuple[str, str, str]) -> list[dict]:
        names = ("span.kv.mode", "span.kv.direction", f"span.{SIZE_ATTR}")
        return [{"key": k, "value": {"stringValue": v} if not v.isdigit()
                 else {"intValue": v}} for k, v in zip(names, key)]

    series = []
    for key, durs in sorted(groups.items()):
        if kind == "counts":
            series.append({"labels": labels(key), "value": float(len(durs))})
        else:
            series += [{"labels": labels(key) + [{"key": "p", "value": {"doubleValue": p}}],
                        "value": tempo_log2_quantile(p, durs) / 1e9} for p in QUANTILES]
    return {"series": series, "metrics": {"completedJobs": 1, "totalJobs": 1}}


def _go_duration(seconds: int) -> str:
    """Seconds as Go prints a time.Duration (``168h0m0s``)."""
    return f"{seconds // 3600}h{seconds % 3600 // 60}m{seconds % 60}s"


class _Handler(BaseHTTPRequestHandler):
    state: StandInState

    def do_GET(self) -> None:
        parts = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qs(parts.query)
        st = self.state
        st.requests.append((parts.path, q))
        if parts.path == "/api/search":
            return self._send(*st.search(q))
        m = re.fullmatch(r"/api/v2/traces/([0-9a-fA-F]+)", parts.path)
        if m and m.group(1) in st.rec.traces:
            body = st.rec.traces[m.group(1)]
            if st.cut_body_at is not None:
                return self._send(200, body, cut=st.cut_body_at)
            if st.partial_trace_message is not None:
                body = json.dumps({**json.loads(body), "status": "PARTIAL",
                                   "message": st.partial_trace_message}).encode()
            return self._send(st.trace_status, body)
        recorded = {"/api/metrics/query_range": st.rec.metrics,
                    "/api/metrics/query": dict(st.rec.metrics_instant)}.get(parts.path, {})
        if parts.path == "/api/metrics/query" and "start" in q and "end" in q:
            computed = _computed_rdma_answer(st, q.get("q", [""])[0], q)
            if computed is not None:
                recorded[q["q"][0]] = computed
        if q.get("q", [""])[0] in recorded:
            if st.metrics_status != 200:
                return self._send(st.metrics_status, b"metrics unavailable (stand-in)")
            answer = dict(recorded[q["q"][0]])
            if st.metrics_partial_message is not None:
                answer.update(status="PARTIAL", message=st.metrics_partial_message)
            if st.metrics_jobs is not None:
                answer["metrics"] = {"completedJobs": st.metrics_jobs[0],
                                     "totalJobs": st.metrics_jobs[1]}
            return self._send(200, json.dumps(answer).encode())
        return self._send(404, b"trace not found")

    def _send(self, status: int, body: bytes, cut: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if status in (200, 206)
                         else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body if cut is None else body[:cut])
        if cut is not None:
            self.wfile.flush()
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def serve(rec: Recording | None = None, **kw: Any) -> Iterator[tuple[str, StandInState]]:
    """(``HOST:PORT``, state) of a stand-in on 127.0.0.1 serving ``rec`` (default: the recording)."""
    rec = rec or Recording.load()
    newest = max(int(t["startTimeUnixNano"]) for t in rec.search_range["traces"])
    # the recording's newest trace started a minute ago: inside the default one-hour range
    state = StandInState(rec=rec, shift_ns=time.time_ns() - 60 * 10**9 - newest, **kw)
    handler = type("Handler", (_Handler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_port}", state
    finally:
        server.shutdown()
        server.server_close()
