"""The router embedded in a program that is its only client (what ``LocalPair`` does): the
``on_leg`` observer sees every leg, and a trusted client's request id and traceparent reach the
legs. Upstreams are the stand-in vLLM servers (``kvtune.testing.standin``)."""
from __future__ import annotations

import threading

import pytest
from opentelemetry import trace

from kvtune import spans
from kvtune.router import RouterInThread
from kvtune.router.client import post
from kvtune.router.server import LegRecord
from kvtune.testing.standin import StandInVllmCluster
from kvtune.router.state import SqliteConversationStore
from kvtune.vllm_pd import (
    DO_REMOTE_DECODE, DO_REMOTE_PREFILL, KV_TRANSFER_PARAMS, REMOTE_BLOCK_IDS, REMOTE_ENGINE_ID,
    REMOTE_REQUEST_ID,
)

pytestmark = pytest.mark.timeout(180)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class _Legs:
    def __init__(self) -> None:
        self.records: list[LegRecord] = []
        self._lock = threading.Lock()

    def __call__(self, record: LegRecord) -> None:
        with self._lock:
            self.records.append(record)

    def of(self, rid: str) -> dict[str, LegRecord]:
        with self._lock:
            return {r.leg: r for r in self.records if r.request_id == rid}


def _body(prompt: str, *, stream: bool) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 3, "stream": stream}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("mode", ["pull", "push", "bidirectional"])
def test_trusted_client_ids_and_traceparent_reach_the_legs_and_every_leg_is_observed(mode, stream):
    legs = _Legs()
    store = SqliteConversationStore(":memory:", params_ttl_s=60.0)
    with StandInVllmCluster(1, 1, bidirectional=mode == "bidirectional",
                            sse_format="0.33") as cluster, \
            RouterInThread(cluster.router_config(mode, state=":memory:"), store=store,
                           tracer=trace.NoOpTracer(), on_leg=legs, trusted_client=True) as router:
        headers = {"X-Request-Id": "embedded-1", "traceparent": TRACEPARENT}
        if mode == "bidirectional":
            headers[spans.CONVERSATION_HEADER] = "conv-e"
        answer = post(router.url + "/v1/completions", _body("hello " * 8, stream=stream),
                      headers=headers)
        prefill, decode = cluster.requests("prefill"), cluster.requests("decode")
        stored = store.peek_params("conv-e") if mode == "bidirectional" else None
        if mode == "bidirectional":
            store.forget("conv-e")
            assert store.peek_params("conv-e") is None
            assert store.begin_turn("conv-e").turn == 1  # forgotten: the next turn is the first

    assert answer.status == 200, answer.body
    for leg in prefill + decode:
        assert leg.headers["X-Request-Id"] == "embedded-1"  # the client's id, not the router's
        assert leg.headers["traceparent"] == TRACEPARENT  # as the client sent it
        assert leg.body[KV_TRANSFER_PARAMS][spans.KV_PARAMS_TRACEPARENT] == TRACEPARENT
    seen = legs.of("embedded-1")
    assert set(seen) == {"prefill", "decode"}
    p, d = seen["prefill"], seen["decode"]
    assert p.error is None and d.error is None
    assert p.instance == cluster.prefill[0].url and d.instance == cluster.decode[0].url
    assert p.elapsed_ms > 0 and d.elapsed_ms > 0
    assert p.sent_kv_transfer_params == prefill[0].body[KV_TRANSFER_PARAMS]
    assert d.sent_kv_transfer_params == decode[0].body[KV_TRANSFER_PARAMS]
    assert p.sent_kv_transfer_params[DO_REMOTE_DECODE] is True
    assert p.answer is not None and p.kv_transfer_params == p.answer[KV_TRANSFER_PARAMS]
    assert d.sent_kv_transfer_params[DO_REMOTE_PREFILL] is True
    if mode == "push":
        assert d.sent_kv_transfer_params[REMOTE_REQUEST_ID] == "embedded-1"
        assert d.sent_kv_transfer_params[REMOTE_ENGINE_ID] == cluster.prefill[0].engine_id
    else:  # the decode was given what the prefill answered
        assert {k: v for k, v in d.sent_kv_transfer_params.items()
                if k in p.kv_transfer_params} == p.kv_transfer_params
    assert (d.answer is None) is stream
    if mode == "bidirectional":  # the decode's retained blocks, stored for the next turn
        assert d.kv_transfer_params is not None and d.kv_transfer_params[REMOTE_BLOCK_IDS]
        assert stored == d.kv_transfer_params


def test_untrusted_client_ids_stay_the_clients_own_and_a_failed_leg_is_observed():
    legs = _Legs()
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=":memory:"),
                           tracer=trace.NoOpTracer(), on_leg=legs) as router:
        ok = post(router.url + "/v1/completions", _body("hi " * 4, stream=False),
                  headers={"X-Request-Id": "client-1", "traceparent": TRACEPARENT})
        cluster.decode[0].fail_status = 503
        failed = post(router.url + "/v1/completions", _body("hi " * 4, stream=True))
        prefill = cluster.requests("prefill")
    assert ok.status == 200
    rid = ok.headers["X-Kvtune-Request-Id"]
    assert rid != "client-1" and prefill[0].headers["X-Request-Id"] == rid
    assert "traceparent" not in prefill[0].headers  # tracing off and the client not trusted
    assert set(legs.of(rid)) == {"prefill", "decode"}
    assert failed.status == 502
    bad = legs.of(failed.headers["X-Kvtune-Request-Id"])
    assert bad["prefill"].error is None and "HTTP 503" in bad["decode"].error
    assert bad["decode"].answer is None and bad["decode"].kv_transfer_params is None
