"""The router's telemetry: set-up through ``kvtune.telemetry`` when present, W3C trace context out.

Telemetry never breaks routing: a failing set-up is logged and the router runs with whatever tracer
the OpenTelemetry API gives.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvtune.spans import (
    ERROR_TYPE, HTTP_CONNECTION_REUSED, HTTP_REQUEST_BYTES, HTTP_RESPONSE_BYTES, MODE,
    TRACEPARENT_HEADER, Role, SpanName,
)

_logger = logging.getLogger(__name__)
TRACER_NAME = "kvtune.router"
_PROPAGATOR = TraceContextTextMapPropagator()


def setup_telemetry(options: Mapping[str, Any] | None = None
                    ) -> tuple[trace.Tracer, Callable[[], None]]:
    """Tracing for a router process: ``(tracer, flush-and-shutdown callable)``.

    Uses ``kvtune.telemetry.setup(Role.ROUTER, **options)`` (JSON-lines files, OTLP, or the
    ``KVTUNE_SPANS_DIR`` / ``OTEL_*`` variables). Should that fail, falls back to an SDK
    ``TracerProvider`` without exporters, so trace ids still exist and the ``traceparent`` still
    joins the legs' spans into one trace (a warning says the router's spans are not exported).
    """
    try:
        from kvtune import telemetry
        handle = telemetry.setup(Role.ROUTER, **dict(options or {}))
        return handle.tracer, _safe(handle.shutdown)
    except Exception:
        _logger.warning("kvtune.telemetry.setup failed; router spans are made (trace context is "
                        "propagated) but not exported", exc_info=True)
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        from kvtune.spans import SERVICE_NAME, service_name
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name(Role.ROUTER)}))
        return provider.get_tracer(TRACER_NAME), _safe(provider.shutdown)
    except Exception:
        _logger.warning("OpenTelemetry SDK set-up failed; tracing is off", exc_info=True)
        return trace.get_tracer(TRACER_NAME), lambda: None


def _safe(fn: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except Exception:
            _logger.warning("telemetry shutdown failed", exc_info=True)
    return run


_EMPTY_CONTEXT: Final = otel_context.Context()
"""An empty context: ``kv.request``'s parent (none), and the base of the one its traceparent is
read from."""


def start_request_span(tracer: trace.Tracer, links: Sequence[trace.Link] = ()) -> trace.Span:
    """Start ``kv.request``: always a trace root (an empty parent context on purpose), without
    attributes (the caller sets them all once the reply is sent: cleaning attributes is a third
    of the SDK's cost of a span). It is not made the current span (no context attach and detach
    per request): the legs get its context through :func:`traceparent_of`. The caller ends it."""
    return tracer.start_span(
        SpanName.REQUEST.value, context=_EMPTY_CONTEXT, kind=trace.SpanKind.SERVER, links=links,
        record_exception=False, set_status_on_exception=False)


def traceparent_of(span: trace.Span) -> str | None:
    """The W3C ``traceparent`` of ``span``, or None when its context is not valid (tracing off)."""
    carrier: dict[str, str] = {}
    try:
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span, _EMPTY_CONTEXT))
    except Exception:
        _logger.warning("traceparent injection failed", exc_info=True)
        return None
    return carrier.get(TRACEPARENT_HEADER)


def client_span_context(headers: Mapping[str, str]) -> trace.SpanContext | None:
    """The span context a client sent in its ``traceparent`` header, if valid (used as a link)."""
    if TRACEPARENT_HEADER not in headers:  # most requests: nothing to extract
        return None
    try:
        ctx = _PROPAGATOR.extract(dict(headers))
        sc = trace.get_current_span(ctx).get_span_context()
        return sc if sc.is_valid else None
    except Exception:
        return None


def set_attributes(span: trace.Span, attributes: MutableMapping[str, Any]) -> None:
    """Set the non-None attributes on a recording span; never raises."""
    try:
        if span.is_recording():
            span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    except Exception:
        _logger.warning("setting span attributes failed", exc_info=True)


# --- The request's phases: kv.route, kv.prefill_leg, kv.handoff, kv.decode_leg -------------------
LEG_SPANS: Final = {"prefill": SpanName.PREFILL_LEG, "decode": SpanName.DECODE_LEG}
"""The router's leg names (``UpstreamError.leg``, ``LegRecord.leg``) and their spans."""
LEG_ERROR_TYPE: Final = "UpstreamError"
"""``error.type`` of a leg span whose leg failed (the reason is its status message)."""


@dataclass
class _Leg:
    start_ns: int
    end_ns: int | None = None
    reused: bool | None = None
    request_bytes: int = 0
    response_bytes: int | None = None
    """None: not counted (aiohttp signals no chunks of a response read as a stream)."""
    error: str | None = None


