"""prefill_cost() and workload() on synthetic and hand-made spans."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvtune import spans as sc
from kvtune.analysis import PrefillCost, Workload, prefill_cost, workload
from kvtune.errors import AnalysisError
from kvtune.testing import synthetic as syn

S = 1_000_000_000
T0 = syn.T0_NS


def _prefill(start_s: float, computed: int, cached: int, ms: float, conv: str = "c",
             turn: int = 1) -> dict:
    return {"name": sc.SpanName.PREFILL.value, "host": "prefill-0", "start_ns": T0 + int(start_s * S),
            "end_ns": T0 + int(start_s * S) + int(ms * 1e6),
            "attrs": {sc.COMPUTED_TOKENS: computed, sc.CACHED_TOKENS: cached,
                      sc.PROMPT_TOKENS: computed + cached, sc.CONVERSATION_ID: conv,
                      sc.TURN: turn}}


def test_prefill_cost_exact_hand_made():
    truth = syn.PrefillTruth(base_ms=5.0, per_token_ms=0.05, per_token_prefix_us=2.0)
    pts = [(500, 0), (1000, 0), (2000, 0), (1000, 2000), (500, 4000), (3000, 1000)]
    frame = syn.spans_frame([_prefill(i, r, prefix, truth.prefill_ms(r, prefix))
                             for i, (r, prefix) in enumerate(pts)])
    pc = prefill_cost(frame)
    assert isinstance(pc, PrefillCost)
    assert pc.per_token_ms == pytest.approx(0.05, rel=1e-3)
    assert pc.per_token_prefix_us == pytest.approx(2.0, rel=1e-3)
    assert pc.base_ms == pytest.approx(5.0, rel=1e-3)
    assert pc.predict_ms(1000, 2000) == pytest.approx(truth.prefill_ms(1000, 2000), rel=1e-3)
    # recomputing a 1000-token history: the per-token and attention terms, no base
    assert pc.recompute_ms(1000) == pytest.approx(1000 * 0.05 + 1000 ** 2 / 2 / 1000 * 2.0 / 1e3,
                                                  rel=1e-3)
    assert pc.source == sc.SpanName.PREFILL.value and pc.n_observations == len(pts)


def test_prefill_cost_from_synthetic_serving_within_10_percent():
    truth = syn.PrefillTruth()
    spans = syn.serving_spans(syn.SyntheticWorkload(n_conversations=40), mode="pull",
                              prefill=truth, seed=3)
    pc = prefill_cost(spans)
    for n in (500, 2000, 6000):
        assert pc.predict_ms(n) == pytest.approx(truth.prefill_ms(n), rel=0.10)


def test_prefill_cost_from_vllm_llm_request_spans():
    truth = syn.PrefillTruth()
    spans = syn.serving_spans(syn.SyntheticWorkload(n_conversations=30), mode="pull",
                              prefill=truth, seed=5, vllm_request_spans=True)
    only_vllm = spans[spans["name"] != sc.SpanName.PREFILL.value]
    pc = prefill_cost(only_vllm)
    assert pc.source == "llm_request"
    assert pc.predict_ms(2000) == pytest.approx(truth.prefill_ms(2000), rel=0.10)


def test_prefill_cost_errors():
    frame = syn.spans_frame([_prefill(0, 100, 0, 10.0), _prefill(1, 100, 0, 11.0)])
    with pytest.raises(AnalysisError, match=r"1 distinct computed-token count.*"
                                             r"need >= 3 distinct lengths: send 2 more"):
        prefill_cost(frame)
    empty = syn.spans_frame([{"name": sc.SpanName.REQUEST.value, "host": "r", "start_ns": T0,
                              "end_ns": T0 + 1, "attrs": {}}])
    with pytest.raises(AnalysisError, match="no prefill observations"):
        prefill_cost(empty)


def _request(conv: str | None, turn: int, start_s: float, end_s: float, prompt: int,
             output: int) -> dict:
    attrs = {sc.TURN: turn, sc.PROMPT_TOKENS: prompt, sc.OUTPUT_TOKENS: output}
    if conv is not None:
        attrs[sc.CONVERSATION_ID] = conv
    return {"name": sc.SpanName.REQUEST.value, "host": "router", "start_ns": T0 + int(start_s * S),
            "end_ns": T0 + int(end_s * S), "attrs": attrs}


def test_workload_hand_computed():
    recs = [
        _request("a", 1, 0, 2, 100, 10),
        _request("a", 2, 12, 13, 150, 10),   # gap 10 s after 110 tokens of history
        _request("a", 3, 43, 44, 200, 10),   # gap 30 s after 160 tokens
        _request("b", 1, 5, 6, 1000, 20),
        _request(None, 1, 20, 21, 50, 5),
        {"name": sc.SpanName.REUSE_DECISION.value, "host": "p", "start_ns": T0, "end_ns": T0 + 1,
         "attrs": {sc.REUSE_OUTCOME: sc.ReuseOutcome.PULL.value}},
        {"name": sc.SpanName.REUSE_DECISION.value, "host": "p", "start_ns": T0, "end_ns": T0 + 1,
         "attrs": {sc.REUSE_OUTCOME: sc.ReuseOutcome.EXPIRED.value, sc.ROLE: "prefill"}},
        # the decode's own decision to pull the prompt is not a history reuse
        {"name": sc.SpanName.REUSE_DECISION.value, "host": "d", "start_ns": T0, "end_ns": T0 + 1,
         "attrs": {sc.REUSE_OUTCOME: sc.ReuseOutcome.PULL.value, sc.ROLE: "decode"}},
    ]
    w = workload(syn.spans_frame(recs))
    assert isinstance(w, Workload)
    assert w.n_requests == 5
    assert w.qps == pytest.approx(5 / 43.0)
    assert w.duration_s == pytest.approx(44.0)
    assert sorted(w.gaps_s) == pytest.approx([10.0, 30.0])
    assert sorted(w.gap_tokens) == [110, 160]
    assert sorted(w.final_tokens) == [210, 1020]
    assert w.multi_turn_share == pytest.approx(2 / 5)
    assert w.n_conversations == 3
    assert w.turns_per_conversation_mean == pytest.approx(5 / 3)
    assert w.prompt_tokens_p50 == pytest.approx(150.0)
    assert w.output_tokens_p50 == pytest.approx(10.0)
    assert w.reuse_outcomes == {"expired": 1, "pull": 1}
    assert sorted(r.history_tokens for r in w.requests) == [0, 0, 0, 110, 160]


def test_workload_without_router_spans_uses_conversation_ids():
    spans = syn.serving_spans(syn.SyntheticWorkload(n_conversations=10, turns=(3,)),
                              mode="bidirectional", seed=2)
    with_router = workload(spans)
    no_router = workload(spans[spans["name"] != sc.SpanName.REQUEST.value])
    assert no_router.source == "conversation ids"
    assert no_router.n_requests == with_router.n_requests == 30
    assert len(no_router.gaps_s) == len(with_router.gaps_s) == 20
    # without the router, a turn ends at decode start (no output streaming): gaps grow by that much
    diff = np.array(sorted(no_router.gaps_s)) - np.array(sorted(with_router.gaps_s))
    assert (diff > 0).all() and (diff < 5).all()
    assert math.isnan(no_router.output_tokens_p50)


def test_workload_without_requests_is_a_clear_error():
    frame = syn.spans_frame([{"name": "other", "host": "h", "start_ns": T0, "end_ns": T0 + 1,
                              "attrs": {}}])
    with pytest.raises(AnalysisError, match="no requests"):
        workload(frame)
    with pytest.raises(AnalysisError, match="no requests"):  # probe transfers are not requests
        workload(syn.probe_spans(iterations=3))


def test_workload_without_router_keeps_reverse_spans_out_of_the_previous_turn():
    def span(name, start_s, end_s, turn, base, **attrs):
        return {"name": getattr(name, "value", name), "host": "h", "start_ns": T0 + int(start_s * S),
                "end_ns": T0 + int(end_s * S),
                "attrs": {sc.CONVERSATION_ID: "c", sc.TURN: turn, sc.BASE_REQUEST_ID: base, **attrs}}

    rev = {sc.TRANSFER_ID: "r1:reverse", sc.DIRECTION: sc.Direction.REVERSE.value}
    recs = [
        span(sc.SpanName.PREFILL, 0, 1, 1, "r1", **{sc.PROMPT_TOKENS: 100}),
        span(sc.SpanName.DECODE_START, 1.1, 1.2, 1, "r1"),
        span(sc.SpanName.RETENTION, 1.2, 5.5, 1, "r1"),
        span(sc.SpanName.PREFILL, 5.0, 6.0, 2, "r2", **{sc.PROMPT_TOKENS: 150}),
        # turn 2 pulls turn 1's history back: these spans carry turn 1's request id
        span(sc.SpanName.RDMA, 5.1, 5.2, 2, "r1", **rev),
        span(sc.SpanName.NOTIFY, 5.3, 5.3, 1, "r1", **rev),
    ]
    w = workload(syn.spans_frame(recs))
    assert w.n_requests == 2
    assert w.gaps_s == pytest.approx((3.8,))
    assert w.gap_tokens == (100,)
