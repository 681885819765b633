"""Typed decoding of OTLP/JSON trace documents (msgspec structs; unknown fields are skipped).

One decoder accepts every shape kvtune reads:
- an ``ExportTraceServiceRequest`` (``{"resourceSpans": [...]}``): kvtune's and the OpenTelemetry
  Collector ``file`` exporter's lines;
- Tempo's ``/api/traces/<id>`` body (``{"batches": [...]}``, older ``instrumentationLibrarySpans``);
- Tempo's ``/api/v2/traces/<id>`` body (``{"trace": {"resourceSpans": [...]}}``).

Int64 fields may be JSON strings or numbers (lax decoding); enums may be numbers or names.
"""
from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

INT64_MAX = 2**63 - 1
UnixNano = Annotated[int, Meta(ge=0, le=INT64_MAX)]
"""A span timestamp: OTLP's ``fixed64`` nanoseconds, limited to what the frame's int64 columns hold
(values at or above 2**63, year 2262 on, are reported as bad records, not wrapped or overflowed)."""
MAX_VALUE_DEPTH = 32
"""Deepest nesting of ``arrayValue``/``kvlistValue`` inside one attribute value that is read
(OTLP attributes nest one or two levels); deeper values are bad records, not a ``RecursionError``."""


class ArrayValue(Struct, rename="camel", gc=False):
    values: list[AnyValue] = []


class KeyValueList(Struct, rename="camel", gc=False):
    values: list[KeyValue] = []


class AnyValue(Struct, rename="camel", gc=False):
    string_value: str | None = None
    int_value: int | None = None
    double_value: float | None = None
    bool_value: bool | None = None
    array_value: ArrayValue | None = None
    kvlist_value: KeyValueList | None = None
    bytes_value: str | None = None


class KeyValue(Struct, rename="camel", gc=False):
    key: str
    value: AnyValue | None = None


class Status(Struct, rename="camel", gc=False):
    code: int | str = 0
    message: str = ""


class Span(Struct, rename="camel", gc=False):
    trace_id: str
    span_id: str
    name: str
    start_time_unix_nano: UnixNano
    end_time_unix_nano: UnixNano
    parent_span_id: str | None = ""
    attributes: list[KeyValue] = []
    status: Status | None = None


class Resource(Struct, rename="camel", gc=False):
    attributes: list[KeyValue] = []


class ScopeSpans(Struct, rename="camel", gc=False):
    spans: list[Span] = []


class ResourceSpans(Struct, rename="camel", gc=False):
    resource: Resource | None = None
    scope_spans: list[ScopeSpans] = []
    instrumentation_library_spans: list[ScopeSpans] = []


class TraceBody(Struct, rename="camel", gc=False):
    resource_spans: list[ResourceSpans] = []
    batches: list[ResourceSpans] = []


class TraceDocument(Struct, rename="camel", gc=False):
    resource_spans: list[ResourceSpans] | UnsetType = UNSET
    batches: list[ResourceSpans] | UnsetType = UNSET
    trace: TraceBody | UnsetType = UNSET

    def resource_spans_list(self) -> list[ResourceSpans] | None:
        """The document's resource spans whatever its shape; None when it has none of the keys."""
        if self.resource_spans is not UNSET:
            return self.resource_spans
        if self.batches is not UNSET:
            return self.batches
        if self.trace is not UNSET:
            return self.trace.resource_spans or self.trace.batches
        return None


class TempoAnswerStatus(Struct, rename="camel", gc=False):
    """The completeness fields of Tempo's ``/api/v2/traces/<id>`` answer (``TraceByIDResponse``):
    ``status`` ``PARTIAL`` (or 1) with a ``message`` when Tempo cut the trace short (it exceeded
    ``max_bytes_per_trace``)."""

    status: int | str = 0
    message: str = ""


_STATUS_DECODER = msgspec.json.Decoder(TempoAnswerStatus, strict=False)


