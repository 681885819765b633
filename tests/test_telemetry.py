"""kvtune.telemetry: setup, the OTLP-JSON lines exporter, OTLP export, never breaking the caller."""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

import kvtune
from kvtune import spans, telemetry
from kvtune.errors import ConfigError
from kvtune.traces import load
from _net import free_port

OTEL_VARS = (telemetry.ENV_SPANS_DIR, telemetry.ENV_OTLP_ENDPOINT, telemetry.ENV_OTLP_TRACES_ENDPOINT,
             telemetry.ENV_OTLP_PROTOCOL, telemetry.ENV_OTLP_TRACES_PROTOCOL, telemetry.ENV_SERVICE_NAME,
             telemetry.ENV_RESOURCE_ATTRIBUTES)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)
    yield


def _emit(t: telemetry.Telemetry) -> None:
    with t.tracer.start_as_current_span(spans.SpanName.REQUEST.value, kind=SpanKind.SERVER,
                                        attributes={spans.REQUEST_ID: "r1", spans.STREAM: True,
                                                    spans.PROMPT_TOKENS: 4096}) as root:
        root.add_event("first token", {"n": 1})
        with t.tracer.start_as_current_span(spans.SpanName.RDMA.value, attributes={
                spans.BYTES: 2**40 + 7, spans.NIXL_POST_US: 12.25, spans.PROBE_WARMUP: False,
                spans.NOTIFY_SENT_NS: 1_700_000_000_123_456_789,
                "custom.tuple": (1, 2, 3), "custom.strs": ["a", "b"], "custom.nan": float("nan"),
                "custom.unicode": "décode ✓"}) as child:
            child.set_status(Status(StatusCode.ERROR, "remote went away"))
        root.set_status(Status(StatusCode.OK))


def test_round_trip_through_json_lines_is_identical(tmp_path: Path) -> None:
    memory = InMemorySpanExporter()
    t = telemetry.setup(spans.Role.ROUTER, json_path=tmp_path / "spans.jsonl", exporters=[memory])
    _emit(t)
    t.shutdown()
    emitted = {s.context.span_id: s for s in memory.get_finished_spans()}
    df = load(tmp_path / "spans.jsonl")
    assert len(df) == len(emitted) == 2
    for row in df.itertuples(index=False):
        span = emitted[int(row.span_id, 16)]
        assert row.name == span.name
        assert row.trace_id == format(span.context.trace_id, "032x")
        parent = format(span.parent.span_id, "016x") if span.parent else None
        assert (row.parent_span_id if isinstance(row.parent_span_id, str) else None) == parent
        assert row.start_ns == span.start_time and row.end_ns == span.end_time  # to the ns
        assert row.status == span.status.status_code.name
        assert row.status_message == (span.status.description or "")
        assert row.service == spans.service_name(spans.Role.ROUTER)
        got = dict(row.attrs)
        want = {k: (list(v) if isinstance(v, tuple) else v) for k, v in span.attributes.items()}
        nan_key = "custom.nan"
        if nan_key in want:
            assert got.pop(nan_key) != got.get(nan_key)  # NaN survives as NaN
            want.pop(nan_key)
        assert got == want
    rdma = df[df["name"] == spans.SpanName.RDMA.value].iloc[0]
    assert rdma[spans.BYTES] == 2**40 + 7 and rdma[spans.NOTIFY_SENT_NS] == 1_700_000_000_123_456_789


