"""In-process tests of the connectors' observers with real NIXL agents and real CPU tensors.

Two NIXL agents (UCX) in this process stand for a prefill and a decode worker. The transfer path
(descriptor setup -> READ/WRITE -> completion) goes through ``ObservedNixlAgent``; the target-side
paths (completion notification, heartbeat, lease expiry of retained blocks) run vLLM's own
``NixlPullConnectorWorker`` methods on a kvtune worker whose NIXL agent is real.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtune import spans
from kvtune.connectors.ids import derived_span_context
from kvtune.connectors.nixl_agent import ObservedNixlAgent
from kvtune.connectors.observer import (
    Emitter,
    HookGuard,
    ReqTrace,
    TransferTracker,
    XferContext,
    transfer_attrs,
)

pytestmark = pytest.mark.nixl

torch = pytest.importorskip("torch")
nixl_api = pytest.importorskip("nixl._api")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

N_BLOCKS = 8
BLOCK_BYTES = 4096
WAIT_S = 60.0
"""Bound on waiting for a local NIXL completion or notification (busy 2-core machine)."""


def _wait_for(fn: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"timed out after {WAIT_S:.0f} s waiting for {what}")


class Peer:
    """One NIXL agent with a registered CPU tensor of N_BLOCKS blocks."""

    def __init__(self, tag: str, fill: int | None) -> None:
        self.name = f"kvt-test-{tag}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.agent = nixl_api.nixl_agent(
            self.name, nixl_api.nixl_agent_config(backends=["UCX"], capture_telemetry=True))
        if fill is None:
            self.kv = torch.zeros(N_BLOCKS * BLOCK_BYTES, dtype=torch.uint8)
        else:
            self.kv = (torch.arange(N_BLOCKS * BLOCK_BYTES) % 251 + fill).to(torch.uint8)
        self.reg = self.agent.register_memory(
            [(self.kv.data_ptr(), self.kv.numel(), 0, "")], "DRAM")

    def blocks(self) -> list[tuple[int, int, int]]:
        base = self.kv.data_ptr()
        return [(base + i * BLOCK_BYTES, BLOCK_BYTES, 0) for i in range(N_BLOCKS)]

    def block(self, i: int) -> Any:
        return self.kv[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES]


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[Peer, Peer, Any, Any]]:
    """(initiator, target, local dlist handle, remote dlist handle) with metadata exchanged."""
    init, target = Peer("init", None), Peer("target", 7)
    init.agent.add_remote_agent(target.agent.get_agent_metadata())
    target.agent.add_remote_agent(init.agent.get_agent_metadata())
    local = init.agent.prep_xfer_dlist("NIXL_INIT_AGENT", init.blocks(), "DRAM")
    remote = init.agent.prep_xfer_dlist(target.name, target.blocks(), "DRAM")
    yield init, target, local, remote
    for p in (init, target):
        p.agent.deregister_memory(p.reg)


@pytest.fixture()
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def _emitter(exporter: InMemorySpanExporter, role: spans.Role | None,
             mode: spans.Mode) -> Emitter:
    """``role`` None: a ``kv_both`` engine's (each span's role is its request's leg)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Emitter(role, mode, f"engine-{role.value if role else 'both'}", tp_rank=0,
                   tracer=provider.get_tracer("test"))


def _by_name(exporter: InMemorySpanExporter) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = defaultdict(list)
    for s in exporter.get_finished_spans():
        out[s.name].append(s)
    return out


def _drive_transfer(agent: Any, local: Any, remote: Any, local_ids: list[int],
                    remote_ids: list[int], op: str = "READ") -> str:
    """vLLM's sequence: make_prepped_xfer, transfer, poll check_xfer_state, telemetry, release."""
    handle = agent.make_prepped_xfer(op, local, local_ids, remote, remote_ids, notif_msg=b"")
    agent.transfer(handle)
    state = _wait_for(lambda: (s := agent.check_xfer_state(handle)) != "PROC" and s,
                      "NIXL transfer completion")
    if state == "DONE":
        agent.get_xfer_telemetry(handle)
    agent.release_xfer_handle(handle)
    return state


