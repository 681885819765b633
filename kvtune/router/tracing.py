"""The router's telemetry: set-up through ``kvtune.telemetry`` when present, W3C trace context out.

Telemetry never breaks routing: a failing set-up is logged and the router runs with whatever tracer
the OpenTelemetry API gives.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvtune.spans import TRACEPARENT_HEADER, Role

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


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span, or None when there is no valid span."""
    carrier: dict[str, str] = {}
    try:
        _PROPAGATOR.inject(carrier)
    except Exception:
        _logger.warning("traceparent injection failed", exc_info=True)
        return None
    return carrier.get(TRACEPARENT_HEADER)


def client_span_context(headers: Mapping[str, str]) -> trace.SpanContext | None:
    """The span context a client sent in its ``traceparent`` header, if valid (used as a link)."""
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
