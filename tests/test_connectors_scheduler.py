"""The scheduler side of kvtune's connectors, driven in-process: vLLM's real ``VllmConfig``,
``KVCacheConfig``, ``Request`` and scheduler classes (no model, no engine), spans read from an
in-memory exporter. Covers what the CPU pair rarely reaches: the reuse decisions other than a pull
(recompute under the threshold, local hit, first turn), retention start, decode start, the prefill
span's token counts, and the compat fallbacks of the connector facades.
"""
from __future__ import annotations

import time

import logging
from typing import Any

import pytest

from kvtune import spans
from kvtune.connectors.ids import derived_span_context, parse_traceparent

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (  # noqa: E402
    NixlPullConnectorScheduler,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvtune.connectors import compat  # noqa: E402
from kvtune.connectors.connector import (  # noqa: E402
    KvtuneNixlPullConnector,
    KvtuneNixlPushConnector,
)
from kvtune.connectors.observer import Emitter  # noqa: E402
from kvtune.connectors.scheduler import KvtunePullScheduler, KvtunePushScheduler  # noqa: E402
from kvtune.errors import ConnectorError  # noqa: E402
from kvtune.vllm_pd import (  # noqa: E402
    DO_REMOTE_DECODE, DO_REMOTE_PREFILL, KV_CONSUMER, KV_PRODUCER, KV_TRANSFER_PARAMS,
    REMOTE_BLOCK_IDS, REMOTE_ENGINE_ID, REMOTE_HOST, REMOTE_NUM_TOKENS, REMOTE_PORT,
    REMOTE_REQUEST_ID,
)

BLOCK = 128
THRESHOLD = 64
TTL_S = 90


def _config(kv_role: str, connector: str = "KvtuneNixlPullConnector", **extra: Any) -> VllmConfig:
    return VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector=connector, kv_connector_module_path="kvtune.connectors", kv_role=kv_role,
        engine_id=f"eng-{kv_role}", kv_connector_extra_config=extra))


def _kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=["l0"], kv_cache_spec=spec)])


def _request(rid: str, n_tokens: int, params: dict[str, Any] | None) -> Request:
    extra = {KV_TRANSFER_PARAMS: params} if params is not None else None
    return Request(rid, list(range(1, n_tokens + 1)), SamplingParams(max_tokens=1, extra_args=extra),
                   None)


def test_queue_span_from_arrival_to_first_look_once_per_request(
        exporter: InMemorySpanExporter) -> None:
    conn = _scheduler(exporter, KV_PRODUCER)
    req = Request("cmpl-q-0-33333333", list(range(1, 41)),
                  SamplingParams(max_tokens=1, extra_args={KV_TRANSFER_PARAMS:
                                                           {DO_REMOTE_DECODE: True}}),
                  None, arrival_time=time.time() - 2.5)
    conn.get_num_new_matched_tokens(req, 0)
    conn.get_num_new_matched_tokens(req, 0)  # the scheduler looks again: still one span
    span = _only(exporter, spans.SpanName.QUEUE)
    assert span.start_time == int(req.arrival_time * 1e9)
    assert 2.4e9 < span.end_time - span.start_time < 60e9
    assert span.attributes[spans.BASE_REQUEST_ID] == "q"
    assert span.attributes[spans.ROLE] == spans.Role.PREFILL.value
    assert span.attributes[spans.PROMPT_TOKENS] == 40


def _blocks(*ids: int) -> KVCacheBlocks:
    return KVCacheBlocks(blocks=([KVCacheBlock(block_id=i) for i in ids],))


@pytest.fixture()
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def _scheduler(exporter: InMemorySpanExporter, kv_role: str, **extra: Any) -> Any:
    conn = KvtuneNixlPullConnector(_config(kv_role, **extra), KVConnectorRole.SCHEDULER,
                                   _kv_cache_config())
    sched = conn.connector_scheduler
    assert isinstance(sched, KvtunePullScheduler)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sched._kvt_init(Emitter(sched._kvt.role, sched._kvt.mode, "eng-test",
                            tracer=provider.get_tracer("test")))
    return conn