def test_read_emits_descriptor_setup_and_rdma_with_nixl_telemetry(
        peers: tuple[Peer, Peer, Any, Any], exporter: InMemorySpanExporter) -> None:
    init, target, local, remote = peers
    tracker = TransferTracker(_emitter(exporter, spans.Role.DECODE, spans.Mode.PULL))
    agent = ObservedNixlAgent(init.agent, tracker)
    sc = derived_span_context("req-read")
    attrs = transfer_attrs("req-read", spans.Direction.FORWARD, "cmpl-req-read-0-0000abcd",
                           **{spans.NIXL_OP: spans.NixlOp.READ.value, spans.BLOCKS: 3})
    tracker.begin(XferContext(sc, attrs, time.time_ns()))
    try:
        state = _drive_transfer(agent, local, remote, [0, 1, 2], [5, 6, 7])
    finally:
        tracker.end()
    assert state == "DONE"
    for i, j in ((0, 5), (1, 6), (2, 7)):  # the bytes really moved
        assert torch.equal(init.block(i), target.block(j))

    got = _by_name(exporter)
    (setup,) = got[spans.SpanName.DESCRIPTOR_SETUP.value]
    (rdma,) = got[spans.SpanName.RDMA.value]
    tid = spans.transfer_id("req-read", spans.Direction.FORWARD)
    for s in (setup, rdma):
        assert s.context.trace_id == sc.trace_id and s.parent.span_id == sc.span_id
        assert s.attributes[spans.TRANSFER_ID] == tid
        assert s.attributes[spans.NIXL_OP] == spans.NixlOp.READ.value
    assert setup.end_time <= rdma.start_time <= rdma.end_time
    a = rdma.attributes
    assert a[spans.NIXL_STATUS] == "DONE"
    assert a[spans.BYTES] == 3 * BLOCK_BYTES
    assert a[spans.DESCRIPTORS] >= 1
    assert a[spans.NIXL_POST_US] >= 0.0 and a[spans.NIXL_XFER_US] >= 0.0
    assert tracker.pending_count() == 0


def test_untracked_transfers_and_host_errors_pass_through(
        peers: tuple[Peer, Peer, Any, Any], exporter: InMemorySpanExporter) -> None:
    init, _, local, remote = peers
    tracker = TransferTracker(_emitter(exporter, spans.Role.DECODE, spans.Mode.PULL))
    agent = ObservedNixlAgent(init.agent, tracker)
    # No transfer context: NIXL works as usual and nothing is tracked.
    assert _drive_transfer(agent, local, remote, [3], [3]) == "DONE"
    assert exporter.get_finished_spans() == () and tracker.pending_count() == 0
    # The host's own error (a descriptor index out of range) reaches the caller unchanged.
    with pytest.raises(Exception) as raw:
        init.agent.make_prepped_xfer("READ", local, [0], remote, [N_BLOCKS + 100])
    tracker.begin(XferContext(derived_span_context("bad"), {}, time.time_ns()))
    try:
        with pytest.raises(type(raw.value)):
            agent.make_prepped_xfer("READ", local, [0], remote, [N_BLOCKS + 100])
    finally:
        tracker.end()
    assert exporter.get_finished_spans() == ()
    assert agent.wrapped is init.agent and agent.name == init.agent.name


def test_write_completes_when_a_hook_raises_and_warns_once(
        peers: tuple[Peer, Peer, Any, Any], exporter: InMemorySpanExporter,
        caplog: pytest.LogCaptureFixture) -> None:
    init, target, local, remote = peers
    guard = HookGuard(logger=logging.getLogger("kvtune.test.nixl"),
                      fail_hooks=("nixl.prepared", "nixl.telemetry"))
    tracker = TransferTracker(_emitter(exporter, spans.Role.PREFILL, spans.Mode.PUSH), guard)
    agent = ObservedNixlAgent(init.agent, tracker, guard)
    init.kv.fill_(42)
    with caplog.at_level(logging.WARNING, logger="kvtune.test.nixl"):
        for block in (4, 5):
            tracker.begin(XferContext(derived_span_context("w"), {}, time.time_ns()))
            try:
                assert _drive_transfer(agent, local, remote, [block], [block], op="WRITE") == "DONE"
            finally:
                tracker.end()
    for block in (4, 5):
        assert bool((target.block(block) == 42).all())
    assert len([r for r in caplog.records if r.name == "kvtune.test.nixl"]) == 1
    assert guard.failures == 4
    assert exporter.get_finished_spans() == ()  # the failed hooks made no half-spans


