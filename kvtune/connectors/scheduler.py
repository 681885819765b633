"""Scheduler sides of the instrumented connectors (imports vLLM).

Each override calls vLLM's own method first with the same arguments, returns its result unchanged,
and then runs a kvtune hook through the guard. What the scheduler learns that a worker needs (trace
context, tokens, when a phase began) travels in the connector metadata as ``kvtune_reqs``.

Spans made here: ``kv.queue`` (either leg), ``kv.prefill`` (prefill), ``kv.decode_start``
(decode), ``kv.reuse_decision`` (prefill, bidirectional, for outcomes decided here; a pull is
confirmed or declined as expired by the worker).

Roles: a ``kv_producer`` engine's spans are the prefill's and a ``kv_consumer``'s the decode's; on a
``kv_both`` engine each span carries the role of the leg its request serves there
(:func:`kvtune.vllm_pd.leg_role` of the request's ``kv_transfer_params`` as they arrived), which
the request's :class:`ReqTrace` tells the worker side too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
    NixlPushConnectorScheduler,
)

from opentelemetry.trace import SpanContext

from kvtune import spans
from kvtune.connectors import compat
from kvtune.connectors.ids import base_request_id, derived_span_context, given_span_context
from kvtune.connectors.idle import IdleStepWait, wait_ms_from_extra_config
from kvtune.connectors.lease import LeaseBook, LeaseChannel, lease_settings
from kvtune.connectors.observer import (
    GUARD,
    Emitter,
    ReqTrace,
    now_ns,
    parse_traceparent,
    traceparent_of,
    transfer_attrs,
)
from kvtune.vllm_pd import (
    DO_REMOTE_DECODE, DO_REMOTE_PREFILL, KV_CONNECTOR_EXTRA_CONFIG, KV_PRODUCER, LEASE_PORT,
    PARAMS_LEASE_PORT, REMOTE_BLOCK_IDS, REMOTE_BLOCKS_EXPIRY_TIME, REMOTE_NUM_TOKENS,
    REMOTE_REQUEST_ID, engine_role, leg_role,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

_log = logging.getLogger(__name__)
_R = spans.ReuseOutcome
_S = spans.SpanName
_NORMAL_FINISH = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
_NOTHING: Final = MappingProxyType({})
"""kvtune's per-request maps before :meth:`_SchedulerHooks._kvt_init` (empty, read-only): the
per-step overrides test them before calling a hook."""


@dataclass(slots=True)
class _ReqState:
    """Scheduler-side state of one request (dropped when the request finishes)."""

    request_id: str
    base_id: str
    traceparent: str
    """The ``traceparent`` the request came with ("" without one: the worker side derives the
    same context from ``base_id``)."""
    conversation_id: str | None
    turn: int | None
    leg: spans.Role | None
    """The leg the request serves on this engine (:func:`kvtune.vllm_pd.leg_role`)."""
    sc: SpanContext | None
    """Context the request came with (its ``traceparent`` parsed once); None without one."""
    scheduled_ns: int | None = None
    local_cached: int = 0
    external: int = 0
    waiting_kv: bool = False
    decided: bool = False
    decision_ns: int | None = None
    queued: bool = False

    @property
    def parent(self) -> SpanContext | str:
        """Parent of the request's spans for :meth:`Emitter.emit`: the given context, else the
        base id (the context derived from it is made off the engine thread)."""
        return self.sc if self.sc is not None else self.base_id

    def parent_context(self) -> SpanContext:
        """The parent as a context (derived here when none came)."""
        return self.sc if self.sc is not None else derived_span_context(self.base_id)


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


class _SchedulerHooks:
    """Mixed into vLLM's pull/push scheduler classes (before them in the MRO)."""

    _KVT_MODE = spans.Mode.PULL
    _KVT_VLLM: Any = None
    """The vLLM class this mixes into: the per-step overrides call its methods directly (a
    zero-argument ``super()`` costs a step more than the rest of the override)."""
    # Until _kvt_init (or when it failed): nothing to do on a step.
    _kvt_outbox: Any = _NOTHING
    _kvt_kv_ready: Any = _NOTHING
    _kvt_idle: IdleStepWait | None = None
    _kvt_lease: LeaseBook | None = None
    """The renewable decode lease (:mod:`kvtune.connectors.lease`); None: off (vLLM's TTL)."""
    _kvt_lease_channel: LeaseChannel | None = None

    def _kvt_setup(self) -> None:
        cfg = self.vllm_config.kv_transfer_config
        role = engine_role(cfg.kv_role)
        mode = self._KVT_MODE
        if getattr(self, "is_bidirectional_kv_xfer_enabled", False):
            mode = spans.Mode.BIDIRECTIONAL
        self._kvt_init(Emitter(role, mode, str(self.engine_id)))
        wait_ms = wait_ms_from_extra_config(getattr(cfg, KV_CONNECTOR_EXTRA_CONFIG, None))
        self._kvt_idle = IdleStepWait(wait_ms) if wait_ms is not None else None
        if mode is spans.Mode.BIDIRECTIONAL and cfg.kv_role != KV_PRODUCER:
            self._kvt_lease_setup(getattr(cfg, KV_CONNECTOR_EXTRA_CONFIG, None))

    def _kvt_lease_setup(self, extra: Any) -> None:
        """Start the lease channel when the extra config asks for it (a bad value: logged, and
        the decode keeps vLLM's fixed TTL)."""
        ttl_s = float(getattr(self, "decoder_kv_blocks_ttl", 0) or 0)
        try:
            settings = lease_settings(extra, ttl_s)
        except ValueError as exc:
            _log.warning("kvtune: renewable decode lease off: %s", exc)
            return
        if settings is None:
            return
        port, max_s = settings
        book = LeaseBook(max_s)
        try:
            self._kvt_lease_channel = LeaseChannel(book, port)
        except OSError as exc:
            _log.warning("kvtune: renewable decode lease off: cannot listen on 127.0.0.1:%d "
                         "(%s.%s): %s", port, KV_CONNECTOR_EXTRA_CONFIG, LEASE_PORT, exc)
            return
        self._kvt_lease = book
        _log.info("kvtune: renewable decode lease on: channel 127.0.0.1:%d, renewals up to %g s",
                  self._kvt_lease_channel.port, max_s)

    def _kvt_init(self, emitter: Emitter) -> None:
        """kvtune's state; ``emitter`` fixes the mode (and the role, unless per leg)."""
        self._kvt = emitter
        self._kvt_role = emitter.role
        self._kvt_mode = emitter.mode
        self._kvt_reqs: dict[str, _ReqState] = {}
        self._kvt_outbox: dict[str, dict[str, Any]] = {}
        """Per request: the :class:`ReqTrace` fields for the next metadata."""
        self._kvt_kv_ready: dict[str, int] = {}

    # --- vLLM methods (vLLM's own first, unchanged result, then the hook) ------------------
    @compat.overrides(_S.QUEUE, _S.PREFILL, _S.REUSE_DECISION)
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        GUARD.run("scheduler.matched", self._kvt_on_matched, request, num_computed_tokens, result)
        return result

    @compat.overrides(_S.PREFILL, _S.REUSE_DECISION, _S.REGISTRATION)
    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> Any:
        params = request.kv_transfer_params
        pre = (bool(params.get(DO_REMOTE_PREFILL)), bool(params.get(DO_REMOTE_DECODE))) \
            if params else None
        result = super().update_state_after_alloc(request, blocks, num_external_tokens)
        GUARD.run("scheduler.alloc", self._kvt_on_alloc, request, blocks, num_external_tokens, pre)
        return result

    @compat.overrides(_S.DECODE_START, "metadata to workers")
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = self._KVT_VLLM.build_connector_meta(self, scheduler_output)
        if self._kvt_outbox or self._kvt_kv_ready:  # else a step costs kvtune two tests
            GUARD.run("scheduler.meta", self._kvt_on_meta, meta, scheduler_output)
        if self._kvt_lease is not None and self._kvt_lease.pending:
            GUARD.run("scheduler.lease", self._kvt_lease_meta, meta)
        if self._kvt_idle is not None:
            GUARD.run("scheduler.idle_wait", self._kvt_idle.after_schedule, scheduler_output)
        return meta

    @compat.overrides(_S.DECODE_START)
    def update_connector_output(self, connector_output: Any) -> None:
        self._KVT_VLLM.update_connector_output(self, connector_output)
        if connector_output.finished_recving:
            GUARD.run("scheduler.output", self._kvt_on_output, connector_output)
        if self._kvt_lease is not None and connector_output.finished_sending:
            GUARD.run("scheduler.lease_gone", self._kvt_lease.gone,
                      connector_output.finished_sending)

    @compat.overrides(_S.PREFILL, _S.RETENTION, _S.RENDEZVOUS)
    def request_finished(self, request: Request, block_ids: Any
                         ) -> tuple[bool, dict[str, Any] | None]:
        status = _status_name(request)
        result = super().request_finished(request, block_ids)
        GUARD.run("scheduler.finished", self._kvt_on_finished, request, status, result)
        return result

    @compat.overrides("span flush")
    def shutdown(self) -> None:
        super().shutdown()
        if self._kvt_lease_channel is not None:
            GUARD.run("scheduler.lease_close", self._kvt_lease_channel.close)
        GUARD.run("scheduler.shutdown", lambda: self._kvt.flush())

    # --- state ------------------------------------------------------------------------------
    def _kvt_state(self, request: Request, leg: spans.Role | None = None) -> _ReqState:
        """``request``'s state, made at the first look (``leg``: when vLLM may already have
        changed its params, the leg they gave before)."""
        st = self._kvt_reqs.get(request.request_id)
        if st is None:
            params = request.kv_transfer_params or {}
            # On the decode the forward transfer is named after the prefill's request.
            remote = params.get(REMOTE_REQUEST_ID) if params.get(DO_REMOTE_PREFILL) else None
            base = base_request_id(str(remote) if remote else request.request_id)
            sc = given_span_context(trace_headers=getattr(request, "trace_headers", None),
                                    kv_params=params)
            st = _ReqState(request.request_id, base, traceparent_of(sc) if sc is not None else "",
                           _str_or_none(params.get(spans.KV_PARAMS_CONVERSATION_ID)),
                           _int_or_none(params.get(spans.KV_PARAMS_TURN)),
                           leg or leg_role(params), sc)
            self._kvt_reqs[request.request_id] = st
        return st

    def _kvt_trace(self, st: _ReqState, **fields: Any) -> None:
        """Queue (or update) what the worker side should know about ``st``'s request."""
        prev = self._kvt_outbox.get(st.request_id)
        if prev is None:
            self._kvt_outbox[st.request_id] = {
                "request_id": st.request_id, "base_id": st.base_id,
                "traceparent": st.traceparent, "conversation_id": st.conversation_id,
                "turn": st.turn, "leg": st.leg, **fields}
        else:
            prev.update(fields)

    def _kvt_conv(self, st: _ReqState) -> dict[str, Any]:
        return {spans.CONVERSATION_ID: st.conversation_id, spans.TURN: st.turn}

    # --- hooks ------------------------------------------------------------------------------
    def _kvt_on_matched(self, request: Request, num_computed_tokens: int,
                        result: tuple[int | None, bool]) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        st = self._kvt_state(request)
        if not st.queued:
            st.queued = True
            self._kvt_on_queued(request, st)
        st.local_cached = int(num_computed_tokens)
        if (self._kvt_mode is spans.Mode.BIDIRECTIONAL and params.get(DO_REMOTE_DECODE)
                and not st.decided):
            st.decided = True
            self._kvt_reuse_decision(request, st, params, num_computed_tokens, result)

    def _kvt_on_queued(self, request: Request, st: _ReqState) -> None:
        """``kv.queue``: the API server's arrival stamp -> the scheduler's first look."""
        arrival = getattr(request, "arrival_time", None)
        if not isinstance(arrival, (int, float)) or arrival <= 0:
            return
        t = now_ns()
        start = min(int(arrival * 1e9), t)
        rid, prompt = request.request_id, request.num_prompt_tokens
        self._kvt.emit(spans.SpanName.QUEUE, st.parent, start, t, lambda: {
            spans.REQUEST_ID: rid, spans.BASE_REQUEST_ID: st.base_id,
            **self._kvt_conv(st), spans.PROMPT_TOKENS: int(prompt)},
            role=st.leg)

    def _kvt_reuse_decision(self, request: Request, st: _ReqState, params: dict[str, Any],
                            num_computed_tokens: int, result: tuple[int | None, bool]) -> None:
        t = now_ns()
        st.decision_ns = t
        remote_id = params.get(REMOTE_REQUEST_ID)
        remote_tokens = int(params.get(REMOTE_NUM_TOKENS) or 0) if params.get(
            REMOTE_BLOCK_IDS) else 0
        threshold = int(getattr(self, "kv_recompute_threshold", 0))
        if result[0]:
            # A pull: the worker confirms it (or declines it as expired) and emits the span.
            return
        if not remote_id or remote_tokens <= 0:
            outcome = _R.NONE
        elif min(remote_tokens, request.num_prompt_tokens) - num_computed_tokens <= 0:
            outcome = _R.LOCAL_HIT
        else:
            outcome = _R.RECOMPUTE
        if remote_id:
            base = base_request_id(str(remote_id))
            sc = parse_traceparent(params.get(spans.KV_PARAMS_RETAINED_TRACEPARENT)) or base
            tid_attrs = transfer_attrs(base, spans.Direction.REVERSE, request.request_id)
        else:
            sc = st.parent
            tid_attrs = {spans.REQUEST_ID: request.request_id, spans.BASE_REQUEST_ID: st.base_id}
        prompt = request.num_prompt_tokens
        self._kvt.emit(spans.SpanName.REUSE_DECISION, sc, t, now_ns(), lambda: {
            **tid_attrs, **self._kvt_conv(st), spans.REUSE_OUTCOME: outcome.value,
            spans.REUSE_REMOTE_TOKENS: remote_tokens, spans.REUSE_THRESHOLD_TOKENS: threshold,
            spans.PROMPT_TOKENS: int(prompt)}, role=spans.Role.PREFILL)

    def _kvt_on_alloc(self, request: Request, blocks: Any, num_external_tokens: int,
                      pre: tuple[bool, bool] | None) -> None:
        if pre is None:
            return
        was_remote_prefill, is_remote_decode = pre
        st = self._kvt_state(request, spans.Role.PREFILL if is_remote_decode
                             else spans.Role.DECODE if was_remote_prefill else None)
        if is_remote_decode:
            if st.scheduled_ns is None:
                st.scheduled_ns = now_ns()
                self._kvt_trace(st)  # the worker's notify / push spans join this request's trace
            st.external = max(st.external, int(num_external_tokens))
            if (self._kvt_mode is spans.Mode.BIDIRECTIONAL and num_external_tokens > 0
                    and request.request_id in getattr(self, "_reqs_need_recv", {})):
                params = request.kv_transfer_params or {}
                remote_id = str(params.get(REMOTE_REQUEST_ID) or "")
                self._kvt_trace(
                    st, remote_base_id=base_request_id(remote_id) if remote_id else None,
                    remote_traceparent=params.get(spans.KV_PARAMS_RETAINED_TRACEPARENT),
                    tokens=int(num_external_tokens), mark_ns=st.decision_ns,
                    remote_tokens=_int_or_none(params.get(REMOTE_NUM_TOKENS)),
                    threshold_tokens=int(getattr(self, "kv_recompute_threshold", 0)))
        elif was_remote_prefill and num_external_tokens > 0:
            st.waiting_kv = True
            st.external = int(num_external_tokens)
            self._kvt_trace(st, tokens=int(num_external_tokens), mark_ns=now_ns())

    def _kvt_on_meta(self, meta: Any, scheduler_output: Any) -> None:
        if self._kvt_outbox:
            meta.kvtune_reqs = {rid: ReqTrace(**f) for rid, f in self._kvt_outbox.items()}
            self._kvt_outbox = {}
        if self._kvt_kv_ready:
            scheduled = scheduler_output.num_scheduled_tokens or {}
            for rid in [r for r in self._kvt_kv_ready if r in scheduled]:
                ready_ns = self._kvt_kv_ready.pop(rid)
                st = self._kvt_reqs.get(rid)
                if st is None:
                    continue
                self._kvt.emit(spans.SpanName.DECODE_START, st.parent, ready_ns, now_ns(),
                               _decode_start_attrs(st, rid, st.external), role=spans.Role.DECODE)

    def _kvt_lease_meta(self, meta: Any) -> None:
        """Renewed (or released) deadlines join vLLM's ``reqs_to_send`` (each worker re-assigns
        its deadline for a request it still holds); the notes feed ``kv.retention``."""
        assert self._kvt_lease is not None
        deadlines, notes = self._kvt_lease.drain()
        if deadlines:
            meta.reqs_to_send.update(deadlines)
        if notes:
            meta.kvtune_leases = notes

    def _kvt_on_output(self, connector_output: Any) -> None:
        done = connector_output.finished_recving
        if not done:
            return
        failed = connector_output.failed_recving or ()
        t = now_ns()
        for rid in done:
            st = self._kvt_reqs.get(rid)
            if st is not None and st.waiting_kv:
                st.waiting_kv = False
                if rid not in failed:
                    self._kvt_kv_ready[rid] = t

    def _kvt_on_finished(self, request: Request, status_name: str,
                         result: tuple[bool, dict[str, Any] | None]) -> None:
        rid = request.request_id
        st = self._kvt_reqs.pop(rid, None)
        self._kvt_kv_ready.pop(rid, None)
        params = request.kv_transfer_params or {}
        if st is None:
            return
        t = now_ns()
        if params.get(DO_REMOTE_DECODE) and st.scheduled_ns is not None:
            prompt = int(request.num_prompt_tokens)
            cached = min(prompt, st.local_cached + st.external)
            ok = status_name in _NORMAL_FINISH
            self._kvt.emit(spans.SpanName.PREFILL, st.parent, st.scheduled_ns, t, lambda: {
                **transfer_attrs(st.base_id, spans.Direction.FORWARD, rid),
                **self._kvt_conv(st), spans.PROMPT_TOKENS: prompt, spans.CACHED_TOKENS: cached,
                spans.COMPUTED_TOKENS: prompt - cached}, error=None if ok else status_name.lower(),
                role=spans.Role.PREFILL)
            if ok and result[0]:
                # Push: when the prefill's KV became ready (the rendezvous' "prefill" arrival).
                self._kvt_trace(st, mark_ns=t, tokens=prompt)
        elif (self._kvt_mode is spans.Mode.BIDIRECTIONAL and result[0]
              and result[1] is not None):
            # Decode keeps the blocks for the next turn: the retention begins.
            out = result[1]
            traceparent = traceparent_of(st.parent_context())
            out[spans.KV_PARAMS_RETAINED_TRACEPARENT] = traceparent
            if st.conversation_id is not None:
                out.setdefault(spans.KV_PARAMS_CONVERSATION_ID, st.conversation_id)
            if st.turn is not None:
                out.setdefault(spans.KV_PARAMS_TURN, st.turn)
            expiry = out.get(REMOTE_BLOCKS_EXPIRY_TIME)
            if self._kvt_lease is not None and isinstance(expiry, (int, float)):
                assert self._kvt_lease_channel is not None
                self._kvt_lease.hold(rid, float(expiry))
                out[PARAMS_LEASE_PORT] = self._kvt_lease_channel.port
            # Retained blocks belong to this decode's own request (named after its own id).
            self._kvt_trace(st, base_id=base_request_id(rid), traceparent=traceparent, mark_ns=t,
                            ttl_s=float(getattr(self, "decoder_kv_blocks_ttl", 0)),
                            tokens=_int_or_none(out.get(REMOTE_NUM_TOKENS)))