def _only(exporter: InMemorySpanExporter, name: spans.SpanName) -> Any:
    found = [s for s in exporter.get_finished_spans() if s.name == name.value]
    assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
    return found[0]


def _history(remote_tokens: int) -> dict[str, Any]:
    """What a decode returns for a conversation's next turn (bidirectional)."""
    return {DO_REMOTE_DECODE: True, REMOTE_BLOCK_IDS: ([7, 8],), REMOTE_ENGINE_ID: "eng-d",
            REMOTE_REQUEST_ID: "cmpl-turn1-0-1a2b3c4d", REMOTE_HOST: "127.0.0.1",
            REMOTE_PORT: 5601, REMOTE_NUM_TOKENS: remote_tokens,
            spans.KV_PARAMS_CONVERSATION_ID: "conv-7", spans.KV_PARAMS_TURN: 2}


@pytest.mark.parametrize("remote_tokens, local_computed, outcome", [
    (40, 0, spans.ReuseOutcome.RECOMPUTE),   # 40 remote tokens < threshold 64: recompute
    (100, 128, spans.ReuseOutcome.LOCAL_HIT),  # the prefill's prefix cache already covers them
])
def test_reuse_decisions_made_on_the_prefill(exporter: InMemorySpanExporter, remote_tokens: int,
                                             local_computed: int,
                                             outcome: spans.ReuseOutcome) -> None:
    conn = _scheduler(exporter, KV_PRODUCER, bidirectional_kv_xfer=True,
                      kv_recompute_threshold=THRESHOLD)
    req = _request("cmpl-turn2-0-99999999", 300, _history(remote_tokens))
    assert conn.get_num_new_matched_tokens(req, local_computed) == (0, False)  # vLLM's answer
    span = _only(exporter, spans.SpanName.REUSE_DECISION)
    a = span.attributes
    assert a[spans.REUSE_OUTCOME] == outcome.value
    assert a[spans.REUSE_REMOTE_TOKENS] == remote_tokens
    assert a[spans.REUSE_THRESHOLD_TOKENS] == THRESHOLD
    assert a[spans.TRANSFER_ID] == spans.transfer_id("turn1", spans.Direction.REVERSE)
    assert a[spans.CONVERSATION_ID] == "conv-7" and a[spans.TURN] == 2
    assert a[spans.MODE] == spans.Mode.BIDIRECTIONAL.value
    # The decision joins the retained request's trace (derived: no traceparent was given).
    assert span.context.trace_id == derived_span_context("turn1").trace_id


def test_first_turn_and_pull_decisions(exporter: InMemorySpanExporter) -> None:
    conn = _scheduler(exporter, KV_PRODUCER, bidirectional_kv_xfer=True,
                      kv_recompute_threshold=THRESHOLD)
    first = _request("cmpl-new-0-11111111", 50, {DO_REMOTE_DECODE: True})
    assert conn.get_num_new_matched_tokens(first, 0) == (0, False)
    assert _only(exporter, spans.SpanName.REUSE_DECISION).attributes[spans.REUSE_OUTCOME] == \
        spans.ReuseOutcome.NONE.value
    exporter.clear()
    retained_tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    params = {**_history(200), spans.KV_PARAMS_RETAINED_TRACEPARENT: retained_tp}
    pull = _request("cmpl-turn2-0-22222222", 300, params)
    assert conn.get_num_new_matched_tokens(pull, 0) == (200, True)
    conn.update_state_after_alloc(pull, _blocks(3, 4), 200)
    # a pull is confirmed by the worker; only the engine-queue span is emitted here
    assert [s.name for s in exporter.get_finished_spans()] == [spans.SpanName.QUEUE.value]
    meta = conn.build_connector_meta(SchedulerOutput.make_empty())
    info = meta.kvtune_reqs[pull.request_id]
    assert "cmpl-turn2-0-22222222" in meta.reqs_to_recv  # vLLM's own metadata, unchanged
    assert info.remote_base_id == "turn1" and info.tokens == 200
    assert info.remote_traceparent == retained_tp and info.threshold_tokens == THRESHOLD
    assert info.mark_ns is not None and info.conversation_id == "conv-7"