# --- vLLM's pull worker, target side, with a real NIXL agent ----------------------------------
@pytest.fixture()
def worker_factory(exporter: InMemorySpanExporter) -> Callable[..., Any]:
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    from kvtune.connectors.worker import KvtunePullWorker

    def make(agent: Any, role: spans.Role, mode: spans.Mode) -> Any:
        # The state vLLM's target-side methods use (what NixlBaseConnectorWorker.__init__ sets).
        w = object.__new__(KvtunePullWorker)
        w.nixl_wrapper = agent
        w.transfer_topo = object()
        w._reqs_to_send = {}
        w._reqs_to_process = set()
        w.consumer_notification_counts_by_req = defaultdict(int)
        w.expected_consumer_notifications_by_req = {}
        w.xfer_stats = NixlKVConnectorStats()
        w._lease_extension = 30
        w.engine_id = f"engine-{role.value if role else 'both'}"
        w._remote_agents = {}
        w._kvt_init(_emitter(exporter, role, mode))  # what _kvt_setup does from the config
        return w

    return make


def test_notification_heartbeat_and_completion_on_the_prefill(
        peers: tuple[Peer, Peer, Any, Any], worker_factory: Callable[..., Any],
        exporter: InMemorySpanExporter) -> None:
    init, target, _, _ = peers
    w = worker_factory(target.agent, spans.Role.PREFILL, spans.Mode.PULL)
    rid = "cmpl-hb1-0-1a2b3c4d"
    w._reqs_to_process.add(rid)
    w._reqs_to_send[rid] = time.perf_counter() + 5.0
    before = w._reqs_to_send[rid]

    init.agent.send_notif(target.name, f"HB:{rid}".encode())  # the decode's lease heartbeat
    _wait_for(lambda: w._get_new_notifs() == set() and w._reqs_to_send[rid] > before,
              "heartbeat to extend the lease")
    assert exporter.get_finished_spans() == ()  # a heartbeat is not a completion

    init.agent.send_notif(target.name, f"{rid}:1".encode())  # the decode finished reading
    notified: set[str] = set()
    _wait_for(lambda: notified.update(w._get_new_notifs()) or rid in notified,
              "completion notification")
    assert rid not in w._reqs_to_send  # vLLM released the lease as usual
    (notify,) = exporter.get_finished_spans()
    assert notify.name == spans.SpanName.NOTIFY.value
    assert notify.attributes[spans.TRANSFER_ID] == spans.transfer_id("hb1", spans.Direction.FORWARD)
    assert notify.attributes[spans.ROLE] == spans.Role.PREFILL.value
    assert notify.context.trace_id == derived_span_context("hb1").trace_id
    assert notify.start_time == notify.end_time  # point-like


