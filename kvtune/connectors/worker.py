"""Worker sides of the instrumented connectors (imports vLLM).

The worker's NIXL agent is wrapped in :class:`~kvtune.connectors.nixl_agent.ObservedNixlAgent`;
vLLM's read/write methods are overridden only to say *which* transfer the NIXL calls inside them
belong to. Spans made here: ``kv.handshake``, ``kv.descriptor_setup``, ``kv.rdma`` (initiator),
``kv.notify`` (target), ``kv.registration`` (push decode), ``kv.rendezvous`` (push prefill),
``kv.reuse_decision`` for pulls (bidirectional prefill: pull or expired) and ``kv.retention``
(bidirectional decode). On a ``kv_both`` engine each carries the role of the leg it belongs to:
the request's (``ReqTrace.leg``, from the scheduler side) where one is known, else the one the
span can only have: a forward READ or a push notification is the decode's, a reverse READ, a
WRITE, a pull notification or a rendezvous the prefill's.

Retention outcomes: ``reused`` when the conversation's next turn claimed the retained blocks within
the TTL, i.e. the prefill's notification arrived. vLLM sends the same notification whether the
prefill read the blocks or only tells the decode to free them (a local prefix-cache hit, or a
recompute under ``kv_recompute_threshold``), so the decode cannot tell these apart: the prefill's
``kv.reuse_decision`` with the same ``kv.transfer_id`` says which. ``expired``: the TTL ran out
first. ``released``: still retained at shutdown. With the renewable decode lease
(:mod:`kvtune.connectors.lease`) the scheduler's :class:`~kvtune.connectors.lease.LeaseNote` per
held request adds ``kv.retention.renewals`` and ``kv.retention.lease_s``, and a freed lease is
``ended`` (the router released it) or ``lapsed`` (its deadline passed unrenewed) instead of
``expired``.

The prefill's lease (pull, vLLM's ``kv_lease_duration``): from the step the worker takes a finished
request's blocks into its send map to the decode's notification, the lease expiry or shutdown, the
worker keeps three plain values (start, expiry, heartbeat renewals); the prefill's forward
``kv.notify`` then carries ``kv.prefill_lease.*`` (:class:`~kvtune.spans.PrefillLeaseOutcome`), and
a hold still open at shutdown gets a ``kv.notify`` with ``error.type`` ``kv_lease_released``.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)

from kvtune import spans
from kvtune.connectors import compat
from kvtune.connectors.ids import base_request_id, derived_span_context, parse_traceparent
from kvtune.connectors.lease import LeaseNote
from kvtune.connectors.nixl_agent import ObservedNixlAgent
from kvtune.connectors.progress import agent_settings, settings_of
from kvtune.connectors.observer import (
    GUARD,
    BoundedDict,
    Emitter,
    ReqTrace,
    TransferTracker,
    XferContext,
    count_blocks,
    pushed_tokens,
    now_ns,
    request_attrs,
    transfer_attrs,
)
from kvtune.vllm_pd import (
    BIDIRECTIONAL_KV_XFER,
    DEFAULT_KV_LEASE_DURATION_S,
    KV_LEASE_DURATION,
    REMOTE_ENGINE_ID,
    engine_role,
)

_D = spans.Direction
_S = spans.SpanName
_P = spans.Role.PREFILL
_DEC = spans.Role.DECODE
_log = logging.getLogger(__name__)
LEASE_EXPIRED = "kv_lease_expired"
"""``error.type`` of a ``kv.notify`` that never came: the producer's lease on the blocks ran out."""
LEASE_RELEASED = "kv_lease_released"
"""``error.type`` of a ``kv.notify`` that never came: the prefill shut down holding the blocks."""


class _Hold:
    """A pull prefill's hold of one finished request's blocks (plain values, engine thread)."""

    __slots__ = ("start_ns", "expiry_s", "renewals")

    def __init__(self, start_ns: int, expiry_s: float) -> None:
        self.start_ns = start_ns
        self.expiry_s = expiry_s
        """vLLM's expiry (``time.perf_counter()`` seconds), renewed by heartbeats."""
        self.renewals = 0

    def attrs(self, lease_s: float, end_ns: int, now_s: float,
              outcome: spans.PrefillLeaseOutcome) -> dict[str, Any]:
        return {spans.PREFILL_LEASE_S: lease_s,
                spans.PREFILL_LEASE_HELD_S: (end_ns - self.start_ns) / 1e9,
                spans.PREFILL_LEASE_RENEWALS: self.renewals,
                spans.PREFILL_LEASE_MARGIN_S: self.expiry_s - now_s,
                spans.PREFILL_LEASE_OUTCOME: outcome.value}