def _decode_start_attrs(st: _ReqState, rid: str, tokens: int) -> Any:
    """``kv.decode_start``'s attributes, bound to this request's values now (they are built
    later, on the span builder's thread)."""
    return lambda: {**transfer_attrs(st.base_id, spans.Direction.FORWARD, rid),
                    spans.CONVERSATION_ID: st.conversation_id, spans.TURN: st.turn,
                    spans.TOKENS: tokens}


def _str_or_none(value: Any) -> str | None:
    return str(value) if value is not None else None


def _status_name(request: Request) -> str:
    status = getattr(request, "status", None)
    return getattr(status, "name", str(status))


@compat.instrumented
class KvtunePullScheduler(_SchedulerHooks, NixlPullConnectorScheduler):
    """vLLM's pull (READ) scheduler, plus kvtune's spans."""

    _KVT_MODE = spans.Mode.PULL
    _KVT_VLLM = NixlPullConnectorScheduler

    @compat.overrides("scheduler state")
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        GUARD.run("scheduler.setup", self._kvt_setup)


@compat.instrumented
class KvtunePushScheduler(_SchedulerHooks, NixlPushConnectorScheduler):
    """vLLM's push (WRITE) scheduler, plus kvtune's spans."""

    _KVT_MODE = spans.Mode.PUSH
    _KVT_VLLM = NixlPushConnectorScheduler

    @compat.overrides("scheduler state")
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        GUARD.run("scheduler.setup", self._kvt_setup)
