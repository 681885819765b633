"""The renewable decode lease, decode side: :class:`LeaseBook`'s bookkeeping, the loopback channel
(a real socket), the settings, and - with vLLM's real scheduler and worker classes, no engine -
how renewals reach vLLM's ``reqs_to_send`` and the ``kv.retention`` span."""
from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from kvtune import spans, vllm_pd as pd
from kvtune.connectors.lease import (
    MAX_ID_CHARS, MAX_LINE_BYTES, RENEW_GUARD_S, LeaseBook, LeaseChannel, LeaseNote,
    handle_line, lease_settings,
)


class _Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture()
def clock() -> _Clock:
    return _Clock()


@pytest.fixture()
def book(clock: _Clock) -> LeaseBook:
    return LeaseBook(60.0, clock=clock)


# --- bookkeeping ----------------------------------------------------------------------------------
def test_renewal_extends_from_now_and_reaches_the_next_metadata(book: LeaseBook,
                                                                clock: _Clock) -> None:
    book.hold("r1", clock.t + 30)
    assert book.pending
    deadlines, notes = book.drain()
    assert deadlines == {} and notes == {"r1": LeaseNote(0, None, False)}
    assert not book.pending
    clock.t += 20  # 10 s left
    reply = book.renew("r1", 45)
    assert reply.ok and reply.expiry == clock.t + 45 and reply.now == clock.t
    deadlines, notes = book.drain()
    assert deadlines == {"r1": clock.t + 45}
    assert notes == {"r1": LeaseNote(1, 45.0, False)}
    assert book.drain() == ({}, {})


def test_renewal_never_shortens_the_deadline(book: LeaseBook, clock: _Clock) -> None:
    book.hold("r1", clock.t + 50)
    reply = book.renew("r1", 10)
    assert reply.ok and reply.expiry == clock.t + 50


@pytest.mark.parametrize("lease_s", [0, -1, math.nan, math.inf, True, "10", None])
def test_renewal_refuses_lengths_out_of_range(book: LeaseBook, clock: _Clock,
                                              lease_s: Any) -> None:
    book.hold("r1", clock.t + 30)
    reply = book.renew("r1", lease_s)
    assert not reply.ok and reply.error == "bad_request" and pd.LEASE_S in reply.detail
    assert book.held() == {"r1": clock.t + 30}


def test_renewal_longer_than_the_decodes_maximum_gets_the_maximum(book: LeaseBook,
                                                                   clock: _Clock) -> None:
    book.hold("r1", clock.t + 30)
    reply = book.renew("r1", 3600)
    assert reply.ok and reply.expiry == clock.t + 60
    assert book.drain()[1]["r1"] == LeaseNote(1, 60.0, False)


def test_renewal_is_refused_once_the_deadline_is_within_the_guard(book: LeaseBook,
                                                                  clock: _Clock) -> None:
    book.hold("r1", clock.t + RENEW_GUARD_S - 0.1)
    reply = book.renew("r1", 30)
    assert not reply.ok and reply.error == "lapsing"
    assert book.held()["r1"] == clock.t + RENEW_GUARD_S - 0.1


def test_unknown_and_freed_requests_are_refused(book: LeaseBook, clock: _Clock) -> None:
    assert book.renew("nope", 10).error == "unknown_request"
    assert book.release("nope").error == "unknown_request"
    book.hold("r1", clock.t + 30)
    book.gone({"r1"})
    assert book.renew("r1", 10).error == "unknown_request"
    assert book.drain() == ({}, {})  # the hold's note went with it


def test_release_expires_now_once_and_refuses_later_renewals(book: LeaseBook,
                                                             clock: _Clock) -> None:
    book.hold("r1", clock.t + 30)
    assert book.renew("r1", 30).ok
    book.drain()
    clock.t += 1
    first = book.release("r1")
    assert first.ok and first.expiry == clock.t
    assert book.drain() == ({"r1": clock.t}, {"r1": LeaseNote(1, 30.0, True)})
    clock.t += 1
    again = book.release("r1")
    assert again.ok and again.expiry == clock.t - 1  # idempotent: nothing new to ship
    assert book.drain() == ({}, {})
    late = book.renew("r1", 30)
    assert not late.ok and late.error == "released"


