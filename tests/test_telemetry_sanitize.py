"""One bad attribute value never costs other spans (issue 18): strings UTF-8 cannot encode (a lone
surrogate, a header byte that was not UTF-8) are replaced before export, and a batch whose export
raises is exported span by span. Through the real OTLP protobuf encoder and the JSON-lines file."""
from __future__ import annotations

import json

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from kvtune import spans
from kvtune.telemetry import GuardedSpanExporter, JsonLinesSpanExporter, clean_text

BAD = "conv-\ud800-\udcff"
"""A lone surrogate, and a byte 0xff as aiohttp decodes a non-UTF-8 header (surrogateescape)."""


class ProtobufExporter(SpanExporter):
    """Encodes each batch with the OTLP exporters' own protobuf encoder (what goes on the wire)."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def export(self, batch):
        self.payloads.append(encode_spans(batch).SerializeToString())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def _make_spans(exporter: SpanExporter, resource: Resource | None = None) -> None:
    provider = TracerProvider(resource=resource or Resource.create({}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("good-1") as s:
        s.set_attribute(spans.CONVERSATION_ID, "fine")
    with tracer.start_as_current_span("kv.request") as s:
        s.set_attribute(spans.CONVERSATION_ID, BAD)
        s.set_attribute("list", ["ok", BAD])
        s.add_event("ev", {"why": BAD})
    with tracer.start_as_current_span("good-2") as s:
        s.set_attribute(spans.TURN, 2)
    provider.shutdown()


class Batch(SpanExporter):
    """Collects spans and hands them to ``target`` as one batch at shutdown (like a batch
    processor would)."""

    def __init__(self, target: SpanExporter | None) -> None:
        self.target, self.spans = target, []
        self.result = None

    def export(self, batch):
        self.spans.extend(batch)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self.target is not None:
            self.result = self.target.export(self.spans)


def test_without_sanitising_one_bad_value_costs_the_batch_or_the_value(tmp_path):
    """The defect: the JSON-lines file exporter loses the whole batch (all 3 spans) on one lone
    surrogate; the OTLP protobuf encoder drops the attribute (logging an error per value)."""
    batch = Batch(None)
    _make_spans(batch)
    assert len(batch.spans) == 3
    path = tmp_path / "raw.jsonl"
    raw = JsonLinesSpanExporter(path)
    try:
        raw.export(batch.spans)
    except UnicodeEncodeError:
        pass
    else:
        raise AssertionError("the file exporter took a lone surrogate: this test shows nothing")
    finally:
        raw.shutdown()
    assert not path.exists() or path.read_text(encoding="utf-8", errors="replace").strip() == ""
    sent = encode_spans(batch.spans).resource_spans[0].scope_spans[0].spans
    assert spans.CONVERSATION_ID not in {a.key for a in sent[1].attributes}


def test_guarded_exporter_sanitises_so_every_span_is_exported():
    inner = ProtobufExporter()
    guard = GuardedSpanExporter(inner)
    batch = Batch(guard)
    _make_spans(batch, Resource.create({"bad.resource": BAD}))
    assert batch.result is SpanExportResult.SUCCESS
    assert guard.dropped_spans == 0
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    req = ExportTraceServiceRequest.FromString(inner.payloads[0])
    sent = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert [s.name for s in sent] == ["good-1", "kv.request", "good-2"]
    conv = {a.key: a.value for a in sent[1].attributes}[spans.CONVERSATION_ID].string_value
    assert conv == "conv-\ufffd-\ufffd"
    assert sent[1].events[0].attributes[0].value.string_value == "conv-\ufffd-\ufffd"
    res = {a.key: a.value.string_value for a in req.resource_spans[0].resource.attributes}
    assert res["bad.resource"] == "conv-\ufffd-\ufffd"


def test_json_lines_file_keeps_every_span(tmp_path):
    path = tmp_path / "spans.jsonl"
    guard = GuardedSpanExporter(JsonLinesSpanExporter(path))
    batch = Batch(guard)
    _make_spans(batch)
    assert batch.result is SpanExportResult.SUCCESS and guard.dropped_spans == 0
    doc = json.loads(path.read_text(encoding="utf-8"))
    names = [s["name"] for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    assert names == ["good-1", "kv.request", "good-2"]


class FailsOnOneSpan(SpanExporter):
    """Raises on any batch that holds the span named ``bad`` (an encoder bug we cannot foresee)."""

    def __init__(self) -> None:
        self.exported: list[str] = []

    def export(self, batch):
        if any(s.name == "good-2" for s in batch):
            raise ValueError("cannot encode this one")
        self.exported.extend(s.name for s in batch)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def test_a_raising_batch_is_exported_span_by_span():
    inner = FailsOnOneSpan()
    guard = GuardedSpanExporter(inner)
    batch = Batch(guard)
    _make_spans(batch)
    assert batch.result is SpanExportResult.FAILURE
    assert guard.dropped_spans == 1
    assert inner.exported == ["good-1", "kv.request"]


def test_clean_text():
    assert clean_text("plain") == "plain"
    assert clean_text("é 😀") == "é 😀"
    assert clean_text("\ud83d\ude00") == "😀"  # a surrogate pair is a character
    assert clean_text("a\ud800b") == "a\ufffdb"
    assert clean_text("\udcff") == "\ufffd"
