"""Spans recorded on the engine's threads and built on the recorder's: nothing lost, nothing
raised into the host, bounded memory, head sampling honoured (no vLLM needed)."""
from __future__ import annotations

import logging
import threading
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanContext, TraceFlags

from kvtune import spans
from kvtune.connectors.ids import derived_span_context, parse_traceparent
from kvtune.connectors.observer import Emitter
from kvtune.connectors.recorder import SpanRecorder

WAIT_S = 30.0


def _provider(sampler=None) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler) if sampler is not None else TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _emitter(provider: TracerProvider, recorder: SpanRecorder | None) -> Emitter:
    return Emitter(spans.Role.DECODE, spans.Mode.PULL, "eng", tracer=provider.get_tracer("t"),
                   deferred=recorder is not None, recorder=recorder)


def test_builder_thread_builds_recorded_spans_with_their_values() -> None:
    provider, exporter = _provider()
    recorder = SpanRecorder(interval_s=0.01)
    em = _emitter(provider, recorder)
    parent = derived_span_context("r1")
    calls: list[str] = []

    def attrs() -> dict:
        calls.append(threading.current_thread().name)
        return {spans.TOKENS: 7}

    em.emit(spans.SpanName.NOTIFY, parent, 1_000, 2_000, attrs)
    deadline = time.monotonic() + WAIT_S
    while not exporter.get_finished_spans() and time.monotonic() < deadline:
        time.sleep(0.005)
    (span,) = exporter.get_finished_spans()
    assert calls == ["kvtune-span-builder"]  # attributes made off the caller's thread
    assert (span.start_time, span.end_time) == (1_000, 2_000)
    assert span.parent.span_id == parent.span_id and span.attributes[spans.TOKENS] == 7
    recorder.close()


def test_a_base_id_parent_is_derived_when_the_span_is_built() -> None:
    provider, exporter = _provider()
    recorder = SpanRecorder(interval_s=None)
    _emitter(provider, recorder).emit(spans.SpanName.QUEUE, "r2", 1, 2)
    assert exporter.get_finished_spans() == ()
    assert recorder.drain() == 1
    (span,) = exporter.get_finished_spans()
    assert span.context.trace_id == derived_span_context("r2").trace_id
    assert span.parent.span_id == derived_span_context("r2").span_id


def test_flush_and_close_lose_nothing() -> None:
    provider, exporter = _provider()
    recorder = SpanRecorder(interval_s=60.0)  # the thread would wait a minute
    em = _emitter(provider, recorder)
    for i in range(50):
        em.emit(spans.SpanName.NOTIFY, derived_span_context(f"r{i}"), i, i + 1)
    em.flush()
    assert len(exporter.get_finished_spans()) == 50 and recorder.pending() == 0
    em.emit(spans.SpanName.NOTIFY, derived_span_context("last"), 1, 2)
    recorder.close()
    assert len(exporter.get_finished_spans()) == 51


def test_a_failing_build_is_counted_logged_once_and_spares_the_others(
        caplog: pytest.LogCaptureFixture) -> None:
    provider, exporter = _provider()
    recorder = SpanRecorder(interval_s=None)
    em = _emitter(provider, recorder)

    def broken() -> dict:
        raise ValueError("broken attribute builder")

    with caplog.at_level(logging.DEBUG, logger="kvtune.connectors"):
        em.emit(spans.SpanName.NOTIFY, derived_span_context("a"), 1, 2, broken)  # the caller
        em.emit(spans.SpanName.NOTIFY, derived_span_context("b"), 1, 2, broken)  # sees nothing
        em.emit(spans.SpanName.NOTIFY, derived_span_context("c"), 1, 2, {spans.TOKENS: 1})
        assert recorder.drain() == 3
    assert recorder.failures == 2
    assert [s.attributes.get(spans.TOKENS) for s in exporter.get_finished_spans()] == [1]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "serving is unaffected" in warnings[0].getMessage()


def test_queue_is_bounded_and_counts_what_it_drops() -> None:
    provider, exporter = _provider()
    recorder = SpanRecorder(interval_s=None, max_pending=3)
    em = _emitter(provider, recorder)
    for i in range(5):
        em.emit(spans.SpanName.NOTIFY, derived_span_context(f"r{i}"), i, i + 1)
    assert recorder.pending() == 3 and recorder.dropped == 2
    recorder.drain()
    assert [s.start_time for s in exporter.get_finished_spans()] == [0, 1, 2]


UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


@pytest.mark.parametrize("deferred", [True, False])
def test_unsampled_parent_records_nothing_under_a_parent_based_sampler(deferred: bool) -> None:
    provider, exporter = _provider()  # OTel's default: parent-based
    recorder = SpanRecorder(interval_s=None) if deferred else None
    em = _emitter(provider, recorder)

    def attrs() -> dict:
        raise AssertionError("attributes built for an unsampled request")

    em.emit(spans.SpanName.NOTIFY, parse_traceparent(UNSAMPLED), 1, 2, attrs)
    assert recorder is None or recorder.pending() == 0
    em.emit(spans.SpanName.NOTIFY, parse_traceparent(UNSAMPLED[:-2] + "01"), 1, 2)
    em.flush()
    (span,) = exporter.get_finished_spans()
    assert span.context.trace_flags.sampled


def test_a_sampler_that_ignores_the_parent_flag_still_decides() -> None:
    """The early drop is only the SDK's own decision made sooner: under ALWAYS_ON an unsampled
    parent's child is recorded, as the SDK would."""
    provider, exporter = _provider(ALWAYS_ON)
    recorder = SpanRecorder(interval_s=None)
    em = _emitter(provider, recorder)
    sc = SpanContext(trace_id=5, span_id=6, is_remote=True, trace_flags=TraceFlags(0))
    em.emit(spans.SpanName.NOTIFY, sc, 1, 2)
    assert recorder.pending() == 1
    recorder.drain()
    assert len(exporter.get_finished_spans()) == 1


def test_telemetry_flush_builds_what_connectors_recorded(tmp_path) -> None:
    """Who flushes or shuts down the telemetry gets the recorded spans too (vLLM's exit)."""
    from kvtune import telemetry
    from kvtune.traces import load

    tel = telemetry.setup(spans.Role.DECODE, json_path=tmp_path)
    recorder = SpanRecorder(interval_s=60.0)
    Emitter(spans.Role.DECODE, spans.Mode.PULL, "eng", tracer=tel.tracer, telemetry=tel,
            deferred=True, recorder=recorder).emit(spans.SpanName.NOTIFY,
                                                   derived_span_context("r"), 1, 2)
    tel.shutdown()
    assert list(load(tmp_path)["name"]) == [spans.SpanName.NOTIFY.value]
    recorder.close()
