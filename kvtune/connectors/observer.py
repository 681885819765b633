"""Span emission for the instrumented connectors, independent of vLLM.

* :class:`HookGuard` runs every kvtune hook body: an exception in kvtune's code is caught and
  logged once per process (with its traceback), and the host carries on unchanged.
* :class:`Emitter` makes the convention's spans for one role with explicit start/end times (a phase
  often starts in the scheduler process and ends in the worker process; both stamp wall-clock ns).
  Inside vLLM it only records a span's values on the calling thread; the span is built on the
  :mod:`kvtune.connectors.recorder` thread (attributes only for recording spans, none at all for
  a request the router did not sample) and exported on the telemetry's batch processor.
* :class:`ReqTrace` is what the scheduler side hands to the worker side through vLLM's connector
  metadata (``metadata.kvtune_reqs``): ids, trace context and the time a phase began.
* :class:`TransferTracker` follows NIXL transfer handles from "descriptors prepared" to "completion
  observed" and emits ``kv.descriptor_setup`` and ``kv.rdma`` with NIXL's own telemetry.

Test-only fault injection: ``KVTUNE_TEST_FAIL_HOOKS`` (comma-separated hook names, or ``*``) makes
the named hooks raise :class:`InjectedHookError` before doing anything, to prove that a failing
hook never changes what vLLM does. Never set it in production.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import Decision, ParentBased
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags, Tracer

from kvtune import spans
from kvtune.connectors.ids import (
    context_of,
    derived_span_context,
    format_traceparent,
    parse_traceparent,
)

_logger = logging.getLogger("kvtune.connectors")

ENV_FAIL_HOOKS: Final = "KVTUNE_TEST_FAIL_HOOKS"
"""Test-only: comma-separated hook names (or ``*``) that raise :class:`InjectedHookError`."""
MAX_TRACKED_REQUESTS: Final = 10_000
"""Per-request trace records a worker keeps before dropping the oldest (requests that never reach
a worker-side event must not grow memory without bound)."""
TRACER_NAME: Final = "kvtune.connectors"


class InjectedHookError(RuntimeError):
    """Raised by a hook named in ``KVTUNE_TEST_FAIL_HOOKS`` (tests only)."""


class HookGuard:
    """Runs hook bodies so that kvtune's own failures never reach vLLM.

    The first failure in the process is logged as a warning with its traceback; later ones are
    counted and logged at debug level (a broken hook on the engine loop must not flood the log).
    """

    def __init__(self, logger: logging.Logger = _logger,
                 fail_hooks: Iterable[str] | None = None) -> None:
        self._logger = logger
        if fail_hooks is None:
            fail_hooks = (h.strip() for h in os.environ.get(ENV_FAIL_HOOKS, "").split(","))
        self._fail: frozenset[str] = frozenset(h for h in fail_hooks if h)
        self._lock = threading.Lock()
        self.failures = 0
        """Hook failures caught so far."""

    def run(self, hook: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; on an exception, log (once) and return None."""
        try:
            if self._fail and (hook in self._fail or "*" in self._fail):
                raise InjectedHookError(f"{ENV_FAIL_HOOKS} asked hook {hook!r} to fail")
            return fn(*args)
        except Exception:  # telemetry never breaks the host
            with self._lock:
                self.failures += 1
                first = self.failures == 1
            if first:
                self._logger.warning(
                    "kvtune: instrumentation hook %r failed; vLLM continues unaffected and later "
                    "hook failures are logged at debug level only", hook, exc_info=True)
            else:
                self._logger.debug("kvtune: instrumentation hook %r failed", hook, exc_info=True)
            return None


GUARD: Final = HookGuard()
"""The process's guard (one warning per process)."""


def now_ns() -> int:
    """Wall clock, ns since the epoch (what span files carry; comparable across processes)."""
    return time.time_ns()