@dataclass
class RequestPhases:
    """Moments of one request's legs, recorded as they happen (a few integer stores) and turned
    into child spans of ``kv.request`` once, when the request ends (:meth:`emit`)."""

    start_ns: int = field(default_factory=time.time_ns)
    legs: dict[str, _Leg] = field(default_factory=dict)

    def emit(self, tracer: trace.Tracer, parent: trace.Span) -> None:
        """Add ``kv.route``, the legs and ``kv.handoff`` under ``parent``; never raises."""
        try:
            if not parent.is_recording() or not self.legs:
                return
            ctx = trace.set_span_in_context(parent)
            # the request's serving mode on every phase: the dashboards' mode filter keeps them
            mode = {MODE: (getattr(parent, "attributes", None) or {}).get(MODE)}
            first = min(leg.start_ns for leg in self.legs.values())
            _span(tracer, ctx, SpanName.ROUTE, self.start_ns, first, mode)
            for name, leg in self.legs.items():
                end = leg.end_ns if leg.end_ns is not None else time.time_ns()
                _span(tracer, ctx, LEG_SPANS[name], leg.start_ns, end, {
                    **mode,
                    HTTP_CONNECTION_REUSED: leg.reused, HTTP_REQUEST_BYTES: leg.request_bytes,
                    HTTP_RESPONSE_BYTES: leg.response_bytes,
                    ERROR_TYPE: None if leg.error is None else LEG_ERROR_TYPE},
                    error=leg.error)
            p, d = self.legs.get("prefill"), self.legs.get("decode")
            if p is not None and d is not None and p.end_ns is not None \
                    and p.end_ns <= d.start_ns:
                _span(tracer, ctx, SpanName.HANDOFF, p.end_ns, d.start_ns, mode)
        except Exception:
            _logger.warning("emitting the router's phase spans failed", exc_info=True)


def _span(tracer: trace.Tracer, ctx: Any, name: SpanName, start_ns: int, end_ns: int,
          attributes: Mapping[str, Any], error: str | None = None) -> None:
    span = tracer.start_span(name.value, context=ctx, start_time=start_ns,
                             kind=trace.SpanKind.INTERNAL,
                             attributes={k: v for k, v in attributes.items() if v is not None})
    if error is not None and span.is_recording():
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end(end_time=max(end_ns, start_ns))


_PHASES: ContextVar[RequestPhases | None] = ContextVar("kvtune_router_phases", default=None)
_LEG: ContextVar[_Leg | None] = ContextVar("kvtune_router_leg", default=None)


def begin_phases(request_span: trace.Span) -> None:
    """Start recording the current request's phases when ``request_span`` (``kv.request``) records
    (the legs' tasks inherit the record); else record nothing. Never raises."""
    try:
        if not request_span.is_recording():
            _PHASES.set(None)
            return
        start = getattr(request_span, "start_time", None)  # the SDK's span: kv.route abuts it
        _PHASES.set(RequestPhases(start) if isinstance(start, int) else RequestPhases())
    except Exception:
        _logger.warning("recording the router's phases failed", exc_info=True)


def end_phases(tracer: trace.Tracer, request_span: trace.Span) -> None:
    """Emit the current request's phases under ``request_span`` (see :meth:`RequestPhases.emit`)."""
    phases = _PHASES.get()
    if phases is not None:
        _PHASES.set(None)
        phases.emit(tracer, request_span)


def leg_started(leg: str) -> None:
    """The current request's ``leg`` ("prefill" or "decode") is about to be sent."""
    phases = _PHASES.get()
    if phases is None or leg not in LEG_SPANS:
        return
    try:
        record = _Leg(time.time_ns())
        phases.legs[leg] = record
        _LEG.set(record)
    except Exception:
        _logger.warning("recording a leg's start failed", exc_info=True)


def leg_ended(leg: str, error: str | None = None) -> None:
    """The current request's ``leg`` has its answer (or failed with ``error``)."""
    phases = _PHASES.get()
    if phases is None:
        return
    record = phases.legs.get(leg)
    if record is not None and record.end_ns is None:
        record.end_ns = time.time_ns()
        record.error = None if error is None else str(error)[:500]


async def _on_reuse(session: Any, ctx: Any, params: Any) -> None:
    record = _LEG.get()
    if record is not None:
        record.reused = True


async def _on_create(session: Any, ctx: Any, params: Any) -> None:
    record = _LEG.get()
    if record is not None and record.reused is None:
        record.reused = False


async def _on_sent(session: Any, ctx: Any, params: Any) -> None:
    record = _LEG.get()
    if record is not None:
        record.request_bytes += len(params.chunk)


def leg_connection(reused: bool) -> None:
    """The current leg goes over a kept-alive connection (``reused``) or a new one."""
    record = _LEG.get()
    if record is not None and record.reused is None:
        record.reused = reused


def leg_request_sent(n_bytes: int) -> None:
    """The current leg's request body of ``n_bytes`` was sent."""
    record = _LEG.get()
    if record is not None:
        record.request_bytes += n_bytes


def leg_body_read(n_bytes: int) -> None:
    """The current leg's answer body grew by ``n_bytes``: for bodies read from the stream (the
    router's capped reads), which aiohttp's chunk signal does not see."""
    record = _LEG.get()
    if record is not None:
        record.response_bytes = (record.response_bytes or 0) + n_bytes


async def _on_received(session: Any, ctx: Any, params: Any) -> None:
    leg_body_read(len(params.chunk))


def client_trace_config() -> aiohttp.TraceConfig:
    """An aiohttp ``TraceConfig`` that tells the current leg whether its connection was reused and
    counts its body bytes (a context-variable read per signal; nothing when no leg is recorded)."""
    config = aiohttp.TraceConfig()
    config.on_connection_reuseconn.append(_on_reuse)
    config.on_connection_create_end.append(_on_create)
    config.on_request_chunk_sent.append(_on_sent)
    config.on_response_chunk_received.append(_on_received)
    return config
