"""Tempo source: the client against a local HTTP server serving Tempo API response bodies.

``StandInTempo`` is a stand-in for Grafana Tempo (which cannot run here): it serves the bodies in
tests/fixtures/traces (``/api/search``, ``/api/traces/<id>`` in the v1 ``batches`` shape with base64
ids, ``/api/v2/traces/<id>`` in the ``trace.resourceSpans`` shape) and records each request.
"""
from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvtune import spans
from kvtune.errors import TraceSourceError
from kvtune.traces import TempoSource, load
from kvtune.traces.tempo import DEFAULT_SINCE_S
from _net import free_port

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
T1 = "0af7651916cd43dd8448eb211c80319c"  # served by v1 only (base64 ids inside)
T2 = "4bf92f3577b34da6a3ce929d0e0e4736"  # served by v2 only (hex ids inside)


class StandInTempo(BaseHTTPRequestHandler):
    requests: list[tuple[str, dict[str, list[str]]]] = []
    search_status = 200

    def do_GET(self) -> None:
        parts = urllib.parse.urlsplit(self.path)
        type(self).requests.append((parts.path, urllib.parse.parse_qs(parts.query)))
        if self.headers.get("Accept") != "application/json":
            return self._send(406, b"protobuf not served by the stand-in")
        if parts.path == "/api/search":
            if self.search_status != 200:
                return self._send(self.search_status, b"boom")
            return self._send(200, (FIXTURES / "tempo_search.json").read_bytes())
        if parts.path == f"/api/traces/{T1}":
            return self._send(200, (FIXTURES / "tempo_v1_trace.json").read_bytes())
        if parts.path == f"/api/v2/traces/{T2.lstrip('0')}":
            return self._send(200, (FIXTURES / "tempo_v2_trace.json").read_bytes())
        return self._send(404, b"trace not found")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def tempo() -> Iterator[str]:
    StandInTempo.requests = []
    StandInTempo.search_status = 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInTempo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_tempo_url_search_then_fetch_both_shapes(tempo: str) -> None:
    df = load(f"tempo+http://{tempo}?q=%7Bresource.service.name%3D~%22kvtune.*%22%7D"
              f"&start=1700000000&end=1700003600&limit=50")
    search_path, params = StandInTempo.requests[0]
    assert search_path == "/api/search"
    assert params == {"q": ['{resource.service.name=~"kvtune.*"}'], "start": ["1700000000"],
                      "end": ["1700003600"], "limit": ["50"]}
    assert len(df) == 3
    by_name = df.set_index("name")
    rdma = by_name.loc[spans.SpanName.RDMA.value]  # v1 body, base64 ids
    assert rdma["trace_id"] == T1 and rdma["span_id"] == "b7ad6b7169203331"
    assert rdma["parent_span_id"] == "00f067aa0ba902b7"
    assert rdma["status"] == "ERROR" and rdma["status_message"] == "timeout"
    assert rdma[spans.BYTES] == 1_048_576 and rdma["service"] == "kvtune-prefill"
    assert by_name.loc[spans.SpanName.REQUEST.value]["status"] == "OK"
    notify = by_name.loc[spans.SpanName.NOTIFY.value]  # v2 body, hex ids
    assert notify["trace_id"] == T2 and notify[spans.TURN] == 2 and notify["host"] == "gpu-1"
    assert len(df.attrs["sources"]) == 2
    fetched = [p for p, _ in StandInTempo.requests if p != "/api/search"]
    # auto: v2 first, then v1 on 404
    assert fetched == [f"/api/v2/traces/{T1}", f"/api/traces/{T1}", f"/api/v2/traces/{T2.lstrip('0')}"]


def test_tempo_source_object_with_v1_api(tempo: str) -> None:
    src = TempoSource(f"http://{tempo}", query="{}", limit=5, api="v1")
    with pytest.raises(TraceSourceError, match="HTTP 404"):
        load(src)  # T2 exists only on v2 in the stand-in
    params = StandInTempo.requests[0][1]
    # no range given: the last hour, sent explicitly (Tempo alone would read only its ingesters)
    assert params["q"] == ["{}"] and params["limit"] == ["5"]
    assert int(params["end"][0]) - int(params["start"][0]) == DEFAULT_SINCE_S
    assert abs(int(params["end"][0]) - time.time()) < 120


def test_tempo_defaults_and_url_parsing() -> None:
    src = TempoSource.from_url("tempo+https://tempo.example:3200/prefix/?q=%7B%7D")
    assert src.base_url == "https://tempo.example:3200/prefix"
    assert src.query == "{}" and src.start_s is None and src.end_s is None and src.api == "auto"
    assert src.time_range(now_s=1_800_000_000.2) == (1_800_000_002 - 3600, 1_800_000_002,
                                                     f"default: last {DEFAULT_SINCE_S} s")
    since = TempoSource.from_url("tempo+http://h:1?since=1h30m")
    assert since.since_s == 5400 and since.time_range(now_s=10_000)[:2] == (10_001 - 5400, 10_001)
    assert TempoSource.from_url("tempo+http://h:1?since=90").since_s == 90
    assert TempoSource.from_url("tempo+http://h:1?since=2d").since_s == 2 * 86400
    ended = TempoSource.from_url("tempo+http://h:1?end=5000&since=100")
    assert ended.time_range(now_s=9e9)[:2] == (4900, 5000)
    started = TempoSource.from_url("tempo+http://h:1?start=5000")
    assert started.time_range(now_s=6000) == (5000, 6001, "start..now")
    with pytest.raises(TraceSourceError, match="start"):
        TempoSource.from_url("tempo+http://h:1?start=yesterday")
    with pytest.raises(TraceSourceError, match="api"):
        TempoSource("http://h:1", api="v9")


@pytest.mark.parametrize("query, field", [
    ("limit=inf", "limit"), ("limit=nan", "limit"), ("limit=-inf", "limit"), ("limit=0", "limit"),
    ("limit=-3", "limit"), ("limit=1e400", "limit"), ("start=inf", "start"), ("end=nan", "end"),
    ("start=-1", "start"), ("end=1e30", "end"), ("since=inf", "since"), ("since=0", "since"),
    ("since=soon", "since"), ("since=-5m", "since"), ("since=1h&start=5", "start or since"),
    ("start=10&end=10", "end"), ("start=10&end=5", "end"), ("since=1y", "since"),
])
def test_bad_url_parameters_name_the_url_and_the_parameter(query, field):
    url = f"tempo+http://h:1?q=%7B%7D&{query}"
    with pytest.raises(TraceSourceError) as info:
        TempoSource.from_url(url)
    assert str(info.value).startswith(url) and field in str(info.value)


def test_bad_source_fields_are_source_errors():
    for kw in ({"limit": 0}, {"limit": 2.5}, {"limit": True}, {"start_s": -1}, {"end_s": 2**70},
               {"since_s": 0}, {"timeout_s": float("inf")}, {"start_s": 5, "since_s": 5}):
        with pytest.raises(TraceSourceError):
            TempoSource("http://h:1", **kw)


def test_tempo_errors(tempo: str) -> None:
    StandInTempo.search_status = 500
    with pytest.raises(TraceSourceError, match="HTTP 500"):
        load(f"tempo+http://{tempo}")
    with pytest.raises(TraceSourceError, match="unreachable"):
        load(TempoSource(f"http://127.0.0.1:{free_port()}", timeout_s=5))