class _WorkerHooks:
    """Mixed into vLLM's pull/push worker classes (before them in the MRO)."""

    _KVT_MODE = spans.Mode.PULL

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        settings = settings_of(vllm_config, push=self._KVT_MODE is spans.Mode.PUSH)
        with agent_settings(settings):
            super().__init__(vllm_config, engine_id, kv_cache_config)  # vLLM's worker (MRO)
        self._kvt_progress_delay = settings.span_value
        GUARD.run("worker.setup", self._kvt_setup)

    def _kvt_setup(self) -> None:
        cfg = self.vllm_config.kv_transfer_config
        bidir = bool(cfg.get_from_extra_config(BIDIRECTIONAL_KV_XFER, False))
        mode = spans.Mode.BIDIRECTIONAL if bidir else self._KVT_MODE
        emitter = Emitter(engine_role(cfg.kv_role), mode, str(self.engine_id),
                          tp_rank=getattr(self, "tp_rank", None))
        backends = getattr(self, "nixl_backends", None) or ["UCX"]
        emitter.common[spans.NIXL_BACKEND] = str(backends[0])
        emitter.common[spans.NIXL_PROGRESS_DELAY_US] = self._kvt_progress_delay
        self._kvt_lease_s = float(cfg.get_from_extra_config(KV_LEASE_DURATION,
                                                            DEFAULT_KV_LEASE_DURATION_S))
        self._kvt_init(emitter)

    def _kvt_init(self, emitter: Emitter) -> None:
        """kvtune's state; ``emitter`` fixes the mode (and the role, unless per leg). Wraps the
        NIXL agent."""
        self._kvt = emitter
        self._kvt_role = emitter.role
        self._kvt_xfers = TransferTracker(self._kvt)
        self._kvt_reqs: BoundedDict = BoundedDict()
        self._kvt_retained: dict[str, ReqTrace] = {}
        self._kvt_lease_notes: dict[str, LeaseNote] = {}
        """Per retained request under the renewable lease: the scheduler's last note."""
        self._kvt_hs_trigger: dict[str, tuple[Any, dict[str, Any], spans.Role]] = {}
        self._kvt_cur_req: str | None = None
        self._kvt_hb_sent: BoundedDict = BoundedDict()
        """Pull decode: heartbeats sent per prefill request id (the remote id it will read)."""
        self._kvt_holds: BoundedDict = BoundedDict()
        """Pull prefill: finished requests whose blocks wait for the decode's READ (``_Hold``;
        bounded, like the other per-request state, should vLLM drop one by a path not hooked)."""
        if not hasattr(self, "_kvt_lease_s"):
            self._kvt_lease_s = float(DEFAULT_KV_LEASE_DURATION_S)
        self.nixl_wrapper = ObservedNixlAgent(self.nixl_wrapper, self._kvt_xfers)

    # --- helpers ----------------------------------------------------------------------------
    def _kvt_leg(self, info: ReqTrace | None, unknown: spans.Role | None) -> spans.Role | None:
        """The leg of a request on this engine: the engine's role when fixed, else the request's
        (``info``), else ``unknown``."""
        if self._kvt_role is not None:
            return self._kvt_role
        return info.leg if info is not None and info.leg is not None else unknown

    def _kvt_forward_target_sc(self, rid: str) -> tuple[Any, str, ReqTrace | None]:
        """(parent for :meth:`Emitter.emit`, base id, what the scheduler told) of ``rid``'s
        forward transfer."""
        info = self._kvt_reqs.get(rid)
        base = info.base_id if info is not None else base_request_id(rid)
        sc = info.parent() if info is not None else base
        return sc, base, info

    def _kvt_notify(self, rid: str, direction: spans.Direction, sc: Any, base: str,
                    info: ReqTrace | None, role: spans.Role, error: str | None = None,
                    lease: spans.PrefillLeaseOutcome | None = None) -> None:
        t = now_ns()
        hold = self._kvt_holds.pop(rid, None) if lease is not None else None
        now_s = time.perf_counter() if hold is not None else 0.0
        lease_s = self._kvt_lease_s
        self._kvt.emit(_S.NOTIFY, sc, t, t, lambda: {
            **transfer_attrs(base, direction, rid), **request_attrs(info),
            spans.TOKENS: info.tokens if info is not None else None,
            **({} if hold is None or lease is None else hold.attrs(lease_s, t, now_s, lease))},
            error=error, role=role)

    def _kvt_on_sends(self, reqs_to_send: Any) -> None:
        """Pull prefill: the finished requests whose blocks the worker now holds for a READ."""
        t = now_ns()
        held = self._reqs_to_send
        for rid in reqs_to_send:
            if rid not in self._kvt_holds and rid not in self._kvt_retained and rid in held:
                self._kvt_holds[rid] = _Hold(t, held[rid])

    def _kvt_on_heartbeats_sent(self, by_engine: dict[str, Any]) -> None:
        """Pull decode: vLLM sent a heartbeat to each engine it has a NIXL agent of."""
        for engine_id, hb in by_engine.items():
            if engine_id in self._remote_agents:  # else vLLM skipped it: handshake pending
                for rid in hb.req_ids:
                    self._kvt_hb_sent[rid] = self._kvt_hb_sent.get(rid, 0) + 1

    def _kvt_on_heartbeat(self, payload: str) -> None:
        held = self._reqs_to_send
        for rid in payload.split(","):
            hold = self._kvt_holds.get(rid)
            if hold is not None:
                hold.renewals += 1
                hold.expiry_s = held.get(rid, hold.expiry_s)

    def _kvt_retention_end(self, rid: str, outcome: spans.RetentionOutcome) -> None:
        info = self._kvt_retained.pop(rid, None)
        note = self._kvt_lease_notes.pop(rid, None)
        if info is None or info.mark_ns is None:
            return
        if note is not None and outcome is spans.RetentionOutcome.EXPIRED:
            outcome = spans.RetentionOutcome.ENDED if note.released else \
                spans.RetentionOutcome.LAPSED
        lease = {} if note is None else {spans.RETENTION_RENEWALS: note.renewals,
                                         spans.RETENTION_LEASE_S: note.lease_s}
        self._kvt.emit(_S.RETENTION, info.parent(), info.mark_ns, now_ns(), lambda: {
            **transfer_attrs(info.base_id, _D.REVERSE, rid), **request_attrs(info),
            spans.TOKENS: info.tokens, spans.RETENTION_TTL_S: info.ttl_s,
            spans.RETENTION_OUTCOME: outcome.value, **lease}, role=_DEC)

    def _kvt_trigger_handshake(self, engine_id: str, sc: Any, attrs: dict[str, Any],
                               role: spans.Role) -> None:
        if engine_id not in self._remote_agents and engine_id not in self._kvt_hs_trigger:
            self._kvt_hs_trigger[engine_id] = (sc, attrs, role)

    # --- hooks ------------------------------------------------------------------------------
    def _kvt_on_metadata(self, metadata: Any) -> None:
        extra = getattr(metadata, "kvtune_reqs", None) or {}
        for rid, info in extra.items():
            self._kvt_reqs[rid] = info
            if info.ttl_s is not None and self._kvt_leg(info, None) is _DEC:
                self._kvt_retained[rid] = info
        for rid, note in (getattr(metadata, "kvtune_leases", None) or {}).items():
            if rid in self._kvt_retained:
                self._kvt_lease_notes[rid] = note

    def _kvt_xfer_context(self, op: spans.NixlOp, read_spec: Any, dst_engine_id: str,
                          request_id: str, remote_request_id: str) -> XferContext:
        t = now_ns()
        info = self._kvt_reqs.get(request_id)
        if op is spans.NixlOp.READ and self._kvt_leg(info, _DEC) is _P:
            # A prefill reads only in bidirectional mode: the history's KV back from the decode.
            role = _P
            direction = _D.REVERSE
            base = base_request_id(remote_request_id)
            sc = (parse_traceparent(info.remote_traceparent) if info is not None else None) \
                or derived_span_context(base)
        else:
            role = _DEC if op is spans.NixlOp.READ else _P  # the reader, or the push writer
            direction = _D.FORWARD
            base = info.base_id if info is not None else base_request_id(
                remote_request_id if op is spans.NixlOp.READ else request_id)
            sc = info.parent() if info is not None else base
        block_ids = getattr(read_spec, "local_block_ids", None)
        tokens = info.tokens if info is not None else None
        if op is spans.NixlOp.WRITE:
            # push: the prefill's blocks pair with the blocks the decode registered, which are
            # only those it lacked (its prefix cache holds the rest): those are what moves
            block_ids = getattr(read_spec, "remote_block_ids", None) or block_ids
            tokens = pushed_tokens(tokens, block_ids, getattr(self, "block_size", None))
        attrs = {**transfer_attrs(base, direction, request_id), **request_attrs(info),
                 spans.NIXL_OP: op.value, spans.REMOTE_ENGINE_ID: str(dst_engine_id),
                 spans.BLOCKS: count_blocks(block_ids), spans.TOKENS: tokens}
        if self._kvt_hb_sent and role is _DEC and direction is _D.FORWARD:
            attrs[spans.PREFILL_LEASE_HEARTBEATS_SENT] = self._kvt_hb_sent.get(remote_request_id)
        return XferContext(sc, attrs, t, role)

    def _kvt_on_notified(self, notified: set[str]) -> None:
        for rid in notified:
            if rid in self._kvt_retained:
                info = self._kvt_retained[rid]
                self._kvt_notify(rid, _D.REVERSE, info.parent(), info.base_id, info, _DEC)
                self._kvt_retention_end(rid, spans.RetentionOutcome.REUSED)
            else:
                sc, base, info = self._kvt_forward_target_sc(rid)
                self._kvt_notify(rid, _D.FORWARD, sc, base, info, _P,
                                 lease=spans.PrefillLeaseOutcome.READ)
                self._kvt_reqs.pop(rid, None)

    def _kvt_on_expired(self, expired: set[str]) -> None:
        for rid in expired:
            if rid in self._kvt_retained:
                self._kvt_retention_end(rid, spans.RetentionOutcome.EXPIRED)
            else:
                sc, base, info = self._kvt_forward_target_sc(rid)
                self._kvt_notify(rid, _D.FORWARD, sc, base, info, _P, error=LEASE_EXPIRED,
                                 lease=spans.PrefillLeaseOutcome.EXPIRED)
                self._kvt_reqs.pop(rid, None)

    def _kvt_handshake_done(self, engine_id: str, start_ns: int, error: str | None) -> None:
        sc, attrs, role = self._kvt_hs_trigger.pop(engine_id, (None, {}, None))
        if sc is None:
            sc = derived_span_context(f"handshake:{self.engine_id}:{engine_id}")
        self._kvt.emit(_S.HANDSHAKE, sc, start_ns, now_ns(),
                       {**attrs, spans.REMOTE_ENGINE_ID: str(engine_id)}, error=error, role=role)

    def _kvt_on_shutdown(self) -> None:
        for rid in list(self._kvt_retained):
            self._kvt_retention_end(rid, spans.RetentionOutcome.RELEASED)
        for rid in list(self._kvt_holds):
            sc, base, info = self._kvt_forward_target_sc(rid)
            self._kvt_notify(rid, _D.FORWARD, sc, base, info, _P, error=LEASE_RELEASED,
                             lease=spans.PrefillLeaseOutcome.RELEASED)
        self._kvt.flush()

    # --- vLLM methods -----------------------------------------------------------------------
    @compat.overrides(_S.HANDSHAKE)
    def _nixl_handshake(self, host: str, port: int, remote_tp_size: int,
                        expected_engine_id: str, *args: Any, **kwargs: Any) -> Any:
        start = now_ns()
        try:
            result = super()._nixl_handshake(host, port, remote_tp_size, expected_engine_id,
                                             *args, **kwargs)
        except BaseException as exc:
            GUARD.run("worker.handshake", self._kvt_handshake_done, expected_engine_id, start,
                      type(exc).__name__)
            raise
        GUARD.run("worker.handshake", self._kvt_handshake_done, expected_engine_id, start, None)
        return result

    @compat.overrides(_S.RETENTION, _S.NOTIFY)
    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        if not self._reqs_to_send:
            return super()._reap_expired_send_leases(done_sending)
        before = set(done_sending)
        result = super()._reap_expired_send_leases(done_sending)
        if len(done_sending) != len(before):
            GUARD.run("worker.expired", self._kvt_on_expired, done_sending - before)
        return result

    @compat.overrides(_S.RETENTION)
    def shutdown(self) -> None:
        GUARD.run("worker.shutdown", self._kvt_on_shutdown)
        super().shutdown()