@dataclass(frozen=True)
class ReqTrace:
    """What the scheduler side tells the worker side about one request (pickled with the
    connector metadata, so only plain values)."""

    request_id: str
    base_id: str
    """Base id of this request's forward transfer (the prefill's request)."""
    traceparent: str
    """W3C traceparent of the request (given or derived)."""
    remote_base_id: str | None = None
    """Bidirectional, on the prefill: base id of the decode's retained request (reverse transfer)."""
    remote_traceparent: str | None = None
    """Bidirectional, on the prefill: trace of the retained request (reverse transfer's trace)."""
    conversation_id: str | None = None
    turn: int | None = None
    tokens: int | None = None
    """Tokens this engine receives (or, for retention, keeps)."""
    mark_ns: int | None = None
    """When this request's pending phase began on the scheduler (registration: blocks allocated;
    push prefill: prefill done; retention: blocks retained; reuse decision: decision made)."""
    ttl_s: float | None = None
    """Retention: ``decoder_kv_blocks_ttl`` in force."""
    remote_tokens: int | None = None
    """Reuse decision: tokens of history the decode holds."""
    threshold_tokens: int | None = None
    """Reuse decision: ``kv_recompute_threshold`` in force."""
    leg: spans.Role | None = None
    """The leg the request serves on this engine (what a ``kv_both`` engine's spans carry)."""

    def span_context(self) -> SpanContext:
        return parse_traceparent(self.traceparent) or derived_span_context(self.base_id)

    def parent(self) -> SpanContext | str:
        """:meth:`span_context` as :meth:`Emitter.emit` takes it: without a ``traceparent``
        the base id (the derived context is made off the engine thread)."""
        return parse_traceparent(self.traceparent) or self.base_id

    def remote_span_context(self) -> SpanContext:
        base = self.remote_base_id or self.base_id
        return parse_traceparent(self.remote_traceparent) or derived_span_context(base)


def traceparent_of(sc: SpanContext) -> str:
    return format_traceparent(sc)


class BoundedDict(OrderedDict):
    """An insertion-ordered dict that drops its oldest entries beyond ``maxlen``."""

    def __init__(self, maxlen: int = MAX_TRACKED_REQUESTS) -> None:
        super().__init__()
        self.maxlen = maxlen

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        while len(self) > self.maxlen:
            self.popitem(last=False)


def _tracer_for(role: spans.Role) -> tuple[Tracer, Any]:
    """The tracer of this process's kvtune telemetry (``kvtune.telemetry.from_env``), else the
    global OpenTelemetry tracer (a no-op unless the application configured one)."""
    handle = None
    try:
        from kvtune import telemetry
        handle = telemetry.from_env(role)
    except Exception:
        _logger.debug("kvtune: telemetry.from_env failed", exc_info=True)
    if handle is not None:
        return handle.tracer, handle
    return trace.get_tracer(TRACER_NAME), None


LEG_ROLES: Final = (spans.Role.PREFILL, spans.Role.DECODE)
"""The roles a request's leg can have on an engine."""
UNKNOWN_LEG_ROLE: Final = spans.Role.PREFILL
"""Role of a span on a per-leg (``kv_both``) engine whose leg is not known (a request with neither
``do_remote_*`` flag, a handshake nothing triggered): the prefill, as vLLM's NIXL connector treats a
request without ``do_remote_decode`` that it computes itself."""