def tempo_partial(data: bytes) -> str | None:
    """Tempo's message when the answer says the trace is partial; None when complete (or not a
    Tempo v2 answer)."""
    try:
        st = _STATUS_DECODER.decode(data)
    except (msgspec.MsgspecError, RecursionError):
        return None
    if st.status in (1, "PARTIAL", "PARTIAL_STATUS_PARTIAL"):
        return st.message or "Tempo answered a partial trace"
    return None


DOCUMENT_EXPECTED = ("an OTLP ExportTraceServiceRequest ({\"resourceSpans\": [...]}) or a Tempo "
                     "trace ({\"batches\": [...]} or {\"trace\": {\"resourceSpans\": [...]}})")

DECODER = msgspec.json.Decoder(TraceDocument, strict=False)
"""Decodes one document (bytes) into a :class:`TraceDocument` (:func:`decode` bounds its nesting)."""
NESTING_EXPECTED = "JSON nested no deeper than the decoder's recursion limit"


class NestingTooDeep(msgspec.DecodeError):
    """A document nests deeper than the decoder can follow (Python's recursion limit)."""


def decode(data: bytes) -> TraceDocument:
    """One document; ``msgspec.DecodeError``/``ValidationError`` when malformed,
    :class:`NestingTooDeep` (a ``DecodeError``) instead of ``RecursionError`` when nested too deep."""
    try:
        return DECODER.decode(data)
    except RecursionError:
        raise NestingTooDeep("nested too deeply to decode") from None


def decode_untyped(data: bytes) -> Any:
    """``data`` as plain Python objects, with the same errors as :func:`decode`."""
    try:
        return msgspec.json.decode(data)
    except RecursionError:
        raise NestingTooDeep("nested too deeply to decode") from None


class ValueNestingError(ValueError):
    """An attribute value nests arrays/kvlists deeper than :data:`MAX_VALUE_DEPTH`."""

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")


def describe_error(exc: msgspec.MsgspecError) -> tuple[str, str, str]:
    """(field path, what was expected, what was found) from a msgspec decode/validation error."""
    text = str(exc)
    if isinstance(exc, NestingTooDeep):
        return "(json)", NESTING_EXPECTED, "deeper"
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return "(json)", "valid JSON", text
    m = _AT.match(text)
    msg, path = (m.group("msg"), m.group("path") or "$") if m else (text, "$")
    missing = _MISSING.search(msg)
    if missing:
        return f"{path}.{missing.group('field')}", "a required field", "missing"
    if msg.startswith("Expected "):
        expected, _, got = msg[len("Expected "):].partition(", got ")
        return path, expected.replace("`", ""), got.replace("`", "")
    return path, msg, ""


def any_value(v: AnyValue | None, depth: int = 0) -> Any:
    """An ``AnyValue`` as a Python value (arrays as lists, kvlists as dicts, bytes as base64 str);
    :class:`ValueNestingError` when arrays/kvlists nest deeper than :data:`MAX_VALUE_DEPTH`."""
    if v is None:
        return None
    if v.string_value is not None:
        return v.string_value
    if v.int_value is not None:
        return v.int_value
    if v.double_value is not None:
        return v.double_value
    if v.bool_value is not None:
        return v.bool_value
    if v.array_value is not None or v.kvlist_value is not None:
        if depth >= MAX_VALUE_DEPTH:
            raise ValueNestingError(f"arrays/kvlists nested at most {MAX_VALUE_DEPTH} levels")
        if v.array_value is not None:
            return [any_value(e, depth + 1) for e in v.array_value.values]
        return {kv.key: any_value(kv.value, depth + 1) for kv in v.kvlist_value.values}
    return v.bytes_value


STATUS_NAMES = ("UNSET", "OK", "ERROR")
_STATUS_BY_NAME = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2,
                   "UNSET": 0, "OK": 1, "ERROR": 2}


def status_code(code: int | str) -> int | None:
    """OTLP status code (number or ``STATUS_CODE_*`` name) as 0/1/2, or None when unknown."""
    if isinstance(code, int):
        return code if 0 <= code <= 2 else None
    return _STATUS_BY_NAME.get(code.upper())