# Registered here rather than by a decorator on the method: the NIXL agent proxy and progress delay.
compat.overrides("NIXL agent proxy", "progress delay")(_WorkerHooks.__init__)


@compat.instrumented
class KvtunePullWorker(_WorkerHooks, NixlPullConnectorWorker):
    """vLLM's pull (READ) worker, plus kvtune's spans."""

    _KVT_MODE = spans.Mode.PULL

    @compat.overrides("metadata from scheduler", "kv.prefill_lease on kv.notify")
    def start_load_kv(self, metadata: Any) -> None:
        if getattr(metadata, "kvtune_reqs", None) or getattr(metadata, "kvtune_leases", None):
            GUARD.run("worker.metadata", self._kvt_on_metadata, metadata)
        result = super().start_load_kv(metadata)
        if metadata.reqs_to_send:
            GUARD.run("worker.prefill_lease", self._kvt_on_sends, metadata.reqs_to_send)
        return result

    @compat.overrides("kv.prefill_lease.heartbeats_sent on kv.rdma")
    def _send_heartbeats(self, metadata: Any) -> None:
        super()._send_heartbeats(metadata)
        if metadata.heartbeat_by_engine:
            GUARD.run("worker.heartbeats_sent", self._kvt_on_heartbeats_sent,
                      metadata.heartbeat_by_engine)

    @compat.overrides("kv.prefill_lease on kv.notify")
    def _handle_heartbeat(self, payload: str) -> None:
        super()._handle_heartbeat(payload)
        if self._kvt_holds:
            GUARD.run("worker.heartbeat", self._kvt_on_heartbeat, payload)

    @compat.overrides(_S.HANDSHAKE)
    def _background_nixl_handshake(self, req_id: str, remote_engine_id: str, meta: Any) -> None:
        GUARD.run("worker.handshake_trigger", self._kvt_pull_trigger, req_id, remote_engine_id,
                  meta)
        return super()._background_nixl_handshake(req_id, remote_engine_id, meta)

    def _kvt_pull_trigger(self, req_id: str, remote_engine_id: str, meta: Any) -> None:
        ctx = self._kvt_xfer_context(spans.NixlOp.READ, None, remote_engine_id, req_id,
                                     meta.remote.request_id)
        self._kvt_trigger_handshake(remote_engine_id, ctx.sc, ctx.attrs, ctx.role)

    @compat.overrides(_S.REUSE_DECISION)
    def _read_blocks_for_req(self, req_id: str, meta: Any) -> Any:
        self._kvt_cur_req = req_id
        try:
            return super()._read_blocks_for_req(req_id, meta)
        finally:
            self._kvt_cur_req = None

    @compat.overrides(_S.REUSE_DECISION)
    def _is_turn2_read_expired(self, meta: Any) -> bool:
        expired = super()._is_turn2_read_expired(meta)
        GUARD.run("worker.reuse_decision", self._kvt_on_turn2, meta, expired)
        return expired

    def _kvt_on_turn2(self, meta: Any, expired: bool) -> None:
        rid = self._kvt_cur_req
        info = self._kvt_reqs.get(rid) if rid is not None else None
        if self._kvt_leg(info, _DEC) is not _P:
            return  # the decode's own (forward) reads pass the same expiry check
        if info is None or info.mark_ns is None or info.remote_base_id is None:
            return
        base = info.remote_base_id or base_request_id(meta.remote.request_id)
        outcome = spans.ReuseOutcome.EXPIRED if expired else spans.ReuseOutcome.PULL
        self._kvt.emit(_S.REUSE_DECISION, info.remote_span_context(), info.mark_ns, now_ns(),
                       lambda: {**transfer_attrs(base, _D.REVERSE, rid), **request_attrs(info),
                                spans.REUSE_OUTCOME: outcome.value,
                                spans.REUSE_REMOTE_TOKENS: info.remote_tokens,
                                spans.REUSE_THRESHOLD_TOKENS: info.threshold_tokens}, role=_P)

    @compat.overrides(_S.DESCRIPTOR_SETUP, _S.RDMA)
    def _read_blocks(self, read_spec: Any, dst_engine_id: str, request_id: str,
                     remote_request_id: str, *args: Any, **kwargs: Any) -> bool:
        ctx = GUARD.run("worker.read", self._kvt_xfer_context, spans.NixlOp.READ, read_spec,
                        dst_engine_id, request_id, remote_request_id)
        tracker = getattr(self, "_kvt_xfers", None)
        if tracker is None:
            return super()._read_blocks(read_spec, dst_engine_id, request_id, remote_request_id,
                                        *args, **kwargs)
        tracker.begin(ctx)
        try:
            return super()._read_blocks(read_spec, dst_engine_id, request_id, remote_request_id,
                                        *args, **kwargs)
        finally:
            tracker.end()

    @compat.overrides(_S.NOTIFY, _S.RETENTION)
    def _get_new_notifs(self) -> set[str]:
        notified = super()._get_new_notifs()
        if notified:
            GUARD.run("worker.notify", self._kvt_on_notified, notified)
        return notified