def test_retained_blocks_expire_then_emit_retention(
        worker_factory: Callable[..., Any], exporter: InMemorySpanExporter,
        peers: tuple[Peer, Peer, Any, Any]) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    _, target, _, _ = peers
    w = worker_factory(target.agent, spans.Role.DECODE, spans.Mode.BIDIRECTIONAL)
    kept, reused = "cmpl-conv1-0-11111111", "cmpl-conv2-0-22222222"
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    meta = NixlConnectorMetadata()
    t0 = time.time_ns()
    meta.kvtune_reqs = {
        kept: ReqTrace(kept, "conv1", tp, conversation_id="c-1", turn=1, tokens=48, mark_ns=t0,
                       ttl_s=0.5),
        reused: ReqTrace(reused, "conv2", tp, tokens=16, mark_ns=t0, ttl_s=0.5),
    }
    w._kvt_on_metadata(meta)
    now = time.perf_counter()
    for rid in (kept, reused):
        w._reqs_to_process.add(rid)
    w._reqs_to_send[kept] = now - 0.01          # TTL ran out
    w._reqs_to_send[reused] = now + 60.0

    done: set[str] = set()
    w._reap_expired_send_leases(done)            # vLLM's own reaping
    assert done == {kept} and kept not in w._reqs_to_send

    w._kvt_on_notified({reused})                 # the prefill read the other one back
    got = _by_name(exporter)
    ret = {s.attributes[spans.RETENTION_OUTCOME]: s for s in got[spans.SpanName.RETENTION.value]}
    assert set(ret) == {spans.RetentionOutcome.EXPIRED.value, spans.RetentionOutcome.REUSED.value}
    expired = ret[spans.RetentionOutcome.EXPIRED.value]
    assert expired.attributes[spans.RETENTION_TTL_S] == 0.5
    assert expired.attributes[spans.TRANSFER_ID] == spans.transfer_id("conv1",
                                                                      spans.Direction.REVERSE)
    assert expired.attributes[spans.CONVERSATION_ID] == "c-1" and expired.attributes[spans.TURN] == 1
    assert expired.start_time == t0 and f"{expired.context.trace_id:032x}" in tp
    (notify,) = got[spans.SpanName.NOTIFY.value]
    assert notify.attributes[spans.DIRECTION] == spans.Direction.REVERSE.value
    assert notify.attributes[spans.TRANSFER_ID] == spans.transfer_id("conv2",
                                                                     spans.Direction.REVERSE)


def test_prefill_lease_expiry_is_a_failed_notify(
        worker_factory: Callable[..., Any], exporter: InMemorySpanExporter,
        peers: tuple[Peer, Peer, Any, Any]) -> None:
    from kvtune.connectors.worker import LEASE_EXPIRED

    _, target, _, _ = peers
    w = worker_factory(target.agent, spans.Role.PREFILL, spans.Mode.PULL)
    rid = "cmpl-lost-0-33333333"
    w._reqs_to_process.add(rid)
    w._reqs_to_send[rid] = time.perf_counter() - 1.0
    done: set[str] = set()
    w._reap_expired_send_leases(done)
    assert done == {rid}
    (span,) = exporter.get_finished_spans()
    assert span.name == spans.SpanName.NOTIFY.value
    assert span.attributes[spans.ERROR_TYPE] == LEASE_EXPIRED and not span.status.is_ok


def test_prefill_lease_hold_carries_renewals_and_how_it_ended(
        peers: tuple[Peer, Peer, Any, Any], worker_factory: Callable[..., Any],
        exporter: InMemorySpanExporter) -> None:
    """vLLM's start_load_kv takes three finished requests' leases; a heartbeat renews one twice;
    one is read, one expires, one is still held at shutdown: each kv.notify says which."""
    import queue

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    from kvtune.connectors.worker import LEASE_EXPIRED, LEASE_RELEASED

    init, target, _, _ = peers
    w = worker_factory(target.agent, spans.Role.PREFILL, spans.Mode.PULL)
    w._kvt_lease_s = 30.0
    w.pcp_rank, w.pcp_dcp_sharded = 0, False
    w._ready_requests = queue.Queue()
    w._recving_metadata = {}
    read, lost, kept = "cmpl-rd-0-11111111", "cmpl-ex-0-22222222", "cmpl-sd-0-33333333"
    meta = NixlConnectorMetadata()
    now = time.perf_counter()
    meta.reqs_in_batch = {read, lost, kept}
    meta.reqs_to_send = {read: now + 30.0, lost: now + 0.05, kept: now + 30.0}
    w.start_load_kv(meta)                         # vLLM's own: the leases start
    assert set(w._reqs_to_send) == {read, lost, kept}

    w._lease_extension = 40                       # each heartbeat: expiry >= now + 40 s
    for _ in range(2):                            # the decode's heartbeats name `read`
        before = w._reqs_to_send[read]
        init.agent.send_notif(target.name, f"HB:{read}".encode())
        _wait_for(lambda: w._get_new_notifs() == set() and w._reqs_to_send[read] > before,
                  "heartbeat to extend the lease")

    init.agent.send_notif(target.name, f"{read}:1".encode())
    notified: set[str] = set()
    _wait_for(lambda: notified.update(w._get_new_notifs()) or read in notified, "read notified")
    while time.perf_counter() <= now + 0.05:     # `lost`'s lease runs out unrenewed
        time.sleep(0.01)
    done: set[str] = set()
    w._reap_expired_send_leases(done)             # vLLM's own reaping
    assert done == {lost}
    w._kvt_on_shutdown()

    got = {s.attributes[spans.REQUEST_ID]: s for s in _by_name(exporter)[spans.SpanName.NOTIFY.value]}
    assert set(got) == {read, lost, kept}
    r, e, k = got[read].attributes, got[lost].attributes, got[kept].attributes
    assert r[spans.PREFILL_LEASE_OUTCOME] == spans.PrefillLeaseOutcome.READ.value
    assert r[spans.PREFILL_LEASE_RENEWALS] == 2 and r[spans.PREFILL_LEASE_S] == 30.0
    assert 30.0 < r[spans.PREFILL_LEASE_MARGIN_S] <= 40.0  # the renewed expiry, not the first
    assert spans.ERROR_TYPE not in r
    assert e[spans.PREFILL_LEASE_OUTCOME] == spans.PrefillLeaseOutcome.EXPIRED.value
    assert e[spans.PREFILL_LEASE_RENEWALS] == 0 and e[spans.PREFILL_LEASE_MARGIN_S] <= 0
    assert e[spans.ERROR_TYPE] == LEASE_EXPIRED
    assert k[spans.PREFILL_LEASE_OUTCOME] == spans.PrefillLeaseOutcome.RELEASED.value
    assert k[spans.ERROR_TYPE] == LEASE_RELEASED
    assert r[spans.PREFILL_LEASE_HELD_S] <= e[spans.PREFILL_LEASE_HELD_S] \
        <= k[spans.PREFILL_LEASE_HELD_S]
    assert w._kvt_holds == {}