def test_prefill_span_counts_tokens_and_uses_the_request_trace(
        exporter: InMemorySpanExporter) -> None:
    conn = _scheduler(exporter, KV_PRODUCER)
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    req = _request("cmpl-p1-0-33333333", 200, {DO_REMOTE_DECODE: True,
                                               spans.KV_PARAMS_TRACEPARENT: tp})
    conn.get_num_new_matched_tokens(req, 128)  # 128 tokens from the local prefix cache
    conn.update_state_after_alloc(req, _blocks(5), 0)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, out = conn.request_finished(req, [5, 6])
    assert delay and out[REMOTE_REQUEST_ID] == req.request_id  # vLLM's own answer
    assert spans.KV_PARAMS_RETAINED_TRACEPARENT not in out  # nothing added on the prefill
    span = _only(exporter, spans.SpanName.PREFILL)
    a = span.attributes
    assert (a[spans.PROMPT_TOKENS], a[spans.CACHED_TOKENS], a[spans.COMPUTED_TOKENS]) == \
        (200, 128, 72)
    assert a[spans.TRANSFER_ID] == spans.transfer_id("p1", spans.Direction.FORWARD)
    assert a[spans.ROLE] == spans.Role.PREFILL.value
    assert f"{span.context.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_aborted_prefill_is_an_error_span(exporter: InMemorySpanExporter) -> None:
    conn = _scheduler(exporter, KV_PRODUCER)
    req = _request("cmpl-ab-0-44444444", 10, {DO_REMOTE_DECODE: True})
    conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, _blocks(1), 0)
    req.status = RequestStatus.FINISHED_ABORTED
    assert conn.request_finished(req, [1]) == (False, None)
    assert not _only(exporter, spans.SpanName.PREFILL).status.is_ok


def test_decode_retains_blocks_and_starts_decoding(exporter: InMemorySpanExporter) -> None:
    conn = _scheduler(exporter, KV_CONSUMER, bidirectional_kv_xfer=True,
                      decoder_kv_blocks_ttl=TTL_S)
    params = {DO_REMOTE_PREFILL: True, REMOTE_BLOCK_IDS: ([9],), REMOTE_ENGINE_ID: "eng-p",
              REMOTE_REQUEST_ID: "cmpl-d1-0-55555555", REMOTE_HOST: "127.0.0.1",
              REMOTE_PORT: 5600, REMOTE_NUM_TOKENS: 100, spans.KV_PARAMS_CONVERSATION_ID: "c9"}
    req = _request("cmpl-d1-0-66666666", 100, params)
    assert conn.get_num_new_matched_tokens(req, 0) == (100, True)
    conn.update_state_after_alloc(req, _blocks(2), 100)
    conn.build_connector_meta(SchedulerOutput.make_empty())
    conn.update_connector_output(KVConnectorOutput(finished_recving={req.request_id}))
    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = {req.request_id: 1}
    conn.build_connector_meta(out)  # first decode step scheduled
    start = _only(exporter, spans.SpanName.DECODE_START)
    assert start.attributes[spans.TRANSFER_ID] == spans.transfer_id("d1", spans.Direction.FORWARD)
    assert start.attributes[spans.TOKENS] == 100 and start.start_time <= start.end_time

    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, ret = conn.request_finished(req, [2, 3])
    assert delay and ret[DO_REMOTE_DECODE] is True  # vLLM retains for the next turn
    assert parse_traceparent(ret[spans.KV_PARAMS_RETAINED_TRACEPARENT]).trace_id == \
        derived_span_context("d1").trace_id
    assert ret[spans.KV_PARAMS_CONVERSATION_ID] == "c9"
    info = conn.build_connector_meta(SchedulerOutput.make_empty()).kvtune_reqs[req.request_id]
    assert info.ttl_s == TTL_S and info.base_id == "d1" and info.mark_ns is not None