# --- wire -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("line, error, words", [
    (b"not json", "bad_request", "JSON"),
    (b"[1, 2]", "bad_request", "object"),
    (b'{"op": "steal"}', "bad_request", pd.LEASE_OP),
    (b'{"op": "renew", "lease_s": 5}', "bad_request", pd.LEASE_ID),
    (json.dumps({"op": "renew", "id": "x" * (MAX_ID_CHARS + 1), "lease_s": 5}).encode(),
     "bad_request", pd.LEASE_ID),
    (b'{"op": "renew", "id": "r1", "lease_s": NaN}', "bad_request", pd.LEASE_S),
    (b"\xff\xfe", "bad_request", "JSON"),
    (b"{" + b" " * MAX_LINE_BYTES + b"}", "too_large", str(MAX_LINE_BYTES)),
])
def test_bad_lines_get_a_clear_error(book: LeaseBook, clock: _Clock, line: bytes, error: str,
                                     words: str) -> None:
    book.hold("r1", clock.t + 30)
    reply = handle_line(book, line)
    assert reply[pd.LEASE_OK] is False and reply[pd.LEASE_ERROR] == error, reply
    assert words in reply[pd.LEASE_DETAIL]
    assert book.held() == {"r1": clock.t + 30}


def test_hello_says_the_clock_and_the_longest_lease(book: LeaseBook, clock: _Clock) -> None:
    assert handle_line(book, b'{"op": "hello"}') == {
        pd.LEASE_OK: True, pd.LEASE_NOW: clock.t, pd.LEASE_MAX_LEASE_S: 60.0}


@pytest.fixture()
def channel() -> Iterator[LeaseChannel]:
    ch = LeaseChannel(LeaseBook(60.0), 0)
    try:
        yield ch
    finally:
        ch.close()


def _exchange(port: int, payload: bytes, n_replies: int) -> list[dict[str, Any]]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        f = s.makefile("rb")
        return [json.loads(f.readline()) for _ in range(n_replies)]


def test_channel_serves_lines_on_loopback_over_one_connection(channel: LeaseChannel) -> None:
    assert channel.port > 0
    channel.book.hold("r1", channel.book.now() + 30)
    renew, release, late = _exchange(channel.port, b"".join(json.dumps(m).encode() + b"\n" for m in (
        {"op": "renew", "id": "r1", "lease_s": 40}, {"op": "release", "id": "r1"},
        {"op": "renew", "id": "r1", "lease_s": 40})), 3)
    assert renew[pd.LEASE_OK] and renew[pd.LEASE_EXPIRY] > renew[pd.LEASE_NOW] + 39
    assert release[pd.LEASE_OK] and release[pd.LEASE_EXPIRY] <= renew[pd.LEASE_EXPIRY]
    assert late == {pd.LEASE_OK: False, pd.LEASE_ERROR: "released",
                    pd.LEASE_DETAIL: late[pd.LEASE_DETAIL]}


def test_channel_answers_an_over_long_line_and_closes(channel: LeaseChannel) -> None:
    with socket.create_connection(("127.0.0.1", channel.port), timeout=5) as s:
        s.sendall(b"x" * (4 * MAX_LINE_BYTES) + b"\n")
        f = s.makefile("rb")
        reply = json.loads(f.readline())
        assert reply[pd.LEASE_ERROR] == "too_large"
        assert f.readline() == b""  # closed: the rest of the line is not read


def test_channel_binds_loopback_only(channel: LeaseChannel) -> None:
    assert channel._server.server_address[0] == "127.0.0.1"


# --- settings -------------------------------------------------------------------------------------
def test_settings_off_by_default_and_checked() -> None:
    assert lease_settings(None, 480) is None
    assert lease_settings({pd.DECODER_KV_BLOCKS_TTL: 30}, 30) is None
    assert lease_settings({pd.LEASE_PORT: 0}, 30) == (0, 30.0)
    assert lease_settings({pd.LEASE_PORT: "7000", pd.LEASE_MAX_S: 120}, 30) == (7000, 120.0)
    for bad in ({pd.LEASE_PORT: 70000}, {pd.LEASE_PORT: True}, {pd.LEASE_PORT: "x"}):
        with pytest.raises(ValueError, match=pd.LEASE_PORT):
            lease_settings(bad, 30)
    for bad_max in (0, "soon", math.nan):
        with pytest.raises(ValueError, match=pd.LEASE_MAX_S):
            lease_settings({pd.LEASE_PORT: 0, pd.LEASE_MAX_S: bad_max}, 30)


