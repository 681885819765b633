"""Request ids and trace context shared by both sides of a KV transfer (no vLLM import).

vLLM names one request differently on each engine: the OpenAI server makes ``cmpl-<X>-<i>`` (or
``chatcmpl-<X>``) from the ``X-Request-Id`` header ``<X>``, and the engine appends a random
``-<8 hex>``. :func:`base_request_id` undoes both so that the prefill, the decode and the router
compute the same id, and :func:`transfer_context` gives both sides the same parent context: the
request's W3C ``traceparent`` when one came with it, else one derived from the base request id.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Final

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvtune import spans
from kvtune.spans import TRACEPARENT_HEADER

_PREFIXED_RE: Final = re.compile(r"(?:chatcmpl|cmpl)-(?P<base>.+?)(?:-\d+)?(?:-[0-9a-f]{8})?",
                                 re.IGNORECASE)
"""``cmpl-<X>-<i>-<8 hex>`` / ``chatcmpl-<X>-<8 hex>``; index and random suffix optional."""
_PROPAGATOR: Final = TraceContextTextMapPropagator()


def base_request_id(request_id: str) -> str:
    """The id a request has on every engine: vLLM's prefixes and suffixes removed.

    ``cmpl-abc-0-1f2e3d4c`` (a completion on an engine), ``cmpl-abc-0`` (randomisation disabled)
    and ``chatcmpl-abc-1f2e3d4c`` give ``abc``. An id without vLLM's ``cmpl-``/``chatcmpl-`` prefix
    is taken as the client's ``X-Request-Id`` itself (push mode's ``remote_request_id``) and kept
    whole, even when it ends in 8 hex digits: stripping those would break ids such as
    ``warmup-4fe872f4`` that the prefill sees as ``cmpl-warmup-4fe872f4-0-<suffix>``.
    """
    m = _PREFIXED_RE.fullmatch(request_id)
    return m.group("base") if m is not None else request_id


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def derived_span_context(base_id: str) -> SpanContext:
    """A remote parent derived only from ``base_id``: same trace id and parent id on every host.

    Used when a request came without a ``traceparent``, so that the prefill's and the decode's
    spans of one request still meet in one trace (as siblings under a parent nobody emits).
    """
    d = _digest(f"kvtune-trace:{base_id}")
    trace_id = int.from_bytes(d[:16], "big") or 1
    span_id = int.from_bytes(d[16:24], "big") or 1
    return SpanContext(trace_id=trace_id, span_id=span_id, is_remote=True,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED))


_TRACEPARENT_RE: Final = re.compile(
    r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$")
"""W3C ``traceparent``, as OpenTelemetry's ``TraceContextTextMapPropagator`` reads it."""
_TRACEPARENT_MAX_CHARS: Final = 512
_ZERO_TRACE_ID: Final = "0" * 32
_ZERO_SPAN_ID: Final = "0" * 16


def parse_traceparent(value: object) -> SpanContext | None:
    """The span context of a W3C ``traceparent`` string, or None when absent or invalid.

    The same context OpenTelemetry's ``TraceContextTextMapPropagator.extract`` gives (without a
    ``tracestate``; a test compares them), in a fifth of its time: it runs on the engine loop."""
    if not isinstance(value, str) or not value or len(value) > _TRACEPARENT_MAX_CHARS:
        return None
    m = _TRACEPARENT_RE.search(value)
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if (trace_id == _ZERO_TRACE_ID or span_id == _ZERO_SPAN_ID or version == "ff"
            or (version == "00" and rest)):
        return None
    sc = SpanContext(trace_id=int(trace_id, 16), span_id=int(span_id, 16), is_remote=True,
                     trace_flags=TraceFlags(int(flags, 16)))
    return sc if sc.is_valid else None


def _parse_traceparent_otel(value: object) -> SpanContext | None:
    """:func:`parse_traceparent` through OpenTelemetry's propagator (the reference, for tests)."""
    if not isinstance(value, str) or not value:
        return None
    ctx = _PROPAGATOR.extract({TRACEPARENT_HEADER: value})
    sc = trace.get_current_span(ctx).get_span_context()
    return sc if sc.is_valid else None


def format_traceparent(sc: SpanContext) -> str:
    """The W3C ``traceparent`` of a span context."""
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def request_span_context(base_id: str, *, trace_headers: Mapping[str, str] | None = None,
                         kv_params: Mapping[str, object] | None = None,
                         key: str = spans.KV_PARAMS_TRACEPARENT) -> SpanContext:
    """The parent for a request's spans: ``kv_params[key]``, else vLLM's ``trace_headers``
    ``traceparent``, else :func:`derived_span_context` of ``base_id``."""
    return (given_span_context(trace_headers=trace_headers, kv_params=kv_params, key=key)
            or derived_span_context(base_id))


def given_span_context(*, trace_headers: Mapping[str, str] | None = None,
                       kv_params: Mapping[str, object] | None = None,
                       key: str = spans.KV_PARAMS_TRACEPARENT) -> SpanContext | None:
    """The trace context a request came with: ``kv_params[key]``, else vLLM's ``trace_headers``
    ``traceparent``; None when neither holds a valid one."""
    if kv_params:
        sc = parse_traceparent(kv_params.get(key))
        if sc is not None:
            return sc
    if trace_headers:
        value = trace_headers.get(TRACEPARENT_HEADER)
        if value is None:  # header names are case-insensitive
            value = next((v for k, v in trace_headers.items()
                          if k.lower() == TRACEPARENT_HEADER), None)
        return parse_traceparent(value)
    return None


def context_of(sc: SpanContext) -> Context:
    """An OpenTelemetry context whose current span is ``sc`` (for ``start_span(context=...)``)."""
    return trace.set_span_in_context(NonRecordingSpan(sc))