def test_decode_counts_the_heartbeats_it_sent_on_its_read(
        peers: tuple[Peer, Peer, Any, Any], worker_factory: Callable[..., Any],
        exporter: InMemorySpanExporter) -> None:
    """vLLM's _send_heartbeats sends to engines it has handshaken with and skips the others; the
    decode's forward READ context then carries how many named the prefill's request."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        HeartbeatInfo,
        NixlConnectorMetadata,
    )

    init, target, _, _ = peers
    w = worker_factory(init.agent, spans.Role.DECODE, spans.Mode.PULL)
    w._remote_agents = {"eng-p": {0: target.name}}
    w._hb_handshake_notif_only = False
    w._engine_last_active = {}
    w._ensure_handshake = lambda engine_id, *a: None if engine_id == "eng-p" else object()
    waiting, other = "cmpl-wait-0-44444444", "cmpl-far-0-55555555"
    for _ in range(3):
        meta = NixlConnectorMetadata()
        meta.heartbeat_by_engine = {
            "eng-p": HeartbeatInfo(req_ids={waiting}, host="127.0.0.1", port=1, tp_size=1),
            "eng-q": HeartbeatInfo(req_ids={other}, host="127.0.0.1", port=2, tp_size=1)}
        w._send_heartbeats(meta)                  # vLLM's own: eng-q's handshake is pending
    got: list[bytes] = []
    _wait_for(lambda: got.extend(m for ms in target.agent.get_new_notifs().values() for m in ms)
              or len(got) >= 3, "the heartbeats at the prefill")
    assert got == [f"HB:{waiting}".encode()] * 3

    ctx = w._kvt_xfer_context(spans.NixlOp.READ, None, "eng-p", "local-1", waiting)
    assert ctx.attrs[spans.PREFILL_LEASE_HEARTBEATS_SENT] == 3
    far = w._kvt_xfer_context(spans.NixlOp.READ, None, "eng-q", "local-2", other)
    assert far.attrs[spans.PREFILL_LEASE_HEARTBEATS_SENT] is None  # never sent: left out


def test_turn2_expiry_check_decides_pull_or_expired_only_on_the_prefill(
        worker_factory: Callable[..., Any], exporter: InMemorySpanExporter,
        peers: tuple[Peer, Peer, Any, Any]) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta

    _, target, _, _ = peers
    rid = "cmpl-turn2-0-77777777"
    meta = ReqMeta(local_block_ids=([1],), local_physical_block_ids=([1],), tp_size=1,
                   remote=RemoteMeta(block_ids=([4],), host="127.0.0.1", port=1,
                                     engine_id="eng-d", request_id="cmpl-turn1-0-88888888"))
    info = ReqTrace(rid, "turn2", "", remote_base_id="turn1", mark_ns=time.time_ns(),
                    remote_tokens=150, threshold_tokens=64)
    outcomes = []
    for role in (spans.Role.DECODE, spans.Role.PREFILL, spans.Role.PREFILL):
        w = worker_factory(target.agent, role, spans.Mode.BIDIRECTIONAL)
        w._kvt_reqs[rid] = info
        w._kvt_cur_req = rid  # as inside vLLM's _read_blocks_for_req
        expired = len(outcomes) == 2
        w._kvt_on_turn2(meta, expired)
        outcomes.append(expired)
    got = [s for s in exporter.get_finished_spans()]
    assert [s.attributes[spans.REUSE_OUTCOME] for s in got] == [
        spans.ReuseOutcome.PULL.value, spans.ReuseOutcome.EXPIRED.value]  # none from the decode
    for s in got:
        assert s.attributes[spans.ROLE] == spans.Role.PREFILL.value
        assert s.attributes[spans.TRANSFER_ID] == spans.transfer_id("turn1", spans.Direction.REVERSE)
        assert s.context.trace_id == derived_span_context("turn1").trace_id
        assert s.attributes[spans.REUSE_REMOTE_TOKENS] == 150


def test_push_decode_notifies_once_every_producer_rank_wrote(
        peers: tuple[Peer, Peer, Any, Any], exporter: InMemorySpanExporter) -> None:
    """Push decode: vLLM's own notification accounting (rewritten in 0.33) reports the request
    received only after one completion notification per producer rank; kvtune's ``kv.notify``
    (fed by what ``get_transfer_results`` reports as received) comes once, then."""
    pytest.importorskip("vllm")
    import queue
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    from kvtune.connectors.worker import KvtunePushWorker

    init, target, _, _ = peers
    # The state vLLM's push-decode accounting uses (what its __init__ sets), decode TP 1.
    w = object.__new__(KvtunePushWorker)
    w.nixl_wrapper = target.agent
    w.transfer_topo = object()
    w.world_size = 1
    w._pending_completion_notifs = queue.Queue()
    w._recving_metadata = {}
    w._recving_transfers = {}
    w._reqs_to_send = {}
    w._reqs_to_process = set()
    w.consumer_notification_counts_by_req = defaultdict(int)
    w.xfer_stats = NixlKVConnectorStats()
    w.engine_id = "engine-decode"
    w._remote_agents = {}
    w._kvt_init(_emitter(exporter, spans.Role.DECODE, spans.Mode.PUSH))
    rid = "cmpl-pushed-0-55555555"
    w._recving_metadata[rid] = SimpleNamespace(pp_size=1)
    w._kvt_reqs[rid] = ReqTrace(rid, "pushed", "", tokens=32)
    received: set[str] = set()

    def engine_step() -> set[str]:
        # The nixl-push-writer thread forwards completion notifications to the engine thread,
        # whose get_transfer_results drains them, then pops the finished receives.
        for msgs in w.nixl_wrapper.get_new_notifs().values():
            for m in msgs:
                if m.startswith(rid.encode()):  # (not other tests' leftovers on this agent)
                    w._pending_completion_notifs.put(m)
        w._get_new_notifs()
        done, _failed = w._pop_done_transfers(w._recving_transfers)
        if done:
            received.update(done)
            w._kvt_on_push_received(SimpleNamespace(finished_recving=done, failed_recving=set()))
        return done

    # A TP-2 prefill writes into this TP-1 decode: one notification from each of its ranks.
    init.agent.send_notif(target.name, f"{rid}:2".encode())
    _wait_for(lambda: engine_step() or w.consumer_notification_counts_by_req.get(rid) == 1,
              "the first producer rank's notification")
    assert received == set() and exporter.get_finished_spans() == ()
    init.agent.send_notif(target.name, f"{rid}:2".encode())
    _wait_for(lambda: engine_step() or received, "the second producer rank's notification")
    assert received == {rid} and rid not in w.consumer_notification_counts_by_req
    (notify,) = exporter.get_finished_spans()
    assert notify.name == spans.SpanName.NOTIFY.value
    assert notify.attributes[spans.TRANSFER_ID] == spans.transfer_id("pushed",
                                                                     spans.Direction.FORWARD)
    assert notify.attributes[spans.ROLE] == spans.Role.DECODE.value
    assert notify.attributes[spans.TOKENS] == 32 and notify.status.is_ok


def test_kv_both_worker_gives_each_span_the_role_of_its_requests_leg(
        worker_factory: Callable[..., Any], exporter: InMemorySpanExporter,
        peers: tuple[Peer, Peer, Any, Any]) -> None:
    """A ``kv_both`` engine serving both legs of a bidirectional pair at once: the worker-side
    spans carry the leg the scheduler side told it (``ReqTrace.leg``), or the only one they can
    have, and match what a prefill and a decode engine make of the same calls."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlConnectorMetadata, RemoteMeta, ReqMeta,
    )

    _, target, _, _ = peers
    P, D = spans.Role.PREFILL, spans.Role.DECODE
    t0 = time.time_ns()
    retained, served, pulling, reading = ("cmpl-kr-0-11111111", "cmpl-ks-0-22222222",
                                          "cmpl-kp-0-33333333", "cmpl-kd-0-44444444")
    infos = {
        retained: ReqTrace(retained, "kr", "", tokens=48, mark_ns=t0, ttl_s=60.0, leg=D),
        served: ReqTrace(served, "ks", "", tokens=64, leg=P),
        pulling: ReqTrace(pulling, "kp", "", remote_base_id="kr", mark_ns=t0, tokens=48,
                          remote_tokens=48, threshold_tokens=1, leg=P),
        reading: ReqTrace(reading, "kd", "", tokens=96, leg=D),
    }
    spec = ReqMeta(local_block_ids=([1, 2],), local_physical_block_ids=([1, 2],), tp_size=1,
                   remote=RemoteMeta(block_ids=([4, 5],), host="127.0.0.1", port=1,
                                     engine_id="eng-x", request_id="cmpl-kr-0-55555555"))

    def drive(w: Any, rids: set[str]) -> dict[tuple[str, str], str]:
        """The worker-side events of ``rids``: {(span, direction): role}."""
        meta = NixlConnectorMetadata()
        meta.kvtune_reqs = {r: infos[r] for r in rids}
        w._kvt_on_metadata(meta)
        w._kvt_on_notified(rids & {retained, served})  # the reverse read back; the forward read
        if pulling in rids:
            w._kvt_cur_req = pulling
            w._kvt_on_turn2(spec, False)  # the prefill pulls the history
            w._kvt_cur_req = None
        for rid in rids & {pulling, reading}:
            ctx = w._kvt_xfer_context(spans.NixlOp.READ, spec, "eng-x", rid, "cmpl-kr-0-55555555")
            w._kvt_xfers.begin(ctx)
            w._kvt_xfers.prepared(object(), 2)  # descriptors prepared for this READ
            w._kvt_xfers.end()
        out = {(s.name, s.attributes[spans.DIRECTION]): s.attributes[spans.ROLE]
               for s in exporter.get_finished_spans()}
        exporter.clear()
        return out

    both = drive(worker_factory(target.agent, None, spans.Mode.BIDIRECTIONAL), set(infos))
    S, F, R = spans.SpanName, spans.Direction.FORWARD.value, spans.Direction.REVERSE.value
    assert both == {(S.NOTIFY.value, R): D.value, (S.RETENTION.value, R): D.value,
                    (S.NOTIFY.value, F): P.value, (S.REUSE_DECISION.value, R): P.value,
                    (S.DESCRIPTOR_SETUP.value, R): P.value, (S.DESCRIPTOR_SETUP.value, F): D.value}
    prefill = drive(worker_factory(target.agent, P, spans.Mode.BIDIRECTIONAL), {served, pulling})
    decode = drive(worker_factory(target.agent, D, spans.Mode.BIDIRECTIONAL), {retained, reading})
    assert both == {**prefill, **decode}