# --- vLLM's scheduler and worker classes, in process ------------------------------------------------
def test_decode_scheduler_ships_renewals_into_vllms_reqs_to_send() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from tests.test_connectors_scheduler import (
        KV_CONSUMER, SchedulerOutput, _blocks, _config, _kv_cache_config, _request,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from kvtune.connectors.connector import KvtuneNixlPullConnector

    cfg = _config(KV_CONSUMER, bidirectional_kv_xfer=True, decoder_kv_blocks_ttl=20,
                  **{pd.LEASE_PORT: 0, pd.LEASE_MAX_S: 120})
    conn = KvtuneNixlPullConnector(cfg, KVConnectorRole.SCHEDULER, _kv_cache_config())
    sched = conn.connector_scheduler
    try:
        params = {pd.DO_REMOTE_PREFILL: True, pd.REMOTE_BLOCK_IDS: ([9],),
                  pd.REMOTE_ENGINE_ID: "eng-p", pd.REMOTE_REQUEST_ID: "cmpl-d1-0-55555555",
                  pd.REMOTE_HOST: "127.0.0.1", pd.REMOTE_PORT: 5600, pd.REMOTE_NUM_TOKENS: 100}
        req = _request("cmpl-d1-0-66666666", 100, params)
        conn.get_num_new_matched_tokens(req, 0)
        conn.update_state_after_alloc(req, _blocks(2), 100)
        conn.build_connector_meta(SchedulerOutput.make_empty())
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, ret = conn.request_finished(req, [2, 3])
        assert delay and ret[pd.PARAMS_LEASE_PORT] == sched._kvt_lease_channel.port
        first = ret[pd.REMOTE_BLOCKS_EXPIRY_TIME]
        meta = conn.build_connector_meta(SchedulerOutput.make_empty())
        assert meta.reqs_to_send[req.request_id] == first  # vLLM's own deadline, unchanged
        assert meta.kvtune_leases[req.request_id] == LeaseNote(0, None, False)

        (renew,) = _exchange(sched._kvt_lease_channel.port, json.dumps(
            {"op": "renew", "id": req.request_id, "lease_s": 100}).encode() + b"\n", 1)
        assert renew[pd.LEASE_OK] and renew[pd.LEASE_EXPIRY] > first + 70
        meta = conn.build_connector_meta(SchedulerOutput.make_empty())
        assert meta.reqs_to_send == {req.request_id: renew[pd.LEASE_EXPIRY]}
        assert meta.kvtune_leases[req.request_id] == LeaseNote(1, 100.0, False)
        assert not hasattr(conn.build_connector_meta(SchedulerOutput.make_empty()),
                           "kvtune_leases")

        conn.update_connector_output(KVConnectorOutput(finished_sending={req.request_id}))
        (gone,) = _exchange(sched._kvt_lease_channel.port, json.dumps(
            {"op": "release", "id": req.request_id}).encode() + b"\n", 1)
        assert gone[pd.LEASE_ERROR] == "unknown_request"
    finally:
        sched.shutdown()


def test_decode_without_the_key_keeps_vllms_ttl_and_no_channel() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from tests.test_connectors_scheduler import KV_CONSUMER, _config, _kv_cache_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtune.connectors.connector import KvtuneNixlPullConnector

    conn = KvtuneNixlPullConnector(_config(KV_CONSUMER, bidirectional_kv_xfer=True),
                                   KVConnectorRole.SCHEDULER, _kv_cache_config())
    assert conn.connector_scheduler._kvt_lease is None
    assert conn.connector_scheduler._kvt_lease_channel is None


@pytest.mark.parametrize("note, outcome", [
    (None, spans.RetentionOutcome.EXPIRED),
    (LeaseNote(2, 30.0, False), spans.RetentionOutcome.LAPSED),
    (LeaseNote(1, 30.0, True), spans.RetentionOutcome.ENDED),
])
def test_worker_retention_span_says_renewals_and_why_the_blocks_went(
        note: LeaseNote | None, outcome: spans.RetentionOutcome) -> None:
    pytest.importorskip("vllm")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
        InMemorySpanExporter,
    )

    from kvtune.connectors.observer import Emitter, ReqTrace
    from kvtune.connectors.worker import KvtunePullWorker

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    worker = KvtunePullWorker.__new__(KvtunePullWorker)  # the hooks only, no NIXL agent
    worker._kvt = Emitter(spans.Role.DECODE, spans.Mode.BIDIRECTIONAL, "eng-d",
                          tracer=provider.get_tracer("test"))
    worker._kvt_role = spans.Role.DECODE
    worker._kvt_retained, worker._kvt_lease_notes = {}, {}
    worker._kvt_reqs = {}
    info = ReqTrace("r1", "d1", "", tokens=100, mark_ns=1, ttl_s=20.0)
    meta = type("Meta", (), {})()
    meta.kvtune_reqs = {"r1": info}
    meta.kvtune_leases = {"r1": note} if note is not None else {}
    worker._kvt_on_metadata(meta)
    worker._kvt_on_expired({"r1"})
    worker._kvt.flush()
    (span,) = [s for s in exporter.get_finished_spans() if s.name == spans.SpanName.RETENTION.value]
    assert span.attributes[spans.RETENTION_OUTCOME] == outcome.value
    if note is None:
        assert spans.RETENTION_RENEWALS not in span.attributes
    else:
        assert span.attributes[spans.RETENTION_RENEWALS] == note.renewals
        assert span.attributes[spans.RETENTION_LEASE_S] == note.lease_s
    assert worker._kvt_lease_notes == {}