def test_json_line_shape_is_the_collector_file_exporter_format(tmp_path: Path) -> None:
    t = telemetry.setup("decode", json_path=tmp_path / "s.jsonl", batch=False,
                        resource={spans.MODEL: "qwen"})
    _emit(t)
    t.shutdown()
    lines = (tmp_path / "s.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2  # synchronous export: one request per span
    doc = json.loads(lines[1])
    (rs,) = doc["resourceSpans"]
    res = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
    assert res[spans.SERVICE_NAME] == {"stringValue": "kvtune-decode"}
    assert res[spans.KVTUNE_VERSION] == {"stringValue": kvtune.__version__}
    assert res[spans.KVTUNE_CONVENTION] == {"stringValue": spans.CONVENTION_VERSION}
    assert res[spans.MODEL] == {"stringValue": "qwen"}
    assert spans.HOST_NAME in res
    (ss,) = rs["scopeSpans"]
    assert ss["scope"] == {"name": "kvtune", "version": kvtune.__version__}
    (root,) = ss["spans"]
    assert len(root["traceId"]) == 32 and len(root["spanId"]) == 16 and root["parentSpanId"] == ""
    assert root["kind"] == 2  # OTLP SPAN_KIND_SERVER
    assert isinstance(root["startTimeUnixNano"], str) and int(root["endTimeUnixNano"]) > 0
    assert root["status"] == {"code": 1}
    attrs = {a["key"]: a["value"] for a in root["attributes"]}
    assert attrs[spans.PROMPT_TOKENS] == {"intValue": "4096"}
    assert attrs[spans.STREAM] == {"boolValue": True}
    assert root["events"][0]["name"] == "first token"
    child = json.loads(lines[0])["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    cattrs = {a["key"]: a["value"] for a in child["attributes"]}
    assert cattrs["custom.tuple"] == {"arrayValue": {"values": [{"intValue": "1"}, {"intValue": "2"},
                                                                {"intValue": "3"}]}}
    assert cattrs[spans.NIXL_POST_US] == {"doubleValue": 12.25}
    assert cattrs["custom.nan"] == {"doubleValue": "NaN"}
    assert child["status"] == {"code": 2, "message": "remote went away"}
    assert child["kind"] == 1  # OTLP SPAN_KIND_INTERNAL


def test_json_path_directory_names_file_by_role_host_pid(tmp_path: Path) -> None:
    t = telemetry.setup("prefill", json_path=tmp_path, batch=False)
    _emit(t)
    t.shutdown()
    expected = tmp_path / f"prefill-{socket.gethostname()}-{os.getpid()}.jsonl"
    assert t.json_path == expected and expected.is_file()
    assert len(load(tmp_path)) == 2


def test_env_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(telemetry.ENV_SPANS_DIR, str(tmp_path / "spans"))
    monkeypatch.setenv(telemetry.ENV_SERVICE_NAME, "my-prefill")
    monkeypatch.setenv(telemetry.ENV_RESOURCE_ATTRIBUTES,
                       f"{spans.HOST_NAME}=node-7,{spans.TP_SIZE}=4,bad-item,deployment=a%2Cb")
    t = telemetry.setup("prefill", batch=False)
    attrs = t.provider.resource.attributes
    assert attrs[spans.SERVICE_NAME] == "my-prefill"
    assert attrs[spans.HOST_NAME] == "node-7"
    assert attrs[spans.TP_SIZE] == "4" and attrs["deployment"] == "a,b"
    assert t.json_path is not None and t.json_path.parent == tmp_path / "spans"
    _emit(t)
    t.shutdown()
    df = load(tmp_path / "spans")
    assert set(df["service"]) == {"my-prefill"} and set(df["host"]) == {"node-7"}
    # explicit arguments win over the environment
    t2 = telemetry.setup("prefill", service_name="explicit", resource={spans.HOST_NAME: "h"},
                         json_path=tmp_path / "x.jsonl")
    assert t2.provider.resource.attributes[spans.SERVICE_NAME] == "explicit"
    assert t2.provider.resource.attributes[spans.HOST_NAME] == "h"
    t2.shutdown()


def test_versions_in_resource_come_from_metadata() -> None:
    from importlib import metadata
    t = telemetry.setup("probe")
    attrs = t.provider.resource.attributes
    try:
        assert attrs[spans.NIXL_VERSION] == metadata.version("nixl")
    except metadata.PackageNotFoundError:
        assert spans.NIXL_VERSION not in attrs
    t.shutdown()


def test_bad_role_and_protocol_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="role"):
        telemetry.setup("gpu")
    with pytest.raises(ConfigError, match="protocol"):
        telemetry.setup("probe", otlp_endpoint="http://127.0.0.1:1", otlp_protocol="thrift")


def test_from_env_is_none_without_configuration_and_idempotent(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry, "_FROM_ENV", {})
    assert telemetry.from_env("decode") is None
    assert telemetry.from_env("not-a-role") is None
    monkeypatch.setattr(telemetry, "_FROM_ENV", {})
    monkeypatch.setenv(telemetry.ENV_SPANS_DIR, str(tmp_path))
    first = telemetry.from_env(spans.Role.DECODE)
    assert first is not None and first is telemetry.from_env("decode")
    assert first.json_path is not None and first.json_path.parent == tmp_path
    first.shutdown()


class _Raising(SpanExporter):
    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans_: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        raise RuntimeError("collector exploded")

    def shutdown(self) -> None:
        raise RuntimeError("and again")


def test_failing_exporter_counts_drops_and_warns_once(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    raising = _Raising()
    t = telemetry.setup("sim", json_path=tmp_path / "ok.jsonl", exporters=[raising], batch=False)
    with caplog.at_level(logging.WARNING, logger="kvtune.telemetry"):
        for _ in range(3):
            _emit(t)
    assert raising.calls == 6
    assert t.dropped_spans == 6
    warnings = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(warnings) == 1
    t.shutdown()  # the raising shutdown is swallowed
    t.shutdown()
    assert len(load(tmp_path / "ok.jsonl")) == 6  # the healthy exporter still got everything


class _Blocking(SpanExporter):
    def __init__(self) -> None:
        self.release = threading.Event()
        self.exported = 0

    def export(self, spans_: Sequence[ReadableSpan]) -> SpanExportResult:
        self.release.wait(timeout=60)
        self.exported += len(spans_)
        return SpanExportResult.SUCCESS


def test_full_queue_drops_are_counted_not_logged_per_span(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    slow = _Blocking()
    t = telemetry.setup("decode", exporters=[slow])
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            with t.tracer.start_as_current_span(spans.SpanName.NOTIFY.value):
                pass
        slow.release.set()
        t.force_flush(timeout_millis=30_000)
    t.shutdown()
    assert t.dropped_spans >= 50 - 8 - 4  # at most a queue plus one batch in flight got through
    assert slow.exported + t.dropped_spans == 50
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "queue full" in record.getMessage()


@pytest.mark.parametrize("protocol", [telemetry.PROTOCOL_HTTP, telemetry.PROTOCOL_GRPC])
def test_dead_otlp_endpoint_costs_dropped_spans_not_errors(protocol: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    t = telemetry.setup("router", otlp_endpoint=f"http://127.0.0.1:{free_port()}",
                        otlp_protocol=protocol, otlp_timeout_s=1.0)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            _emit(t)  # never raises
            t.force_flush(timeout_millis=20_000)
    assert t.dropped_spans == 4
    # logged once in all: the exporter's own per-failure errors are folded into kvtune's warning
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.name == "kvtune.telemetry" and "dropped" in record.getMessage()
    t.shutdown()


class _OtlpReceiver(BaseHTTPRequestHandler):
    received: list[ExportTraceServiceRequest] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        type(self).received.append((self.path, req))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_otlp_http_export_reaches_a_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real OTLP/HTTP protobuf export to a local receiver (stand-in for a Collector)."""
    _OtlpReceiver.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OtlpReceiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv(telemetry.ENV_OTLP_ENDPOINT, f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setenv(telemetry.ENV_OTLP_PROTOCOL, telemetry.PROTOCOL_HTTP)
        t = telemetry.setup("prefill", otlp_timeout_s=10)
        assert t.otlp_protocol == telemetry.PROTOCOL_HTTP
        _emit(t)
        assert t.force_flush(timeout_millis=20_000)
        t.shutdown()
    finally:
        server.shutdown()
        server.server_close()
    assert t.dropped_spans == 0
    paths = {p for p, _ in _OtlpReceiver.received}
    assert paths == {"/v1/traces"}
    names = {s.name for _, r in _OtlpReceiver.received for rs in r.resource_spans
             for ss in rs.scope_spans for s in ss.spans}
    assert names == {spans.SpanName.REQUEST.value, spans.SpanName.RDMA.value}


def test_concurrent_exports_write_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    t = telemetry.setup("sim", json_path=path, batch=False)

    def work() -> None:
        for _ in range(20):
            with t.tracer.start_as_current_span(spans.SpanName.RDMA.value, attributes={spans.BYTES: 1}):
                pass

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t.shutdown()
    lines = path.read_text().splitlines()
    assert len(lines) == 80 and all(json.loads(line)["resourceSpans"] for line in lines)
    assert len(load(path)) == 80


def test_otlp_traces_endpoint_is_used_as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is the full signal URL (no /v1/traces appended)."""
    _OtlpReceiver.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OtlpReceiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv(telemetry.ENV_OTLP_TRACES_ENDPOINT,
                           f"http://127.0.0.1:{server.server_port}/custom/traces")
        monkeypatch.setenv(telemetry.ENV_OTLP_ENDPOINT, "http://127.0.0.1:1")  # loses to the above
        t = telemetry.setup("router", otlp_timeout_s=10, batch=False)
        _emit(t)
        t.shutdown()
    finally:
        server.shutdown()
        server.server_close()
    assert {p for p, _ in _OtlpReceiver.received} == {"/custom/traces"}
    assert t.dropped_spans == 0


def test_otlp_grpc_export_reaches_a_receiver() -> None:
    """A real OTLP/gRPC export to a local TraceService (stand-in for a Collector)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[ExportTraceServiceRequest] = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        t = telemetry.setup("decode", otlp_endpoint=f"http://127.0.0.1:{port}",
                            otlp_protocol=telemetry.PROTOCOL_GRPC, otlp_timeout_s=10)
        _emit(t)
        assert t.force_flush(timeout_millis=30_000)
        t.shutdown()
    finally:
        server.stop(grace=None)
    assert t.dropped_spans == 0
    names = {s.name for r in received for rs in r.resource_spans for ss in rs.scope_spans
             for s in ss.spans}
    assert names == {spans.SpanName.REQUEST.value, spans.SpanName.RDMA.value}
    services = {a.value.string_value for r in received for rs in r.resource_spans
                for a in rs.resource.attributes if a.key == spans.SERVICE_NAME}
    assert services == {"kvtune-decode"}
