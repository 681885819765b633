"""What the router accepts from a client: :func:`parse_request` checks one completion request's
body and headers and returns a :class:`ParsedRequest`, or raises :class:`RequestRejected` with
the HTTP status and a message naming the field and what was expected.

Checks (each one a defect found by hostile input, see ``docs/bad-input.md``): the body is a JSON
object (not deeper than :data:`MAX_JSON_DEPTH`); ``stream`` is a boolean; the conversation id (body
``conversation_id`` or the ``X-Kvtune-Conversation-Id`` header) passes
:func:`~kvtune.router.state.check_conversation_id`; header values the router reads or forwards
are text (a non-UTF-8 header value arrives with lone surrogates, which no store or exporter can
encode); the client's ``X-Request-Id`` is at most :data:`MAX_CLIENT_REQUEST_ID_CHARS`.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtune import spans
from kvtune.errors import RouterError
from kvtune.router.state import InvalidConversationId, check_conversation_id

CONVERSATION_FIELD = "conversation_id"
REQUEST_ID_HEADER = "X-Request-Id"
MAX_JSON_DEPTH = 64
"""Deepest JSON nesting accepted in a request body. OpenAI-style bodies nest a few levels (tool
JSON schemas rarely 20); far below the depth at which Python's JSON encoder and decoder recurse
out of stack, so a body accepted here can always be forwarded."""
MAX_CLIENT_REQUEST_ID_CHARS = 256
"""Longest client ``X-Request-Id`` accepted (it is echoed back and recorded as an attribute)."""


class RequestRejected(RouterError):
    """A client request the router refuses: ``status`` (400), ``kind`` (the OpenAI-style error
    type) and a message naming the field and what was expected."""

    def __init__(self, message: str, *, status: int = 400, kind: str = "invalid_request_error") -> None:
        self.status, self.kind = status, kind
        super().__init__(message)


@dataclass(frozen=True)
class ParsedRequest:
    """A completion request the router accepted."""

    body: dict[str, Any]
    """The JSON body without ``conversation_id`` (which vLLM does not know)."""
    stream: bool
    conversation_id: str | None
    client_request_id: str | None
    """The client's ``X-Request-Id``, for echo and attributes only (never sent upstream)."""


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists/dicts more than ``limit`` levels (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def text_problem(value: str) -> str | None:
    """Why ``value`` is not plain text that can be encoded as UTF-8 (None when it is)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start]
        if "\udc80" <= bad <= "\udcff":
            return f"holds the byte 0x{ord(bad) - 0xdc00:02x}, which is not valid UTF-8"
        return f"holds a lone surrogate {bad!r} at character {exc.start}, which is not valid UTF-8"
    return None


def parse_request(raw: bytes, headers: Mapping[str, str], *,
                  forwarded_headers: Iterable[str] = ()) -> ParsedRequest:
    """Check a completion request (body bytes and headers); see the module docstring."""
    for name in (REQUEST_ID_HEADER, spans.CONVERSATION_HEADER, *forwarded_headers):
        value = headers.get(name)
        if value is not None:
            problem = text_problem(value)
            if problem is not None:
                raise RequestRejected(f"header {name!r}: expected UTF-8 text; the value {problem}")
    client_id = headers.get(REQUEST_ID_HEADER) or None
    if client_id is not None and len(client_id) > MAX_CLIENT_REQUEST_ID_CHARS:
        raise RequestRejected(f"header {REQUEST_ID_HEADER!r}: expected at most "
                              f"{MAX_CLIENT_REQUEST_ID_CHARS} characters, got {len(client_id)}")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestRejected(f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels "
                              "(expected an OpenAI completion request)") from None
    except ValueError as exc:  # includes UnicodeDecodeError: not UTF-8
        raise RequestRejected(f"request body is not JSON: {exc}"[:500]) from None
    if not isinstance(body, dict):
        raise RequestRejected(f"request body: expected a JSON object, got {type(body).__name__}")
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise RequestRejected(f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels "
                              "(expected an OpenAI completion request)")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestRejected(f"field 'stream': expected true or false, got {stream!r:.80}")
    conv: Any = body.pop(CONVERSATION_FIELD, None)
    where = f"field {CONVERSATION_FIELD!r}"
    if conv is None:
        conv = headers.get(spans.CONVERSATION_HEADER)
        where = f"header {spans.CONVERSATION_HEADER!r}"
    if conv is not None:
        if isinstance(conv, int) and not isinstance(conv, bool):
            conv = str(conv)
        try:
            conv = check_conversation_id(conv)
        except InvalidConversationId as exc:
            raise RequestRejected(f"{where}: {str(exc).split(': ', 1)[1]}") from None
    return ParsedRequest(body=body, stream=bool(stream), conversation_id=conv,
                         client_request_id=client_id)