@dataclass
class Emitter:
    """Makes the convention's spans for one engine.

    ``role``: the engine's fixed role (``kv_producer``: prefill, ``kv_consumer``: decode), which
    every span carries; or None (``kv_both``): each span carries the role of the leg it served,
    given to :meth:`emit`, and goes to that role's tracer (its ``service.name`` is the role's, as
    on a fixed-role engine). ``common`` attributes (mode, engine id, TP rank, ...) go on every span.

    ``deferred`` (default: when no ``tracer`` is given, i.e. inside vLLM): :meth:`emit` only
    records the span's values, and the span is built and ended on the
    :class:`~kvtune.connectors.recorder.SpanRecorder`'s thread (the process's unless ``recorder``
    is given). Otherwise :meth:`emit` builds it at once (tests that read spans right away).
    Either way the span is the same: its times are the ones given, its attributes are built by
    the given callable, its parent is the given context.

    Head sampling: when every tracer's sampler is parent-based and drops spans whose remote
    parent is not sampled (OpenTelemetry's default), :meth:`emit` drops such spans itself before
    recording anything (the router's ``traceparent`` flag ``00``).
    """

    role: spans.Role | None
    mode: spans.Mode
    engine_id: str
    tp_rank: int | None = None
    tracer: Tracer | None = None
    """All roles' tracer when given (tests, benches); else each role's from :func:`_tracer_for`."""
    telemetry: Any = None
    common: dict[str, Any] = field(default_factory=dict)
    deferred: bool | None = None
    recorder: Any = None
    """The :class:`~kvtune.connectors.recorder.SpanRecorder` deferred spans go to."""
    _tracers: dict[spans.Role, Tracer] = field(default_factory=dict, init=False, repr=False)
    _telemetries: list[Any] = field(default_factory=list, init=False, repr=False)
    _drop_unsampled: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        roles = (self.role,) if self.role is not None else LEG_ROLES
        explicit = self.tracer is not None
        for r in roles:  # every role's tracer now: none is made on a request's path
            if self.tracer is not None:
                self._tracers[r] = self.tracer
                continue
            tracer, handle = _tracer_for(r)
            self._tracers[r] = tracer
            if handle is not None:
                self._telemetries.append(handle)
        if self.tracer is None:
            self.tracer = self._tracers[roles[0]]
            self.telemetry = self._telemetries[0] if self._telemetries else None
        elif self.telemetry is not None:
            self._telemetries.append(self.telemetry)
        self.common = {spans.MODE: self.mode.value, spans.ENGINE_ID: self.engine_id}
        if self.tp_rank is not None:
            self.common[spans.TP_RANK] = int(self.tp_rank)
        self._drop_unsampled = all(_drops_unsampled_parents(t) for t in self._tracers.values())
        if self.deferred is None:
            self.deferred = not explicit
        if self.deferred:
            if self.recorder is None:
                from kvtune.connectors.recorder import process_recorder
                self.recorder = process_recorder()
            for handle in self._telemetries:  # its flush and shutdown build what is recorded
                add = getattr(handle, "add_before_flush", None)
                if callable(add):
                    add(self.recorder.drain)
            # After the telemetry's own exit hook was registered, so this one runs first.
            atexit.register(self.flush)
        else:
            self.recorder = None

    def role_for(self, leg: spans.Role | None) -> spans.Role:
        """The role a span of a request on leg ``leg`` carries: the engine's when fixed."""
        return self.role or leg or UNKNOWN_LEG_ROLE

    def emit(self, name: spans.SpanName, sc: SpanContext | str, start_ns: int, end_ns: int,
             attrs: Callable[[], Mapping[str, Any]] | Mapping[str, Any] | None = None,
             error: str | None = None, role: spans.Role | None = None) -> None:
        """One finished span ``name`` under parent ``sc`` from ``start_ns`` to ``end_ns``;
        ``role``: the leg it served (used on a per-leg engine only). ``attrs`` may be called
        later, on another thread: it must read only values that no longer change.

        ``sc`` a string: a base request id, whose :func:`derived_span_context` is the parent
        (made when the span is built; always sampled)."""
        if self._drop_unsampled and sc.__class__ is not str and not sc.trace_flags & _SAMPLED:
            return
        record = (self._build, name, sc, start_ns, end_ns, attrs, error, role)
        if self.recorder is not None:
            self.recorder.record(record)
        else:
            self._build(record)

    def _build(self, record: tuple[Any, ...]) -> None:
        """Start, fill and end the span of one :meth:`emit` (on the recorder's thread when
        deferred)."""
        _, name, sc, start_ns, end_ns, attrs, error, role = record
        if isinstance(sc, str):
            sc = derived_span_context(sc)
        r = self.role_for(role)
        span = self._tracers[r].start_span(name.value, context=context_of(sc),
                                           start_time=start_ns)
        if span.is_recording():
            values = {spans.ROLE: r.value, **self.common}
            if attrs is not None:
                values.update(attrs() if callable(attrs) else attrs)
            span.set_attributes({k: v for k, v in values.items() if v is not None})
            if error is not None:
                span.set_attribute(spans.ERROR_TYPE, error)
                span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=max(end_ns, start_ns))

    def flush(self) -> None:
        """Builds the recorded spans (deferred) and flushes the telemetry's exporters."""
        if self.recorder is not None:
            self.recorder.drain()
        for handle in self._telemetries:
            handle.force_flush()