@compat.instrumented
class KvtunePushWorker(_WorkerHooks, NixlPushConnectorWorker):
    """vLLM's push (WRITE) worker, plus kvtune's spans (some from the ``nixl-push-writer``
    thread; they carry their parent explicitly, so they keep it)."""

    _KVT_MODE = spans.Mode.PUSH

    def _kvt_init(self, emitter: Emitter) -> None:
        super()._kvt_init(emitter)
        self._kvt_reg_arrival: BoundedDict = BoundedDict()
        self._kvt_rendezvous_done: BoundedDict = BoundedDict()

    @compat.overrides("metadata from scheduler")
    def start_load_kv(self, metadata: Any) -> None:
        if getattr(metadata, "kvtune_reqs", None) or getattr(metadata, "kvtune_leases", None):
            GUARD.run("worker.metadata", self._kvt_on_metadata, metadata)
        return super().start_load_kv(metadata)

    # D side (writer thread): registration sent to the prefill.
    @compat.overrides(_S.HANDSHAKE)
    def _send_registration_to_p(self, req_id: str, reg_data: dict[str, Any]) -> None:
        GUARD.run("worker.handshake_trigger", self._kvt_reg_trigger, req_id, reg_data)
        return super()._send_registration_to_p(req_id, reg_data)

    def _kvt_reg_trigger(self, req_id: str, reg_data: dict[str, Any]) -> None:
        sc, base, info = self._kvt_forward_target_sc(req_id)
        self._kvt_trigger_handshake(str(reg_data[REMOTE_ENGINE_ID]), sc,
                                    transfer_attrs(base, _D.FORWARD, req_id), _DEC)

    @compat.overrides(_S.REGISTRATION)
    def _do_send_reg_notif(self, req_id: str, reg_data: dict[str, Any]) -> None:
        result = super()._do_send_reg_notif(req_id, reg_data)
        GUARD.run("worker.registration", self._kvt_on_registered, req_id, reg_data)
        return result

    def _kvt_on_registered(self, req_id: str, reg_data: dict[str, Any]) -> None:
        sc, base, info = self._kvt_forward_target_sc(req_id)
        start = info.mark_ns if info is not None and info.mark_ns is not None else now_ns()
        remote, blocks = str(reg_data.get(REMOTE_ENGINE_ID)), reg_data.get("local_block_ids")
        self._kvt.emit(_S.REGISTRATION, sc, start, now_ns(), lambda: {
            **transfer_attrs(base, _D.FORWARD, req_id), **request_attrs(info),
            spans.REMOTE_ENGINE_ID: remote, spans.BLOCKS: count_blocks(blocks),
            spans.TOKENS: info.tokens if info is not None else None}, role=_DEC)

    # P side (writer thread): registration received; rendezvous with the finished prefill.
    @compat.overrides(_S.RENDEZVOUS)
    def _handle_push_reg_notif(self, notif: bytes) -> None:
        GUARD.run("worker.registration_in", self._kvt_on_reg_notif, notif)
        return super()._handle_push_reg_notif(notif)

    def _kvt_on_reg_notif(self, notif: bytes) -> None:
        reg = msgspec.msgpack.decode(notif[len(PUSH_REG_NOTIF_PREFIX):])
        rid = reg.get("request_id") if isinstance(reg, dict) else None
        if isinstance(rid, str):
            self._kvt_reg_arrival[base_request_id(rid)] = now_ns()

    @compat.overrides(_S.RENDEZVOUS, _S.HANDSHAKE)
    def _do_start_push_kv(self, request_id: str, local_block_ids: Any,
                          registration_data: dict[str, Any]) -> None:
        GUARD.run("worker.rendezvous", self._kvt_on_rendezvous, request_id, registration_data)
        return super()._do_start_push_kv(request_id, local_block_ids, registration_data)

    def _kvt_on_rendezvous(self, request_id: str, reg: dict[str, Any]) -> None:
        if request_id in self._kvt_rendezvous_done:
            return  # re-driven after the handshake: the rendezvous already happened
        self._kvt_rendezvous_done[request_id] = True
        t = now_ns()
        sc, base, info = self._kvt_forward_target_sc(request_id)
        reg_ns = self._kvt_reg_arrival.pop(base, None)
        prefill_ns = info.mark_ns if info is not None else None
        arrivals = [(reg_ns, spans.FirstArrival.REGISTRATION), (prefill_ns, spans.FirstArrival.PREFILL)]
        known = sorted((ns, who) for ns, who in arrivals if ns is not None)
        start, first = known[0] if known else (t, None)
        attrs = {**transfer_attrs(base, _D.FORWARD, request_id), **request_attrs(info),
                 spans.REMOTE_ENGINE_ID: str(reg.get("decode_engine_id")),
                 spans.FIRST_ARRIVAL: first.value if first is not None else None}
        self._kvt.emit(_S.RENDEZVOUS, sc, start, t, attrs, role=_P)
        self._kvt_trigger_handshake(str(reg.get("decode_engine_id")), sc,
                                    transfer_attrs(base, _D.FORWARD, request_id), _P)

    @compat.overrides(_S.DESCRIPTOR_SETUP, _S.RDMA)
    def _xfer_blocks(self, read_spec: Any, dst_engine_id: str, request_id: str,
                     remote_request_id: str, *args: Any, **kwargs: Any) -> Any:
        ctx = GUARD.run("worker.write", self._kvt_xfer_context, spans.NixlOp.WRITE, read_spec,
                        dst_engine_id, request_id, remote_request_id)
        tracker = getattr(self, "_kvt_xfers", None)
        if tracker is None:
            return super()._xfer_blocks(read_spec, dst_engine_id, request_id, remote_request_id,
                                        *args, **kwargs)
        tracker.begin(ctx)
        try:
            return super()._xfer_blocks(read_spec, dst_engine_id, request_id, remote_request_id,
                                        *args, **kwargs)
        finally:
            tracker.end()

    # D side (engine thread): the prefill's WRITE completion notification.
    @compat.overrides(_S.NOTIFY)
    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()
        if results.finished_recving:
            GUARD.run("worker.notify", self._kvt_on_push_received, results)
        return results

    def _kvt_on_push_received(self, results: Any) -> None:
        failed = results.failed_recving or set()
        for rid in results.finished_recving:
            sc, base, info = self._kvt_forward_target_sc(rid)
            self._kvt_notify(rid, _D.FORWARD, sc, base, info, _DEC,
                             error="kv_recv_failed" if rid in failed else None)
            self._kvt_reqs.pop(rid, None)
