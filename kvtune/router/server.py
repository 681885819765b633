"""The router's HTTP server: an OpenAI-compatible proxy in front of vLLM prefill and decode instances.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming SSE and not),
``GET /v1/models`` (from the first decode instance that answers), ``GET /health``.

Flows (the vLLM NIXL connectors' protocol; every leg of one request carries the same
``X-Request-Id``, a unique id the router makes per request (a client's own ``X-Request-Id`` is only
echoed back and recorded as ``kv.client_request_id``: clients cannot make two requests collide
upstream), the W3C ``traceparent`` header, and the same traceparent inside
``kv_transfer_params[spans.KV_PARAMS_TRACEPARENT]``, with the conversation id and turn under
``spans.KV_PARAMS_CONVERSATION_ID`` / ``spans.KV_PARAMS_TURN`` when the request names a conversation):

- **pull**: prefill (least loaded) with ``max_tokens: 1``, ``stream: false`` and
  ``kv_transfer_params: {do_remote_decode: true}``; then the decode, chosen only now by load,
  gets the client's request with the ``kv_transfer_params`` the prefill returned.
- **push**: prefill and decode chosen up front and both legs started together; the decode gets
  ``do_remote_prefill: true`` with the prefill named up front (from its config: engine id, NIXL
  side channel, TP/PP sizes) and the shared request id.
- **bidirectional**: pull, plus the ``kv_transfer_params`` the decode returns at the end of each turn
  are stored per conversation and sent as the next turn's prefill ``kv_transfer_params`` (the prefill
  then pulls the conversation's history back from the decode), only to a turn whose prompt begins
  with the history they encode (:mod:`kvtune.router.binding`; a refused turn leaves them stored
  and stores none of its own). Params are handed out once (even
  when that turn then fails: its prefill may have read the blocks) and expire
  ``decoder_ttl_s - margin_s`` after they were stored. A streamed turn's params come from the SSE
  event that carries ``kv_transfer_params`` (vLLM 0.33 puts them in the stream's last chunk; the
  bytes reach the client unchanged); vLLM 0.32 sends none in a stream, so the next turn recomputes
  the history: the router says so once per conversation (span event
  ``kv.router.stream_params_absent``) and counts such turns in ``/health``.
  A failing conversation store never fails the request: the turn is served without history and a
  ``kv.router.state_error`` span event says why.

The parameters of each leg are built by :mod:`kvtune.vllm_pd` (the protocol's one home). JSON
legs go over :mod:`kvtune.router.upstream` (kept-alive HTTP/1.1, little CPU per leg); streamed
decodes and ``/v1/models`` over aiohttp's client. The conversation store's calls run on the event
loop for SQLite and on one worker thread otherwise (:mod:`kvtune.router.state`); a turn's params are
stored before its reply is sent, so a router killed after the reply still has them.

The conversation id comes from the body field ``conversation_id`` (removed before forwarding) or
the header ``spans.CONVERSATION_HEADER``. Bad input (not JSON, too deep, a conversation id that is
too long or not text, a header value that is not UTF-8) gets a 400 JSON error naming the field:
:mod:`kvtune.router.parsing`. Connections: at most ``max_connections`` at once (more get 503), at
most ``max_connections_per_client`` of them from one client address (more get 429), and a client
must send a request's headers within ``header_timeout_s``.

Failures: an upstream that cannot be reached, times out or answers 5xx gives the client a 502 JSON
error naming the leg and instance (headers ``X-Kvtune-Failed-Leg`` / ``X-Kvtune-Failed-Instance``);
an upstream 4xx is passed through with the same headers. A body over ``max_body_bytes`` gets 413.
A streamed decode that falls silent for ``stream_idle_timeout_s``, breaks, or is not complete
within ``stream_deadline_s`` (a trickling upstream) ends with an SSE ``error`` event, its upstream
connection closed (``error.type`` :data:`STREAM_DEADLINE_ERROR` for the deadline, counted in
``/health`` ``stream_deadlines_total``).

Tracing: one ``kv.request`` span per proxied request, always a trace root (a client's own
``traceparent`` becomes a span link), with the mode, request id (= base request id: both legs get it
as ``X-Request-Id``), the client's request id, conversation id, turn, chosen prefill and decode
instances, prompt and output tokens, TTFT, stream flag, HTTP status, the history tokens offered to
the prefill
(``kv.reuse.remote_tokens``, bidirectional) and ``error.type`` with ERROR status on failure.
Responses carry ``X-Request-Id`` (the client's, else the router's id) and ``X-Kvtune-Request-Id``
(the router's id, as in the legs and ``kv.base_request_id``).
TTFT (``kv.ttft_ms``): request in -> first token available to the router, i.e. the first SSE event
carrying text when streaming, and the prefill's answer (its one token) otherwise.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import aiohttp
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Link, Status, StatusCode

from kvtune import spans, vllm_pd
from kvtune.redact import redact_text, redact_url
from kvtune.errors import RouterError
from kvtune.router import binding
from kvtune.router.config import InstanceConfig, RouterConfig
from kvtune.router.lease import END_PATH, DecodeLeases, conversation_ends
from kvtune.router.pool import InstancePool
from kvtune.router.parsing import (MAX_CLIENT_REQUEST_ID_CHARS, REQUEST_ID_HEADER, RequestRejected,
                                   parse_request, text_problem)
from kvtune.router.state import (SQLITE_ON_LOOP_BUSY_TIMEOUT_S, ConversationStore,
                                 SqliteConversationStore, TurnStart, open_store)
from kvtune.router.upstream import AnswerTooLarge, UpstreamClient, UpstreamProtocolError
from kvtune.router.tracing import (TRACEPARENT_HEADER, TRACER_NAME, begin_phases,
                                   client_span_context, client_trace_config, end_phases,
                                   leg_ended, leg_started, set_attributes, start_request_span,
                                   traceparent_of)

_logger = logging.getLogger(__name__)
_T = TypeVar("_T")

FAILED_LEG_HEADER = "X-Kvtune-Failed-Leg"
"""Response header naming the leg (``prefill`` or ``decode``) that failed."""
FAILED_INSTANCE_HEADER = "X-Kvtune-Failed-Instance"
"""Response header naming the instance (URL) that failed."""
UPSTREAM_REQUEST_ID_HEADER = "X-Kvtune-Request-Id"
"""Response header with the router's own id of the request (the legs' ``X-Request-Id``)."""
BODY_READ_TIMEOUT_S = 60.0
"""A client must send its whole request body within this time (no slow-client stuck handlers)."""
CLIENT_CLOSED_STATUS = 499
"""Recorded on ``kv.request`` (never sent) when the client disconnects before the answer."""
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
SSE_MAX_LINE_BYTES = 16 * 1024 * 1024
"""An SSE line longer than this is relayed but not parsed (bounds the router's buffer)."""
STREAM_NOTES_MAX_CONVERSATIONS = 100_000
"""Conversations remembered as already told about a stream without params (oldest forgotten)."""
STREAM_PARAMS_ABSENT_NOTE = (
    "the decode sent no kv_transfer_params in a streamed answer (vLLM before 0.33 sends them only "
    "in non-streamed answers): streamed bidirectional turns recompute the conversation's history")
MAX_UPSTREAM_BODY_BYTES = 64 * 1024 * 1024
"""Largest (decompressed) JSON answer read from an upstream: a prefill answers in KiB, a
completion in MiB at most; a gzip bomb (1 MB inflating to 1 GiB) is cut off here (issue 29)."""
MAX_UPSTREAM_ERROR_BYTES = 1024 * 1024
"""Bytes of an upstream's error answer kept (passed through to the client, quoted in logs)."""
STREAM_DEADLINE_ERROR = "StreamDeadlineExceeded"
"""``error.type`` of a streamed request cut off at the router's ``stream_deadline_s``."""
_FORWARDED_HEADERS = ("Authorization",)
_ERROR_BODY_LIMIT = 2000


class UpstreamError(RouterError):
    """One leg failed: which leg, which instance, why; ``status`` is the upstream's HTTP status
    (None when it never answered)."""

    def __init__(self, leg: str, instance: str, reason: str, *, status: int | None = None,
                 body: bytes = b"", content_type: str | None = None) -> None:
        # The one redaction rule: the instance's password never reaches a header, body or log.
        instance, reason = redact_url(instance), redact_text(reason)
        self.leg, self.instance, self.reason = leg, instance, reason
        self.status, self.body, self.content_type = status, body, content_type
        super().__init__(f"{leg} leg failed at {instance}: {reason}")

    @property
    def client_status(self) -> int:
        """The status the client gets: the upstream's 4xx as is, otherwise 502."""
        return self.status if self.status is not None and 400 <= self.status < 500 else 502


@dataclass(frozen=True)
class LegRecord:
    """One leg of a proxied request, as a :class:`Router`'s ``on_leg`` observer is told it (once the
    leg's answer is complete, or it failed)."""

    request_id: str
    """The legs' ``X-Request-Id`` (the router's id of the request)."""
    leg: str
    """``prefill`` or ``decode``."""
    instance: str
    """The instance's URL."""
    elapsed_ms: float
    """Leg sent -> complete answer (a streamed decode: -> its ``data: [DONE]``, else the end of
    its stream)."""
    sent_kv_transfer_params: dict[str, Any] | None
    """The ``kv_transfer_params`` the leg was sent."""
    answer: dict[str, Any] | None
    """The leg's JSON answer (None for a streamed decode, or when it failed)."""
    kv_transfer_params: dict[str, Any] | None
    """The ``kv_transfer_params`` the leg answered with (a streamed decode: from its SSE)."""
    error: str | None = None
    """Why the leg failed, or None."""


@dataclass
class _Call:
    """What one proxied request found out (becomes the ``kv.request`` attributes)."""

    request_id: str
    """The router's own id: the legs' ``X-Request-Id`` and the span's base request id."""
    endpoint: str
    stream: bool
    conversation_id: str | None
    client_request_id: str | None = None
    store_key: str | None = None
    """The conversation store's key (the conversation id, scoped by the tenant key if any)."""
    t0: float = field(default_factory=time.perf_counter)
    turn: int | None = None
    prefill_url: str | None = None
    decode_url: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft_ms: float | None = None
    http_status: int = 200
    remote_tokens: int | None = None
    error_type: str | None = None
    error_message: str | None = None
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """Span events to add to ``kv.request`` (name, attributes)."""
    stream_sent: tuple[float, dict[str, Any] | None] | None = None
    """When the streamed decode leg was sent, and its ``kv_transfer_params``."""
    ends: bool = False
    """The client said this turn is the conversation's last (:mod:`kvtune.router.lease`)."""
    traceparent: str | None = None
    """``kv.request``'s W3C traceparent (None when tracing is off), sent with every leg."""
    keeps_stored: bool = False
    """The stored params were refused to this turn and left stored for the history they encode:
    this turn must not replace them with its own."""

    def first_token(self) -> None:
        if self.ttft_ms is None:
            self.ttft_ms = (time.perf_counter() - self.t0) * 1000.0

    def response_headers(self) -> dict[str, str]:
        """The request-id headers of every answer: the client's id echoed (else ours), and ours."""
        return {REQUEST_ID_HEADER: self.client_request_id or self.request_id,
                UPSTREAM_REQUEST_ID_HEADER: self.request_id}


def _error_json(status: int, message: str, *, kind: str, leg: str | None = None,
                instance: str | None = None, headers: Mapping[str, str] | None = None) -> web.Response:
    err: dict[str, Any] = {"message": message, "type": kind, "code": status}
    if leg is not None:
        err["leg"] = leg
    if instance is not None:
        err["instance"] = instance
    return web.json_response({"error": err}, status=status, headers=dict(headers or {}))


def _upstream_error_response(exc: UpstreamError, call: _Call) -> web.Response:
    headers = {FAILED_LEG_HEADER: exc.leg, FAILED_INSTANCE_HEADER: exc.instance,
               **call.response_headers()}
    status = exc.client_status
    if status != 502 and exc.body:
        return web.Response(status=status, body=exc.body, headers=headers,
                            content_type=(exc.content_type or "application/json").split(";")[0])
    return _error_json(status, str(exc), kind="upstream_error", leg=exc.leg, instance=exc.instance,
                       headers=headers)


async def _send_now(request: web.Request, response: web.StreamResponse) -> None:
    """Send ``response`` (status, headers, body) now, from the handler; aiohttp's own send once
    the handler returns then finds it sent. A client gone meanwhile is left for that send to
    find (aiohttp counts it as a premature disconnect, as for any response)."""
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionError:
        pass


class _SseWatcher:
    """Reads the SSE bytes a decode streams (without changing them): first token, counts, usage,
    and ``kv_transfer_params`` should an event carry them (the last such event wins; vLLM 0.33
    sends them in the stream's last chunk). Lines over :data:`SSE_MAX_LINE_BYTES` are skipped."""

    def __init__(self, *, collect_reply: bool = False) -> None:
        self._buf = bytearray()
        self._skipping = False
        self.content_events = 0
        self.usage_completion_tokens: int | None = None
        self.kv_transfer_params: dict[str, Any] | None = None
        self.error: Any = None
        self.reply = binding.Reply() if collect_reply else None
        """The answer's text and token ids, to bind the turn's KV to its history (None: not
        collected, the turn stores nothing)."""
        self.done = False
        """Whether the ``data: [DONE]`` line has been seen."""

    def feed(self, chunk: bytes) -> bool:
        """Take bytes; True when they held the stream's first event with generated text."""
        if self._skipping:  # inside an over-long line: drop bytes up to its end
            nl = chunk.find(b"\n")
            if nl < 0:
                return False
            chunk, self._skipping = chunk[nl + 1:], False
        first = False
        self._buf += chunk
        start = 0
        while True:
            nl = self._buf.find(b"\n", start)
            if nl < 0:
                break
            first = self._line(bytes(self._buf[start:nl])) or first
            start = nl + 1
        del self._buf[:start]
        if len(self._buf) > SSE_MAX_LINE_BYTES:
            self._buf.clear()
            self._skipping = True
        return first

    def _line(self, line: bytes) -> bool:
        line = line.strip()
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return False
        if not data:
            return False
        try:
            event = json.loads(data)
        except (ValueError, RecursionError):
            return False
        if not isinstance(event, dict):
            return False
        if "error" in event:
            self.error = event["error"]
        if self.reply is not None:
            self.reply.feed_event(event)
        if isinstance(event.get(vllm_pd.KV_TRANSFER_PARAMS), dict):
            self.kv_transfer_params = event[vllm_pd.KV_TRANSFER_PARAMS]
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_completion_tokens = usage["completion_tokens"]
        if _has_text(event):
            self.content_events += 1
            return self.content_events == 1
        return False

    @property
    def output_tokens(self) -> int:
        """Usage's completion tokens when reported, else the number of events with text."""
        return (self.usage_completion_tokens if self.usage_completion_tokens is not None
                else self.content_events)


def _has_text(event: Mapping[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")):
            return True
    return False


def _usage(body: Mapping[str, Any], key: str) -> int | None:
    usage = body.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get(key), int):
        return usage[key]
    return None


def _refusal(status: str, message: str, kind: str) -> bytes:
    """A whole HTTP answer refusing a connection: a JSON error body, ``Connection: close``."""
    body = json.dumps({"error": {"message": message, "type": kind,
                                 "code": int(status.split()[0])}}).encode()
    return (b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%s" % (status.encode(), len(body), body))


class _Busy(asyncio.Protocol):
    """A refused connection: answered at once (by default 503, the router has
    ``max_connections`` open) and closed."""

    BODY = _refusal("503 Service Unavailable", "the router has max_connections client "
                    "connections open; try again", "server_busy")

    LINGER_S = 1.0
    """How long the refused connection stays open to read (and drop) the client's request, so
    that closing it does not reset the connection before the client reads the answer."""

    def __init__(self, answer: bytes | None = None) -> None:
        self._answer = self.BODY if answer is None else answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        transport.write(self._answer)
        asyncio.get_running_loop().call_later(self.LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read: it is refused

    def eof_received(self) -> bool:
        return False  # close now


class _HeaderDeadline(asyncio.Protocol):
    """One client connection: refused with 429 when its client address already holds its share
    (:class:`_ConnectionGuard`), else aiohttp's handler plus a deadline for the first request's
    headers (a client trickling header bytes would hold the connection forever; later requests on
    a keep-alive connection are bounded by aiohttp's ``keepalive_timeout``, set to the same
    value)."""

    def __init__(self, guard: _ConnectionGuard) -> None:
        self._guard = guard
        self._inner = asyncio.Protocol()  # replaced in connection_made
        self._client: str | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._transport = transport
        client = self._guard.admit(transport.get_extra_info("peername"))
        if client is None:
            self._inner = _Busy(self._guard.client_refusal)
            self._inner.connection_made(transport)
            return
        self._client = client
        self._inner = self._guard.handler()
        self._timer = asyncio.get_running_loop().call_later(self._guard.header_timeout_s,
                                                            self._expire)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            # Headers end at the first blank line; look at the bytes so far (with the last few of
            # the previous chunk, for a CRLFCRLF split across chunks).
            window = self._tail + data
            if b"\r\n\r\n" in window or b"\n\n" in window:
                self._timer.cancel()
                self._timer = None
            else:
                self._tail = window[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._guard.closed(self._client)
        self._inner.connection_lost(exc)

    def _expire(self) -> None:
        self._timer = None
        self._guard.timed_out += 1
        if self._transport is not None:
            self._transport.abort()


class _ConnectionGuard:
    """The listening socket's protocol factory: at most ``max_connections`` open connections
    (more are answered 503 and closed), at most ``per_client`` of them from one client address
    (more are answered 429 and closed: one client cannot fill the router), each with a header
    deadline (:class:`_HeaderDeadline`)."""

    def __init__(self, server: Any, max_connections: int, per_client: int,
                 header_timeout_s: float) -> None:
        self.handler = server  # aiohttp's web.Server: a protocol factory
        self.max_connections, self.per_client = max_connections, per_client
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.refused = 0
        self.refused_per_client = 0
        self.timed_out = 0
        self._by_client: dict[str, int] = {}
        self.client_refusal = _refusal(
            "429 Too Many Requests", f"this client address has max_connections_per_client "
            f"({per_client}) connections open to the router; close one or try again",
            "too_many_connections")

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.max_connections:
            self.refused += 1
            return _Busy()
        self.open += 1
        return _HeaderDeadline(self)

    def admit(self, peername: Any) -> str | None:
        """The client's address when it may open one more connection (counted), else None."""
        client = str(peername[0]) if isinstance(peername, tuple) and peername else "local"
        held = self._by_client.get(client, 0)
        if held >= self.per_client:
            self.refused_per_client += 1
            return None
        self._by_client[client] = held + 1
        return client

    def closed(self, client: str | None) -> None:
        """A connection made through :meth:`__call__` ended (``client``: as admitted, or None)."""
        self.open -= 1
        if client is not None:
            left = self._by_client.pop(client) - 1
            if left:
                self._by_client[client] = left


class Router:
    """The proxy: build it from a :class:`RouterConfig`, then :meth:`start` / :meth:`stop` it on a
    running event loop (or use :func:`serve`). ``tracer`` defaults to the global tracer provider's.

    For a program that embeds the router and is its only client (:class:`kvtune.local.pair.
    LocalPair`): ``on_leg`` is called with a :class:`LegRecord` as each leg ends (on the router's
    event loop; it must not block, and its exceptions are logged, not raised), and
    ``trusted_client=True`` makes the client's own ``X-Request-Id`` the legs' request id (the
    client must make it unique) and, when the router has no trace context of its own (tracing
    off), passes the client's ``traceparent`` to the legs as it is."""

    def __init__(self, config: RouterConfig, *, store: ConversationStore | None = None,
                 tracer: trace.Tracer | None = None,
                 on_leg: Callable[[LegRecord], None] | None = None,
                 trusted_client: bool = False) -> None:
        self.config = config
        self.on_leg = on_leg
        self.trusted_client = trusted_client
        self.store = store if store is not None else open_store(
            config.state, params_ttl_s=config.params_ttl_s, retention_s=config.state_retention_s,
            sqlite_busy_timeout_s=SQLITE_ON_LOOP_BUSY_TIMEOUT_S)
        self._store_on_loop = isinstance(self.store, SqliteConversationStore)
        """SQLite's calls run on the event loop; another store's on :attr:`_state_thread`."""
        self._state_thread: ThreadPoolExecutor | None = None
        self.tracer = tracer if tracer is not None else trace.get_tracer(TRACER_NAME)
        self.prefill = InstancePool("prefill", config.prefill)
        self.decode = InstancePool("decode", config.decode)
        self._session: aiohttp.ClientSession | None = None
        self._upstream: UpstreamClient | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._connections: _ConnectionGuard | None = None
        self.port: int | None = None
        self._stream_turns = {"with_params": 0, "without_params": 0}
        self._told_no_stream_params: OrderedDict[str, None] = OrderedDict()
        self._state_errors = 0
        self._stream_deadlines = 0
        self._reuse_refused = {r.value: 0 for r in spans.ReuseRefusal}
        self.leases = DecodeLeases(self)

    # --- lifecycle --------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post(COMPLETIONS_PATH, self._completions)
        app.router.add_post(CHAT_PATH, self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post(END_PATH, self.leases.end_handler)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30.0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            trace_configs=[client_trace_config()])
        self._upstream = UpstreamClient(connect_timeout_s=self.config.connect_timeout_s)

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.leases.stop()
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def start(self, host: str | None = None, port: int | None = None) -> str:
        """Bind and serve; returns the base URL (``port`` 0 picks a free port)."""
        # handler_cancellation: a client that disconnects cancels its request here and upstream.
        # keepalive_timeout: an idle keep-alive connection (no next request's headers) is closed.
        self._runner = web.AppRunner(self.make_app(), access_log=None, handle_signals=False,
                                     handler_cancellation=True, shutdown_timeout=5.0,
                                     keepalive_timeout=self.config.header_timeout_s)
        await self._runner.setup()
        assert self._runner.server is not None
        self._connections = _ConnectionGuard(self._runner.server, self.config.max_connections,
                                             self.config.connections_per_client,
                                             self.config.header_timeout_s)
        self._listener = await asyncio.get_running_loop().create_server(
            self._connections, host or self.config.host,
            self.config.port if port is None else port, reuse_address=True)
        self.port = int(self._listener.sockets[0].getsockname()[1])
        return f"http://{host or self.config.host}:{self.port}"

    async def stop(self) -> None:
        """Stop serving and close the store."""
        if self._listener is not None:
            self._listener.close()  # no new connections; the open ones are shut down below
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._listener is not None:
            self._listener = None
        if self._state_thread is not None:
            self._state_thread.shutdown(wait=True)
            self._state_thread = None
        try:
            self.store.close()
        except Exception:
            _logger.warning("closing the conversation store failed", exc_info=True)

    # --- small endpoints --------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        streams: dict[str, Any] = {
            "turns_with_kv_transfer_params": self._stream_turns["with_params"],
            "turns_without_kv_transfer_params": self._stream_turns["without_params"]}
        if self._stream_turns["without_params"]:
            streams["note"] = STREAM_PARAMS_ABSENT_NOTE
        return web.json_response({
            "status": "ok", "mode": self.config.mode.value,
            "prefill": [vars(s) for s in self.prefill.snapshot()],
            "decode": [vars(s) for s in self.decode.snapshot()],
            "streamed_bidirectional": streams,
            "state_errors_total": self._state_errors,
            "stream_deadlines_total": self._stream_deadlines,
            "reuse_refused_total": dict(self._reuse_refused),
            "decode_lease": self.leases.health(),
            "connections": {"open": self._connections.open if self._connections else 0,
                            "refused_total": self._connections.refused if self._connections else 0,
                            "refused_per_client_total": (self._connections.refused_per_client
                                                         if self._connections else 0),
                            "header_timeouts_total": (self._connections.timed_out
                                                      if self._connections else 0)}})

    async def _models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        errors = []
        for inst in self.config.decode:
            try:
                async with self._session.get(
                        inst.url + "/v1/models", headers=self._forward_headers(request),
                        timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout_s * 3,
                                                      sock_connect=self.config.connect_timeout_s)
                ) as resp:
                    body = await resp.read()
                    if resp.status == 200:
                        return web.Response(body=body, content_type="application/json")
                    errors.append(f"{redact_url(inst.url)}: HTTP {resp.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                errors.append(redact_text(f"{redact_url(inst.url)}: {type(exc).__name__} {exc}"))
        first = redact_url(self.config.decode[0].url)
        return _error_json(502, "no decode instance answered /v1/models: " + "; ".join(errors),
                           kind="upstream_error", leg="decode", instance=first,
                           headers={FAILED_LEG_HEADER: "decode", FAILED_INSTANCE_HEADER: first})

    @staticmethod
    def _forward_headers(request: web.Request) -> dict[str, str]:
        return {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}

    # --- completions ------------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, COMPLETIONS_PATH)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, CHAT_PATH)

    async def _handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        # The upstream legs' request id is always ours: a client's X-Request-Id (possibly shared
        # by many requests) would make vLLM's P/D correlation collide.
        request_id = f"kvtune-{uuid.uuid4().hex}"
        ids = {REQUEST_ID_HEADER: request_id, UPSTREAM_REQUEST_ID_HEADER: request_id}
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return _error_json(413, f"request body of {request.content_length} bytes is over the "
                               f"router's max_body_bytes ({limit})", kind="request_too_large",
                               headers=ids)
        try:
            if request.content.is_eof():  # the whole body is here (most requests): no
                raw = await request.read()  # wait, so no task and timer to bound it
            else:
                raw = await asyncio.wait_for(request.read(), BODY_READ_TIMEOUT_S)
        except web.HTTPRequestEntityTooLarge:
            return _error_json(413, f"request body is over the router's max_body_bytes ({limit})",
                               kind="request_too_large", headers=ids)
        except asyncio.TimeoutError:
            return _error_json(408, f"request body not received within {BODY_READ_TIMEOUT_S:g} s",
                               kind="request_timeout", headers=ids)
        try:
            parsed = parse_request(raw, request.headers, forwarded_headers=_FORWARDED_HEADERS)
        except RequestRejected as exc:
            client_id = request.headers.get(REQUEST_ID_HEADER)
            if client_id and len(client_id) <= MAX_CLIENT_REQUEST_ID_CHARS \
                    and text_problem(client_id) is None:
                ids[REQUEST_ID_HEADER] = client_id  # echo it when it is itself valid
            return _error_json(exc.status, str(exc), kind=exc.kind, headers=ids)
        body = parsed.body
        if self.trusted_client and parsed.client_request_id:
            request_id = parsed.client_request_id
        call = _Call(request_id=request_id, endpoint=endpoint, stream=parsed.stream,
                     conversation_id=parsed.conversation_id,
                     client_request_id=parsed.client_request_id,
                     ends=conversation_ends(request.headers))
        if call.conversation_id is not None:
            tenant_header = self.config.tenant_header
            tenant = request.headers.get(tenant_header) if tenant_header else None
            if tenant_header and not tenant:
                return _error_json(400, f"header {tenant_header!r}: expected the tenant key (the "
                                   "router's tenant_header) on a request that names a "
                                   "conversation", kind="invalid_request", headers=ids)
            call.store_key = binding.store_key(call.conversation_id, tenant)
        links = []
        client_ctx = client_span_context(request.headers)
        if client_ctx is not None:
            links.append(Link(client_ctx))
        span = start_request_span(self.tracer, links)
        try:
            begin_phases(span)
            call.traceparent = traceparent_of(span)
            try:
                response = await self._route(request, body, call)
            except asyncio.CancelledError:
                # The client went away (handler cancellation): the legs' connections are closed,
                # which aborts the requests in vLLM.
                call.http_status = CLIENT_CLOSED_STATUS
                call.error_type, call.error_message = "ClientDisconnected", "client went away"
                raise
            except UpstreamError as exc:
                call.http_status = exc.client_status
                call.error_type = type(exc).__name__
                call.error_message = str(exc)
                _logger.warning("request %s: %s", request_id, exc)
                response = _upstream_error_response(exc, call)
            except Exception as exc:
                call.http_status = 500
                call.error_type = type(exc).__name__
                detail = redact_text(str(exc))
                call.error_message = f"router error: {detail}"
                _logger.error("request %s failed in the router: %s: %s", request_id,
                              type(exc).__name__, detail)
                response = _error_json(500, f"router error: {type(exc).__name__}: {detail}",
                                       kind="router_error", headers=call.response_headers())
            # The reply goes out before the telemetry below (kv.request's last attributes and
            # its phase spans, ~0.1 ms of CPU): the client does not wait for it.
            await _send_now(request, response)
        finally:
            self._finish_span(span, call)
            end_phases(self.tracer, span)
            span.end()
        return response

    def _finish_span(self, span: trace.Span, call: _Call) -> None:
        """``kv.request``'s attributes, events and status (once the reply is sent)."""
        set_attributes(span, {
            spans.MODE: self.config.mode.value, spans.BASE_REQUEST_ID: call.request_id,
            spans.REQUEST_ID: call.request_id, spans.CLIENT_REQUEST_ID: call.client_request_id,
            spans.ROLE: spans.Role.ROUTER.value, spans.STREAM: call.stream,
            spans.CONVERSATION_ID: call.conversation_id, spans.TURN: call.turn,
            spans.PREFILL_INSTANCE: call.prefill_url and redact_url(call.prefill_url),
            spans.DECODE_INSTANCE: call.decode_url and redact_url(call.decode_url),
            spans.PROMPT_TOKENS: call.prompt_tokens, spans.OUTPUT_TOKENS: call.output_tokens,
            spans.TTFT_MS: call.ttft_ms, spans.HTTP_STATUS: call.http_status,
            spans.REUSE_REMOTE_TOKENS: call.remote_tokens, spans.ERROR_TYPE: call.error_type,
            spans.CONVERSATION_END: True if call.ends else None})
        try:
            if span.is_recording():
                for name, attributes in call.events:
                    span.add_event(name, attributes)
            if call.error_type is not None:
                span.set_status(Status(StatusCode.ERROR, call.error_message))
        except Exception:
            _logger.warning("setting span status or events failed", exc_info=True)

    def _state_failed(self, call: _Call, operation: str, exc: Exception) -> None:
        """The conversation store failed: serve on without history, and say so."""
        self._state_errors += 1
        message = redact_text(str(exc))
        _logger.warning("request %s: conversation store %s failed (served without the "
                        "conversation's history): %s", call.request_id, operation, message)
        call.events.append((spans.EventName.STATE_ERROR.value, {
            spans.ERROR_TYPE: type(exc).__name__,
            spans.EXCEPTION_MESSAGE: f"{operation}: {message}"[:1000]}))

    async def _state_call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run one store call: on the event loop (SQLite) or on the store's one worker thread
        (calls run in the order issued)."""
        if self._store_on_loop:
            return fn(*args)
        if self._state_thread is None:
            self._state_thread = ThreadPoolExecutor(1, thread_name_prefix="kvtune-router-state")
        return await asyncio.get_running_loop().run_in_executor(self._state_thread, fn, *args)

    async def _route(self, request: web.Request, body: dict[str, Any],
                     call: _Call) -> web.StreamResponse:
        start: TurnStart | None = None
        bidirectional = self.config.mode == spans.Mode.BIDIRECTIONAL
        claim = binding.Claim(body, call.endpoint == CHAT_PATH) if bidirectional else None
        if call.conversation_id is not None:
            try:
                start = await self._state_call(self.store.begin_turn, call.store_key, claim)
            except Exception as exc:  # a store failure never fails the request
                self._state_failed(call, "begin_turn", exc)
            else:
                call.turn = start.turn
        traceparent = call.traceparent
        if traceparent is None and self.trusted_client \
                and client_span_context(request.headers) is not None:
            traceparent = request.headers[TRACEPARENT_HEADER]
        headers = {REQUEST_ID_HEADER: call.request_id, **self._forward_headers(request)}
        if traceparent:
            headers[TRACEPARENT_HEADER] = traceparent
        if self.config.mode == spans.Mode.PUSH:
            return await self._push(request, body, call, headers, traceparent)
        reuse = None
        if start is not None and claim is not None and claim.offer is not None:
            offer = claim.offer
            if offer.refusal is not None:
                call.keeps_stored = start.kept
                self._refuse_reuse(call, offer.refusal, offer.detail + (
                    "; left stored for that history" if start.kept else ""), claim.tokens)
            elif start.kv_transfer_params is not None:  # else another turn claimed them first
                reuse = await self.leases.claim(call.store_key, offer.params,
                                                start.decode_instance)
        return await self._pull(request, body, call, headers, traceparent, reuse)

    # --- legs -------------------------------------------------------------------------------------
    def _prefill_body(self, body: Mapping[str, Any], kv_params: dict[str, Any],
                      endpoint: str) -> dict[str, Any]:
        out = dict(body)
        out["max_tokens"] = 1
        if endpoint == CHAT_PATH:
            out["max_completion_tokens"] = 1
        out["stream"] = False
        for key in ("stream_options", "min_tokens"):
            out.pop(key, None)
        out[vllm_pd.KV_TRANSFER_PARAMS] = kv_params
        return out

    @staticmethod
    def _with_traceparent(params: Mapping[str, Any], traceparent: str | None,
                          call: _Call) -> dict[str, Any]:
        """``params`` plus the request's traceparent, conversation id and turn (for the
        connectors' spans); values echoed back from an earlier turn are replaced."""
        return vllm_pd.with_context(params, traceparent=traceparent,
                                    conversation_id=call.conversation_id, turn=call.turn)

    async def _post_json(self, leg: str, inst: InstanceConfig, path: str, body: Mapping[str, Any],
                         headers: Mapping[str, str], total_s: float) -> dict[str, Any]:
        return (await self._post_json_raw(leg, inst, path, body, headers, total_s))[0]

    async def _post_json_raw(self, leg: str, inst: InstanceConfig, path: str,
                             body: Mapping[str, Any], headers: Mapping[str, str],
                             total_s: float) -> tuple[dict[str, Any], bytes]:
        """The leg's JSON answer, parsed and as the upstream sent it (decompressed)."""
        t0 = time.perf_counter()
        leg_started(leg)
        try:
            parsed, raw = await self._post_json_once(leg, inst, path, body, headers, total_s)
        except UpstreamError as exc:
            self._observe(leg, inst, headers, t0, body, None, None, exc.reason)
            raise
        returned = parsed.get(vllm_pd.KV_TRANSFER_PARAMS)
        self._observe(leg, inst, headers, t0, body, parsed,
                      returned if isinstance(returned, dict) else None)
        return parsed, raw

    def _observe(self, leg: str, inst: InstanceConfig, headers: Mapping[str, str], t0: float,
                 body: Mapping[str, Any] | None, answer: dict[str, Any] | None,
                 returned: dict[str, Any] | None, error: str | None = None) -> None:
        """Tell ``on_leg`` about a leg that ended (never raises)."""
        leg_ended(leg, error)
        if self.on_leg is None:
            return
        sent = body.get(vllm_pd.KV_TRANSFER_PARAMS) if body is not None else None
        try:
            self.on_leg(LegRecord(
                request_id=headers.get(REQUEST_ID_HEADER, ""), leg=leg, instance=inst.url,
                elapsed_ms=(time.perf_counter() - t0) * 1000.0,
                sent_kv_transfer_params=dict(sent) if isinstance(sent, Mapping) else None,
                answer=answer, kv_transfer_params=returned, error=error))
        except Exception:
            _logger.warning("the router's on_leg observer failed", exc_info=True)

    async def _post_json_once(self, leg: str, inst: InstanceConfig, path: str,
                              body: Mapping[str, Any], headers: Mapping[str, str],
                              total_s: float) -> tuple[dict[str, Any], bytes]:
        assert self._upstream is not None
        try:
            async with asyncio.timeout(total_s):
                answer = await self._upstream.post_json(
                    inst.url, path, json.dumps(body).encode(), headers,
                    limit=MAX_UPSTREAM_BODY_BYTES, error_limit=MAX_UPSTREAM_ERROR_BYTES)
        except asyncio.TimeoutError:
            raise UpstreamError(leg, inst.url, f"no complete answer within {total_s:g} s") from None
        except AnswerTooLarge:
            raise UpstreamError(leg, inst.url, f"answer larger than {MAX_UPSTREAM_BODY_BYTES} "
                                "bytes (decompressed); not read") from None
        except (OSError, UpstreamProtocolError) as exc:
            raise UpstreamError(leg, inst.url, f"{type(exc).__name__}: {exc}") from None
        data = answer.body
        if answer.status != 200:
            raise UpstreamError(leg, inst.url, f"HTTP {answer.status}: "
                                f"{data[:_ERROR_BODY_LIMIT].decode(errors='replace')}",
                                status=answer.status, body=data, content_type=answer.content_type)
        try:
            parsed = json.loads(data)
        except (ValueError, RecursionError):
            raise UpstreamError(leg, inst.url, "answer is not JSON") from None
        if not isinstance(parsed, dict):
            raise UpstreamError(leg, inst.url, "answer is not a JSON object")
        return parsed, data

    async def _open_stream(self, leg: str, inst: InstanceConfig, path: str,
                           body: Mapping[str, Any], headers: Mapping[str, str],
                           call: _Call) -> aiohttp.ClientResponse:
        """POST and return the open response once its status is 200 (caller releases it and,
        through :meth:`_relay_stream`, tells ``on_leg`` when the stream ends)."""
        t0 = time.perf_counter()
        leg_started(leg)
        try:
            resp = await self._open_stream_once(leg, inst, path, body, headers)
        except UpstreamError as exc:
            self._observe(leg, inst, headers, t0, body, None, None, exc.reason)
            raise
        sent = body.get(vllm_pd.KV_TRANSFER_PARAMS)
        call.stream_sent = (t0, dict(sent) if isinstance(sent, Mapping) else None)
        return resp

    async def _open_stream_once(self, leg: str, inst: InstanceConfig, path: str,
                                body: Mapping[str, Any],
                                headers: Mapping[str, str]) -> aiohttp.ClientResponse:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s,
                                        sock_read=self.config.stream_idle_timeout_s)
        try:
            resp = await self._session.post(inst.url + path, json=body, headers=dict(headers),
                                            timeout=timeout)
        except asyncio.TimeoutError:
            raise UpstreamError(leg, inst.url, "no answer within "
                                f"{self.config.stream_idle_timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(leg, inst.url, f"{type(exc).__name__}: {exc}") from None
        if resp.status != 200:
            try:
                data = await asyncio.wait_for(resp.read(), self.config.connect_timeout_s)
            except (asyncio.TimeoutError, aiohttp.ClientError):
                data = b""
            finally:
                resp.release()
            raise UpstreamError(leg, inst.url, f"HTTP {resp.status}: "
                                f"{data[:_ERROR_BODY_LIMIT].decode(errors='replace')}",
                                status=resp.status, body=data,
                                content_type=resp.headers.get("Content-Type"))
        return resp

    async def _relay_stream(self, request: web.Request, upstream: aiohttp.ClientResponse,
                            inst: InstanceConfig, call: _Call,
                            on_done: Callable[[_SseWatcher], Awaitable[None]] | None = None,
                            *, collect_reply: bool = False
                            ) -> tuple[web.StreamResponse, _SseWatcher]:
        """Copy the decode's SSE to the client as it comes; a mid-stream upstream failure is
        reported in-band (an SSE ``error`` event) since the status line is already sent.
        ``on_done`` runs once the stream is complete, before the bytes holding ``data: [DONE]``
        (or the end of the stream) reach the client: a client that sends its next turn as soon as
        it sees them finds this turn's state already stored."""
        watcher = _SseWatcher(collect_reply=collect_reply)
        done_called = on_done is None
        observed = call.stream_sent is None

        def observe(error: str | None = None) -> None:
            """Tell ``on_leg`` the decode leg ended: at ``data: [DONE]`` (before the client can
            see it and go away), else when the stream ends."""
            nonlocal observed
            if observed or call.stream_sent is None:
                return
            observed = True
            t0, sent = call.stream_sent
            self._observe("decode", inst, {REQUEST_ID_HEADER: call.request_id}, t0,
                          {vllm_pd.KV_TRANSFER_PARAMS: sent} if sent is not None else None, None,
                          watcher.kv_transfer_params, error)
        out = web.StreamResponse(status=200, headers={
            "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache", **call.response_headers()})
        # The whole stream, however steadily it trickles, ends by this deadline (issue 29).
        deadline = asyncio.timeout_at(asyncio.get_running_loop().time()
                                      + self.config.stream_deadline_s)
        try:
            await out.prepare(request)
            try:
                async with deadline:
                    async for chunk in upstream.content.iter_any():
                        if watcher.feed(chunk):
                            call.first_token()
                        if watcher.done and not done_called:
                            done_called = True
                            assert on_done is not None
                            await on_done(watcher)
                        if watcher.done:
                            observe(None if watcher.error is None else str(watcher.error)[:500])
                        await out.write(chunk)
                    if not done_called:
                        done_called = True
                        assert on_done is not None
                        await on_done(watcher)
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                upstream.close()  # never pooled mid-stream; closing aborts the request in vLLM
                await out.write(self._stream_failed(call, inst, exc, deadline.expired()))
            await out.write_eof()
        except ConnectionResetError:
            # The client went away: dropping the upstream connection aborts the request in vLLM.
            call.error_type, call.error_message = "ClientDisconnected", "client closed the stream"
            upstream.close()
        except BaseException:  # cancelled (client gone): close, do not pool, the upstream socket
            upstream.close()
            raise
        finally:
            upstream.release()
        if watcher.error is not None and call.error_type is None:
            call.error_type, call.error_message = "UpstreamStreamError", str(watcher.error)[:500]
        call.output_tokens = watcher.output_tokens
        observe(call.error_message)
        return out, watcher

    def _stream_failed(self, call: _Call, inst: InstanceConfig, exc: BaseException,
                       deadline_expired: bool) -> bytes:
        """A streamed decode that broke, fell silent or ran past ``stream_deadline_s``: recorded
        on the call and told to the client as a last SSE ``error`` event (the status is sent)."""
        if deadline_expired:
            self._stream_deadlines += 1
            err = UpstreamError("decode", inst.url, "stream not complete within stream_deadline_s "
                                f"({self.config.stream_deadline_s:g} s): cut off")
            call.error_type, kind, code = STREAM_DEADLINE_ERROR, "upstream_timeout", 504
        else:
            reason = (f"stream silent for {self.config.stream_idle_timeout_s:g} s"
                      if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}")
            err = UpstreamError("decode", inst.url, f"stream broke: {reason}")
            call.error_type, kind, code = type(err).__name__, "upstream_error", 502
        call.error_message = str(err)
        event = {"error": {"message": str(err), "type": kind, "code": code, "leg": "decode",
                           "instance": err.instance}}
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    # --- modes ------------------------------------------------------------------------------------
    async def _pull(self, request: web.Request, body: dict[str, Any], call: _Call,
                    headers: dict[str, str], traceparent: str | None,
                    reuse: Mapping[str, Any] | None) -> web.StreamResponse:
        cfg = self.config
        # Bidirectional reuse: the decode's params of the previous turn (its block ids,
        # remote_num_tokens ...): the prefill pulls the history back from the decode.
        kv_params = vllm_pd.prefill_leg_params(reuse)
        if reuse:
            call.remote_tokens = vllm_pd.offered_tokens(reuse)
        p_idx = self.prefill.choose()
        with self.prefill.lease(p_idx) as p_inst:
            call.prefill_url = p_inst.url
            try:
                p_resp = await self._post_json(
                    "prefill", p_inst, call.endpoint,
                    self._prefill_body(body, self._with_traceparent(kv_params, traceparent, call),
                                       call.endpoint), headers, cfg.prefill_timeout_s)
            except UpstreamError:
                self.prefill.mark_failure(p_idx)
                raise
        if not call.stream:
            call.first_token()  # non-streaming TTFT: the prefill's one token exists now
        call.prompt_tokens = _usage(p_resp, "prompt_tokens")
        returned = p_resp.get(vllm_pd.KV_TRANSFER_PARAMS)
        if not isinstance(returned, dict):
            raise UpstreamError("prefill", p_inst.url, "answer carries no kv_transfer_params (is the "
                                "instance started with a kv_producer NIXL connector?)")
        d_body = dict(body)
        d_body[vllm_pd.KV_TRANSFER_PARAMS] = self._with_traceparent(
            vllm_pd.pull_decode_leg_params(returned), traceparent, call)
        d_idx = self.decode.choose()  # late: the decode is chosen by load only now
        with self.decode.lease(d_idx) as d_inst:
            call.decode_url = d_inst.url
            try:
                if call.stream:
                    upstream = await self._open_stream("decode", d_inst, call.endpoint, d_body,
                                                       headers, call)
                    async def turn_done(watcher: _SseWatcher) -> None:
                        await self._remember(call, watcher.kv_transfer_params, d_inst, body,
                                             watcher.reply)
                        self._count_stream_params(call, watcher, d_inst)

                    out, _ = await self._relay_stream(request, upstream, d_inst, call,
                                                      on_done=turn_done,
                                                      collect_reply=self._binds(call))
                    return out
                d_resp, d_raw = await self._post_json_raw("decode", d_inst, call.endpoint, d_body,
                                                          headers, cfg.decode_timeout_s)
            except UpstreamError:
                self.decode.mark_failure(d_idx)
                raise
        call.output_tokens = _usage(d_resp, "completion_tokens")
        if call.prompt_tokens is None:
            call.prompt_tokens = _usage(d_resp, "prompt_tokens")
        if self._binds(call):
            await self._remember(call, d_resp.get(vllm_pd.KV_TRANSFER_PARAMS), d_inst, body,
                                 binding.Reply.from_answer(d_resp))
        # The decode's answer as it sent it: no second JSON encoding on the way out.
        return web.Response(body=d_raw, content_type="application/json", charset="utf-8",
                            headers=call.response_headers())

    def _refuse_reuse(self, call: _Call, reason: spans.ReuseRefusal, detail: str,
                      tokens: int | None) -> None:
        self._reuse_refused[reason.value] += 1
        attributes: dict[str, Any] = {
            spans.REUSE_REFUSED_REASON: reason.value, spans.CONVERSATION_ID: call.conversation_id,
            spans.REUSE_REMOTE_TOKENS: tokens, spans.REUSE_REFUSED_DETAIL: detail[:500]}
        call.events.append((spans.EventName.REUSE_REFUSED.value,
                            {k: v for k, v in attributes.items() if v is not None}))

    def _binds(self, call: _Call) -> bool:
        """Whether this turn's returned params are stored for the next turn (bidirectional, a
        conversation, and no params left stored for another history)."""
        return (self.config.mode == spans.Mode.BIDIRECTIONAL and call.store_key is not None
                and not call.keeps_stored)

    async def _remember(self, call: _Call, params: Any, inst: InstanceConfig, body: Mapping[str, Any],
                        reply: binding.Reply | None) -> None:
        """Bidirectional: store the decode's returned params for the conversation's next turn,
        bound to the history their KV encodes (this turn's prompt and answer; ``reply`` is None
        where :meth:`_binds` says the turn stores nothing)."""
        if call.ends:  # the conversation's last turn: its blocks are not kept for another
            await self.leases.release_params(params, inst.url)
            return
        if reply is None or not self._binds(call):
            return
        if isinstance(params, dict) and vllm_pd.holds_blocks(params):
            history, why = binding.history_of(body, call.endpoint == CHAT_PATH, reply)
            if history is None:
                self._refuse_reuse(call, spans.ReuseRefusal.HISTORY_UNKNOWN, why,
                                   vllm_pd.offered_tokens(params))
                return
            try:
                await self._state_call(self.store.store_params, call.store_key,
                                       binding.bind(params, history), inst.url)
            except Exception as exc:  # the answer is already the client's
                self._state_failed(call, "store_params", exc)
            else:
                await self.leases.held(call.store_key, params, inst.url, turn_started=call.t0)

    def _count_stream_params(self, call: _Call, watcher: _SseWatcher,
                             inst: InstanceConfig) -> None:
        """Bidirectional streamed turn: count whether the decode's SSE carried params; without,
        tell once per conversation (span event), since every later turn will lack them too."""
        if (self.config.mode != spans.Mode.BIDIRECTIONAL or call.conversation_id is None
                or call.error_type is not None or watcher.error is not None):
            return
        if watcher.kv_transfer_params is not None:
            self._stream_turns["with_params"] += 1
            return
        self._stream_turns["without_params"] += 1
        told = self._told_no_stream_params
        if call.conversation_id in told:
            return
        told[call.conversation_id] = None
        if len(told) > STREAM_NOTES_MAX_CONVERSATIONS:
            told.popitem(last=False)
        call.events.append((spans.EventName.STREAM_PARAMS_ABSENT.value, {
            spans.CONVERSATION_ID: call.conversation_id, spans.DECODE_INSTANCE: redact_url(inst.url),
            spans.EXCEPTION_MESSAGE: STREAM_PARAMS_ABSENT_NOTE}))
        if len(told) == 1:
            _logger.warning("%s (decode %s); told once per conversation in a span event and in "
                            "/health", STREAM_PARAMS_ABSENT_NOTE, redact_url(inst.url))

    async def _push(self, request: web.Request, body: dict[str, Any], call: _Call,
                    headers: dict[str, str], traceparent: str | None) -> web.StreamResponse:
        cfg = self.config
        p_idx, d_idx = self.prefill.choose(), self.decode.choose()
        with self.prefill.lease(p_idx) as p_inst, self.decode.lease(d_idx) as d_inst:
            call.prefill_url, call.decode_url = p_inst.url, d_inst.url
            p_body = self._prefill_body(
                body, self._with_traceparent(vllm_pd.prefill_leg_params(), traceparent, call),
                call.endpoint)
            assert p_inst.engine_id is not None and p_inst.kv_port is not None  # config checks
            d_body = dict(body)
            d_body[vllm_pd.KV_TRANSFER_PARAMS] = self._with_traceparent(
                vllm_pd.push_decode_leg_params(
                    engine_id=p_inst.engine_id, host=p_inst.side_channel_host, port=p_inst.kv_port,
                    request_id=call.request_id, tp_size=p_inst.tp_size, pp_size=p_inst.pp_size),
                traceparent, call)
            prefill_task = asyncio.create_task(self._post_json(
                "prefill", p_inst, call.endpoint, p_body, headers, cfg.prefill_timeout_s))
            if call.stream:
                decode_task: asyncio.Task[Any] = asyncio.create_task(
                    self._open_stream("decode", d_inst, call.endpoint, d_body, headers, call))
            else:
                decode_task = asyncio.create_task(self._post_json(
                    "decode", d_inst, call.endpoint, d_body, headers, cfg.decode_timeout_s))
            try:
                p_resp, decoded = await self._both(prefill_task, decode_task, call)
            except UpstreamError as exc:
                (self.prefill if exc.leg == "prefill" else self.decode).mark_failure(
                    p_idx if exc.leg == "prefill" else d_idx)
                raise
            if call.stream:
                out, _ = await self._relay_stream(request, decoded, d_inst, call)
                if p_resp is None:
                    p_resp = await self._settle_prefill(prefill_task, call)
                if p_resp is not None:
                    call.prompt_tokens = _usage(p_resp, "prompt_tokens")
                return out
        call.prompt_tokens = _usage(p_resp, "prompt_tokens") if p_resp else None
        call.output_tokens = _usage(decoded, "completion_tokens")
        return web.json_response(decoded, headers=call.response_headers())

    async def _both(self, prefill_task: asyncio.Task[Any], decode_task: asyncio.Task[Any],
                    call: _Call) -> tuple[dict[str, Any] | None, Any]:
        """Wait for the push legs. A failing leg cancels the other, except that a decode which
        already answered wins (the prefill's failure is then recorded, not returned). Streaming
        returns as soon as the decode's stream is open; the prefill is collected after it."""
        pending: set[asyncio.Task[Any]] = {prefill_task, decode_task}
        p_resp = None
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if decode_task in done:
                    decoded = decode_task.result()  # raises the decode's UpstreamError
                    if not call.stream or prefill_task.done():
                        p_resp = await self._settle_prefill(prefill_task, call)
                    return p_resp, decoded
                if prefill_task in done:
                    p_resp = prefill_task.result()  # raises the prefill's UpstreamError
                    if not call.stream:
                        call.first_token()
            raise AssertionError("unreachable")
        except BaseException:
            for task in (prefill_task, decode_task):
                if not task.done():
                    task.cancel()
            await asyncio.gather(prefill_task, decode_task, return_exceptions=True)
            if call.stream and decode_task.done() and not decode_task.cancelled() \
                    and decode_task.exception() is None:
                decode_task.result().close()
            raise

    async def _settle_prefill(self, task: asyncio.Task[Any], call: _Call) -> dict[str, Any] | None:
        """The push prefill's answer; its failure after the decode answered is recorded only.
        Shielded: a client that goes away once its stream is complete does not abort the prefill
        leg (it runs to its end, as it does when the client goes away mid-stream)."""
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # always retrieved
        try:
            result = await asyncio.shield(task)
        except UpstreamError as exc:
            if call.error_type is None:
                call.error_type, call.error_message = type(exc).__name__, str(exc)
            _logger.warning("request %s: %s (after the decode answered)", call.request_id, exc)
            return None
        if not call.stream:
            call.first_token()
        return result


async def serve(config: RouterConfig, *, port_file: str | None = None,
                stop_event: asyncio.Event | None = None,
                tracer: trace.Tracer | None = None) -> None:
    """Run the router until ``stop_event`` is set (or the task is cancelled). With ``port_file``,
    writes the bound port there once serving (atomically), for callers that asked for port 0."""
    import os

    router = Router(config, tracer=tracer)
    url = await router.start()
    _logger.info("kvtune router (%s mode) on %s; prefill %s; decode %s; state %s",
                 config.mode.value, url, [redact_url(i.url) for i in config.prefill],
                 [redact_url(i.url) for i in config.decode], redact_url(config.state))
    if port_file:
        tmp = f"{port_file}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            fh.write(str(router.port))
        os.replace(tmp, port_file)
    try:
        await (stop_event or asyncio.Event()).wait()
    finally:
        await router.stop()


def _event_loop_runner() -> Callable[[Awaitable[None]], None]:
    """``uvloop.run`` where uvloop is installed (it is with vLLM; a third less CPU per request in
    ``bench/router.py``), else ``asyncio.run``."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run  # type: ignore[return-value]
    return uvloop.run  # type: ignore[no-any-return]


def run_router(config: RouterConfig, *, port_file: str | None = None) -> int:
    """Set up telemetry and serve until SIGTERM/SIGINT (the CLI's one call); returns 0."""
    import signal

    from kvtune.router.tracing import setup_telemetry

    tracer, shutdown = setup_telemetry(config.telemetry)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, port_file=port_file, stop_event=stop, tracer=tracer)

    try:
        _event_loop_runner()(main())
    finally:
        shutdown()
    return 0