# --- facades and compat -----------------------------------------------------------------------
@pytest.fixture()
def mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "_CACHED", {})
    monkeypatch.setattr(compat, "find_missing", lambda *a, **k: ("NixlPullConnectorWorker._x",))


def test_mismatch_runs_exactly_vllms_classes_with_a_warning(
        mismatch: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtune.connectors"):
        conn = KvtuneNixlPullConnector(_config(KV_PRODUCER), KVConnectorRole.SCHEDULER,
                                       _kv_cache_config())
    assert type(conn.connector_scheduler) is NixlPullConnectorScheduler
    assert "UNINSTRUMENTED" in caplog.text and "NixlPullConnectorWorker._x" in caplog.text


def test_mismatch_in_strict_mode_refuses(mismatch: None) -> None:
    with pytest.raises(ConnectorError, match="NixlPullConnectorWorker._x"):
        KvtuneNixlPullConnector(_config(KV_PRODUCER, kvtune_strict=True),
                                KVConnectorRole.SCHEDULER, _kv_cache_config())


def test_push_facade_builds_kvtune_scheduler() -> None:
    conn = KvtuneNixlPushConnector(_config(KV_CONSUMER, "KvtuneNixlPushConnector"),
                                   KVConnectorRole.SCHEDULER, _kv_cache_config())
    assert isinstance(conn.connector_scheduler, KvtunePushScheduler)
    assert conn.connector_scheduler._kvt.mode is spans.Mode.PUSH


def test_spans_name_the_vllm_and_nixl_releases_they_ran_on(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connectors' own telemetry (``KVTUNE_SPANS_DIR``): the spans' resource carries the
    vLLM this process imported and the installed NIXL (run on each release by ``make test``)."""
    import vllm

    from kvtune import telemetry
    from kvtune.traces import load

    monkeypatch.setattr(telemetry, "_FROM_ENV", {})
    monkeypatch.setenv("KVTUNE_SPANS_DIR", str(tmp_path))
    conn = KvtuneNixlPullConnector(_config(KV_PRODUCER), KVConnectorRole.SCHEDULER,
                                   _kv_cache_config())
    sched = conn.connector_scheduler
    assert sched._kvt.telemetry is not None
    req = Request("cmpl-ver-0-44444444", list(range(1, 9)),
                  SamplingParams(max_tokens=1, extra_args={KV_TRANSFER_PARAMS:
                                                           {DO_REMOTE_DECODE: True}}),
                  None, arrival_time=time.time() - 0.5)
    conn.get_num_new_matched_tokens(req, 0)
    sched._kvt.telemetry.shutdown()
    df = load(tmp_path)
    assert list(df["name"]) == [spans.SpanName.QUEUE.value]
    res = df["resource"].iloc[0]
    assert res[spans.VLLM_VERSION] == vllm.__version__
    assert res[spans.NIXL_VERSION] == compat.installed_nixl_version() != "not installed"


# --- kv_both: each span's role is its request's leg -------------------------------------------
KV_BOTH_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _both_legs(prefill_conn: Any, decode_conn: Any) -> None:
    """One pull request, both legs: the prefill's on ``prefill_conn``, the decode's (with the
    params the prefill answered) on ``decode_conn``; every scheduler-side span of each leg."""
    now = time.time()
    p = Request("cmpl-kb-0-11111111", list(range(1, 201)),
                SamplingParams(max_tokens=1, extra_args={KV_TRANSFER_PARAMS: {
                    DO_REMOTE_DECODE: True, spans.KV_PARAMS_TRACEPARENT: KV_BOTH_TRACEPARENT}}),
                None, arrival_time=now - 0.2)
    prefill_conn.get_num_new_matched_tokens(p, 128)
    prefill_conn.update_state_after_alloc(p, _blocks(5, 6), 0)
    p.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, answer = prefill_conn.request_finished(p, ([5, 6],))
    assert delay and answer[DO_REMOTE_PREFILL] is True  # vLLM's own answer for the decode
    prefill_conn.build_connector_meta(SchedulerOutput.make_empty())

    d = Request("cmpl-kb-0-22222222", list(range(1, 201)),
                SamplingParams(max_tokens=4, extra_args={KV_TRANSFER_PARAMS: {
                    **answer, spans.KV_PARAMS_TRACEPARENT: KV_BOTH_TRACEPARENT}}),
                None, arrival_time=now - 0.1)
    n, load_async = decode_conn.get_num_new_matched_tokens(d, 0)
    assert load_async and n > 0  # vLLM's decode leg: the prompt's KV comes from the prefill
    decode_conn.update_state_after_alloc(d, _blocks(2, 3), n)
    info = decode_conn.build_connector_meta(SchedulerOutput.make_empty()).kvtune_reqs[d.request_id]
    assert info.leg is spans.Role.DECODE  # the worker side learns the leg too
    decode_conn.update_connector_output(KVConnectorOutput(finished_recving={d.request_id}))
    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = {d.request_id: 1}
    decode_conn.build_connector_meta(out)


def _engine_spans(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, kv_roles: tuple[str, ...]
                  ) -> Any:
    """Spans (``kvtune.traces.load``) of :func:`_both_legs` on engines started with ``kv_roles``
    (one: both legs on it; two: prefill leg, decode leg), each exporting through the connectors'
    own telemetry (``KVTUNE_SPANS_DIR``), as in a served engine."""
    from kvtune import telemetry
    from kvtune.traces import load

    monkeypatch.setattr(telemetry, "_FROM_ENV", {})
    monkeypatch.setenv("KVTUNE_SPANS_DIR", str(tmp_path))
    conns = [KvtuneNixlPullConnector(_config(r), KVConnectorRole.SCHEDULER, _kv_cache_config())
             for r in kv_roles]
    _both_legs(conns[0], conns[-1])
    for handle in set(telemetry._FROM_ENV.values()) - {None}:
        handle.shutdown()
    return load(tmp_path)


def _span_set(df: Any) -> list[tuple[Any, ...]]:
    """What a span says apart from its times and the engine's name (which differs by kv_role)."""
    cols = ["name", spans.ROLE, "service", spans.TRANSFER_ID, spans.BASE_REQUEST_ID,
            spans.PROMPT_TOKENS, spans.CACHED_TOKENS, spans.COMPUTED_TOKENS, spans.TOKENS,
            spans.MODE, "trace_id", "status"]
    return sorted(tuple(str(v) for v in row) for row in df[cols].itertuples(index=False))


def test_kv_both_engine_labels_each_span_with_its_requests_leg(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtune.vllm_pd import KV_BOTH

    both = _engine_spans(tmp_path / "both", monkeypatch, (KV_BOTH,))
    P, D = spans.Role.PREFILL.value, spans.Role.DECODE.value
    got = sorted(zip(both["name"], both[spans.ROLE], both["service"]))
    assert got == sorted([
        (spans.SpanName.QUEUE.value, P, spans.service_name(P)),
        (spans.SpanName.PREFILL.value, P, spans.service_name(P)),
        (spans.SpanName.QUEUE.value, D, spans.service_name(D)),
        (spans.SpanName.DECODE_START.value, D, spans.service_name(D)),
    ])
    # ...each role's spans in that role's file, as from a kv_producer and a kv_consumer engine
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "both").glob("*.jsonl")) == [D, P]
    # The same spans as the same two legs on a producer and a consumer engine.
    pair = _engine_spans(tmp_path / "pair", monkeypatch, (KV_PRODUCER, KV_CONSUMER))
    assert _span_set(both) == _span_set(pair)
    assert set(both[spans.ENGINE_ID]) == {"eng-kv_both"}


# --- spans built off the engine thread, head sampling ------------------------------------------
def _drive_all_paths(make_emitter: Any) -> None:
    """Every scheduler-side span: queue, prefill (given and derived trace, aborted), reuse
    decisions, decode start and retention; each connector's emitter from ``make_emitter``."""
    def conn_for(kv_role: str, **extra: Any) -> Any:
        conn = KvtuneNixlPullConnector(_config(kv_role, **extra), KVConnectorRole.SCHEDULER,
                                       _kv_cache_config())
        sched = conn.connector_scheduler
        sched._kvt_init(make_emitter(sched))
        return conn

    prod = conn_for(KV_PRODUCER)
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    for rid, params, status in (
            ("cmpl-a-0-11111111", {DO_REMOTE_DECODE: True, spans.KV_PARAMS_TRACEPARENT: tp},
             RequestStatus.FINISHED_LENGTH_CAPPED),
            ("cmpl-b-0-22222222", {DO_REMOTE_DECODE: True}, RequestStatus.FINISHED_LENGTH_CAPPED),
            ("cmpl-c-0-33333333", {DO_REMOTE_DECODE: True}, RequestStatus.FINISHED_ABORTED)):
        req = Request(rid, list(range(1, 201)), SamplingParams(
            max_tokens=1, extra_args={KV_TRANSFER_PARAMS: params}), None, arrival_time=1000.0)
        prod.get_num_new_matched_tokens(req, 128)
        prod.update_state_after_alloc(req, _blocks(5), 0)
        req.status = status
        prod.request_finished(req, [5, 6])
    prod.build_connector_meta(SchedulerOutput.make_empty())

    bidir = conn_for(KV_PRODUCER, bidirectional_kv_xfer=True, kv_recompute_threshold=THRESHOLD)
    for rid, remote_tokens, local in (("cmpl-t2-0-44444444", 40, 0),
                                      ("cmpl-t3-0-55555555", 100, 128)):
        bidir.get_num_new_matched_tokens(_request(rid, 300, _history(remote_tokens)), local)

    dec = conn_for(KV_CONSUMER, bidirectional_kv_xfer=True, decoder_kv_blocks_ttl=TTL_S)
    params = {DO_REMOTE_PREFILL: True, REMOTE_BLOCK_IDS: ([9],), REMOTE_ENGINE_ID: "eng-p",
              REMOTE_REQUEST_ID: "cmpl-d1-0-55555555", REMOTE_HOST: "127.0.0.1",
              REMOTE_PORT: 5600, REMOTE_NUM_TOKENS: 100, spans.KV_PARAMS_CONVERSATION_ID: "c9"}
    for rid in ("cmpl-d1-0-66666666", "cmpl-d2-0-77777777"):  # two: decode_start in one loop
        req = _request(rid, 100, dict(params))  # vLLM changes a request's params in place
        dec.get_num_new_matched_tokens(req, 0)
        dec.update_state_after_alloc(req, _blocks(2), 100)
    dec.build_connector_meta(SchedulerOutput.make_empty())
    dec.update_connector_output(KVConnectorOutput(
        finished_recving={"cmpl-d1-0-66666666", "cmpl-d2-0-77777777"}))
    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = {"cmpl-d1-0-66666666": 1, "cmpl-d2-0-77777777": 1}
    dec.build_connector_meta(out)


def _comparable(s: Any) -> tuple[Any, ...]:
    """A span less its own (random) span id."""
    return (s.name, s.context.trace_id, s.parent.span_id if s.parent else None,
            s.start_time, s.end_time, dict(s.attributes), s.status.status_code,
            s.status.description)


def test_deferred_spans_equal_spans_built_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recording values on the engine thread and building the spans on the recorder's thread
    gives the very spans that building them at once gave (times, parents, attributes)."""
    from kvtune.connectors import scheduler as sched_mod
    from kvtune.connectors.recorder import SpanRecorder

    runs: dict[str, list[tuple[Any, ...]]] = {}
    for how in ("at once", "deferred", "deferred, builder thread"):
        clock = iter(range(10**12, 10**12 + 10**6, 1000))
        monkeypatch.setattr(sched_mod, "now_ns", lambda: next(clock))
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        recorder = None if how == "at once" else SpanRecorder(
            interval_s=0.01 if "thread" in how else None)
        made: list[Emitter] = []

        def make(sched: Any) -> Emitter:
            em = Emitter(sched._kvt.role, sched._kvt.mode, "eng-test",
                         tracer=provider.get_tracer("test"), deferred=recorder is not None,
                         recorder=recorder)
            made.append(em)
            return em

        _drive_all_paths(make)
        if how == "deferred":
            assert exporter.get_finished_spans() == ()  # nothing built on the engine thread
            assert recorder.pending() > 0
        for em in made:
            em.flush()
        if recorder is not None:
            assert recorder.pending() == 0 and recorder.failures == 0
            recorder.close()
        runs[how] = [_comparable(s) for s in exporter.get_finished_spans()]
    names = {r[0] for r in runs["at once"]}
    assert names >= {spans.SpanName.QUEUE.value, spans.SpanName.PREFILL.value,
                     spans.SpanName.REUSE_DECISION.value, spans.SpanName.DECODE_START.value}
    assert runs["deferred"] == runs["at once"]
    assert sorted(runs["deferred, builder thread"], key=repr) == sorted(runs["at once"], key=repr)


@pytest.mark.parametrize("flags, expect_spans", [("01", True), ("00", False)])
def test_router_sampling_flag_decides_whether_spans_are_recorded(
        flags: str, expect_spans: bool) -> None:
    """Head sampling: a request whose ``traceparent`` says "not sampled" records nothing (not
    even a value for the builder thread); the worker side still gets its trace context, so it
    skips the request's spans too."""
    from kvtune.connectors.recorder import SpanRecorder

    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # OTel's default sampler: parent-based
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    recorder = SpanRecorder(interval_s=None)
    conn = KvtuneNixlPullConnector(_config(KV_PRODUCER), KVConnectorRole.SCHEDULER,
                                   _kv_cache_config())
    sched = conn.connector_scheduler
    sched._kvt_init(Emitter(sched._kvt.role, sched._kvt.mode, "eng-test",
                            tracer=provider.get_tracer("test"), deferred=True, recorder=recorder))
    tp = f"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}"
    req = Request("cmpl-s-0-12121212", list(range(1, 41)), SamplingParams(
        max_tokens=1, extra_args={KV_TRANSFER_PARAMS: {DO_REMOTE_DECODE: True,
                                                       spans.KV_PARAMS_TRACEPARENT: tp}}),
        None, arrival_time=time.time() - 0.1)
    conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, _blocks(1), 0)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    conn.request_finished(req, [1])
    info = conn.build_connector_meta(SchedulerOutput.make_empty()).kvtune_reqs[req.request_id]
    assert info.traceparent == tp  # the worker side sees the same flag
    assert (recorder.pending() > 0) is expect_spans
    recorder.drain()
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == (sorted([spans.SpanName.QUEUE.value, spans.SpanName.PREFILL.value])
                     if expect_spans else [])


def test_micro_bench_runs_and_prints_its_verdict_on_the_aim(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench/connectors.py --micro`` in a tiny configuration: it runs and prints its lines
    (timing is the bench's to report, not a test's to assert)."""
    import gc
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "connectors.py"
    spec = importlib.util.spec_from_file_location("kvtune_bench_connectors", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    assert bench.main(["--micro", "--micro-steps", "40", "--micro-requests", "8",
                       "--micro-blocks", "2"]) == 0
    out = capsys.readouterr().out
    for line in ("per step ", "per request ", "off the engine thread, per request: building ",
                 "aim: extra <= 20 us/request, <= 0.5 us/step: "):
        assert line in out, out
    assert "failures 0, dropped 0" in out and "(2 span(s) each" in out
    assert gc.get_freeze_count() == 0  # the bench gave the heap back to the collector
