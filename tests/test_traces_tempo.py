"""Tempo source: the client against a local HTTP server serving Tempo API response bodies.

``StandInTempo`` is a stand-in for Grafana Tempo (which cannot run here): it serves the bodies in
tests/fixtures/traces (``/api/search``, ``/api/traces/<id>`` in the v1 ``batches`` shape with base64
ids, ``/api/v2/traces/<id>`` in the ``trace.resourceSpans`` shape) and records each request.
"""
from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvtune import spans
from kvtune.errors import TraceSourceError
from kvtune.traces import TempoSource, load

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
T1 = "0af7651916cd43dd8448eb211c80319c"  # served by v1 only (base64 ids inside)
T2 = "4bf92f3577b34da6a3ce929d0e0e4736"  # served by v2 only (hex ids inside)


class StandInTempo(BaseHTTPRequestHandler):
    requests: list[tuple[str, dict[str, list[str]]]] = []
    search_status = 200

    def do_GET(self) -> None:  # noqa: N802
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
    fetched = [p for p, _ in StandInTempo.requests[1:]]
    # auto: v2 first, then v1 on 404
    assert fetched == [f"/api/v2/traces/{T1}", f"/api/traces/{T1}", f"/api/v2/traces/{T2.lstrip('0')}"]


def test_tempo_source_object_with_v1_api(tempo: str) -> None:
    src = TempoSource(f"http://{tempo}", query="{}", limit=5, api="v1")
    with pytest.raises(TraceSourceError, match="HTTP 404"):
        load(src)  # T2 exists only on v2 in the stand-in
    assert StandInTempo.requests[0][1] == {"q": ["{}"], "limit": ["5"]}


def test_tempo_defaults_and_url_parsing() -> None:
    src = TempoSource.from_url("tempo+https://tempo.example:3200/prefix/?q=%7B%7D")
    assert src.base_url == "https://tempo.example:3200/prefix"
    assert src.query == "{}" and src.start_s is None and src.end_s is None and src.api == "auto"
    with pytest.raises(TraceSourceError, match="start"):
        TempoSource.from_url("tempo+http://h:1?start=yesterday")
    with pytest.raises(TraceSourceError, match="api"):
        TempoSource("http://h:1", api="v9")


def test_tempo_errors(tempo: str) -> None:
    StandInTempo.search_status = 500
    with pytest.raises(TraceSourceError, match="HTTP 500"):
        load(f"tempo+http://{tempo}")
    with socket_closed() as port:
        with pytest.raises(TraceSourceError, match="unreachable"):
            load(TempoSource(f"http://127.0.0.1:{port}", timeout_s=5))


class socket_closed:  # noqa: N801 - context manager giving a port nobody listens on
    def __enter__(self) -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        pass