_SAMPLED: Final = int(TraceFlags.SAMPLED)


def _drops_unsampled_parents(tracer: Any) -> bool:
    """Whether ``tracer`` (an SDK tracer) never records a span whose remote parent is unsampled:
    its sampler is parent-based and drops such a parent's children (the SDK's default)."""
    sampler = getattr(tracer, "sampler", None)
    if not isinstance(sampler, ParentBased):
        return False
    probe = SpanContext(trace_id=1, span_id=1, is_remote=True,
                        trace_flags=TraceFlags(TraceFlags.DEFAULT))
    try:
        result = sampler.should_sample(context_of(probe), 1, "kvtune.probe")
    except Exception:
        return False
    return result.decision is Decision.DROP


def transfer_attrs(base_id: str, direction: spans.Direction, request_id: str,
                   **extra: Any) -> dict[str, Any]:
    """The attributes that identify one KV movement."""
    attrs = {spans.TRANSFER_ID: spans.transfer_id(base_id, direction),
             spans.BASE_REQUEST_ID: base_id, spans.REQUEST_ID: request_id,
             spans.DIRECTION: direction.value}
    attrs.update(extra)
    return attrs


def count_blocks(block_ids: Any) -> int:
    """Blocks in vLLM's ``BlockIds`` (a tuple of per-group lists, or a flat list)."""
    if block_ids is None:
        return 0
    total = 0
    for group in block_ids:
        total += len(group) if isinstance(group, (list, tuple)) or hasattr(group, "__len__") else 1
    return total


def pushed_tokens(prompt_tokens: int | None, block_ids: Any, block_size: int | None
                  ) -> int | None:
    """Tokens a push WRITE moves: the prompt less the whole blocks the decode already held.

    The decode registers only the blocks it lacks (its own prefix cache holds the rest), so the
    prefill writes the prompt's last ``n`` blocks (``n``: blocks of the first KV group in
    ``block_ids``, the decode's registered blocks). ``prompt_tokens`` unchanged when the block
    size or ids are unknown."""
    if prompt_tokens is None or not block_size or block_ids is None:
        return prompt_tokens
    groups = list(block_ids)
    first = groups[0] if groups and isinstance(groups[0], (list, tuple)) else groups
    total = -(-int(prompt_tokens) // int(block_size))
    held = max(0, total - len(first))
    return max(0, int(prompt_tokens) - held * int(block_size))


@dataclass
class XferContext:
    """The transfer a worker thread is about to post (set around vLLM's read/write method)."""

    sc: SpanContext | str
    """Parent of its spans (a base id: the context derived from it, see :meth:`Emitter.emit`)."""
    attrs: dict[str, Any]
    setup_start_ns: int
    role: spans.Role | None = None
    """The leg it serves (what a ``kv_both`` engine's spans carry)."""


@dataclass
class _Pending:
    ctx: XferContext
    handle: Any
    descriptors: int | None
    post_ns: int | None = None
    done_ns: int | None = None
    state: str | None = None


class TransferTracker:
    """Follows NIXL transfer handles: prepared -> posted -> completion observed.

    The worker sets the current :class:`XferContext` around vLLM's ``_read_blocks`` /
    ``_xfer_blocks``; :class:`~kvtune.connectors.nixl_agent.ObservedNixlAgent` reports each NIXL
    call here. Handles posted outside such a context are not tracked.
    """

    def __init__(self, emitter: Emitter, guard: HookGuard = GUARD) -> None:
        self.emitter = emitter
        self.guard = guard
        self._tls = threading.local()
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()

    # --- context ----------------------------------------------------------------------------
    def begin(self, ctx: XferContext | None) -> None:
        self._tls.ctx = ctx

    def end(self) -> None:
        self._tls.ctx = None

    def current(self) -> XferContext | None:
        return getattr(self._tls, "ctx", None)

    # --- NIXL events (each called through the guard by the agent proxy) ---------------------
    def prepared(self, handle: Any, descriptors: int | None) -> None:
        ctx = self.current()
        if ctx is None:
            return
        end = now_ns()
        n = descriptors
        self.emitter.emit(spans.SpanName.DESCRIPTOR_SETUP, ctx.sc, ctx.setup_start_ns, end,
                          lambda: {**ctx.attrs, spans.DESCRIPTORS: n}, role=ctx.role)
        with self._lock:
            self._pending[id(handle)] = _Pending(ctx, handle, descriptors)
        ctx.setup_start_ns = end  # a second transfer for the same request starts here

    def posted(self, handle: Any, post_ns: int, state: Any) -> None:
        with self._lock:
            rec = self._pending.get(id(handle))
        if rec is None:
            return
        rec.post_ns = post_ns
        if state == "ERR":
            self._finish(handle, "ERR", now_ns(), None)

    def observed(self, handle: Any, state: str) -> None:
        if state == "PROC":
            return
        with self._lock:
            rec = self._pending.get(id(handle))
        if rec is None:
            return
        if rec.done_ns is None:
            rec.done_ns = now_ns()
            rec.state = state
        if state != "DONE":
            self._finish(handle, state, rec.done_ns, None)

    def telemetry(self, handle: Any, res: Any) -> None:
        with self._lock:
            rec = self._pending.get(id(handle))
        if rec is None or rec.done_ns is None:
            return
        self._finish(handle, rec.state or "DONE", rec.done_ns, res)

    def released(self, handle: Any) -> None:
        with self._lock:
            rec = self._pending.get(id(handle))
        if rec is None:
            return
        if rec.done_ns is None:
            self._finish(handle, "RELEASED_BEFORE_COMPLETION", now_ns(), None)
        else:
            self._finish(handle, rec.state or "DONE", rec.done_ns, None)

    def _finish(self, handle: Any, state: str, done_ns: int, res: Any) -> None:
        with self._lock:
            rec = self._pending.pop(id(handle), None)
        if rec is None or rec.post_ns is None:
            return
        ctx = rec.ctx
        descriptors = rec.descriptors
        # NIXL's telemetry read now (its handle is released next); the dict is built later.
        nixl = None if res is None else (float(res.postDuration), float(res.xferDuration),
                                         int(res.totalBytes), int(res.descCount))

        def attrs() -> dict[str, Any]:
            out = dict(ctx.attrs)
            out[spans.NIXL_STATUS] = state
            out[spans.DESCRIPTORS] = descriptors
            if nixl is not None:
                out[spans.NIXL_POST_US] = nixl[0]
                out[spans.NIXL_XFER_US] = nixl[1]
                out[spans.BYTES] = nixl[2]
                out[spans.DESCRIPTORS] = nixl[3]
            return out

        self.emitter.emit(spans.SpanName.RDMA, ctx.sc, rec.post_ns, done_ns, attrs,
                          error=None if state == "DONE" else f"nixl_{state.lower()}",
                          role=ctx.role)

    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)


def request_attrs(info: ReqTrace | None) -> dict[str, Any]:
    """Conversation attributes of a request, when known."""
    if info is None:
        return {}
    return {spans.CONVERSATION_ID: info.conversation_id, spans.TURN: info.turn}
