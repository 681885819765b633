"""Recommendations: hand-computed threshold and TTL cases (with their edges), mode, findings."""
from __future__ import annotations

import math

import pytest

from kvtune import spans as sc
from kvtune.analysis import FloorFit, PrefillCost, TracedRequest, Workload
from kvtune.errors import AnalysisError, ConfigError
from kvtune.recommend import NEVER, Tuning, recommend
from kvtune.recommend.mode import recommend_mode
from kvtune.recommend.threshold import (PICKUP_MIN_SAMPLES, break_even_tokens, pickup_of,
                                       recommend_threshold)
from kvtune.recommend.ttl import recommend_ttl
from kvtune.testing import synthetic as syn


def _fit(floor_ms: float = 2.0, bw_gbps: float = 8.0, ci: float = 0.0) -> FloorFit:
    return FloorFit(floor_ms=floor_ms, bandwidth_gbps=bw_gbps, per_descriptor_us=None,
                    floor_ci_ms=(floor_ms * (1 - ci), floor_ms * (1 + ci)),
                    bandwidth_ci_gbps=(bw_gbps * (1 - ci), bw_gbps * (1 + ci)),
                    per_descriptor_ci_us=None, r2=0.99, n_transfers=30, n_sizes=3)


def _prefill(per_token_ms: float = 0.05, prefix_us: float = 0.0) -> PrefillCost:
    return PrefillCost(per_token_ms=per_token_ms, per_token_prefix_us=prefix_us, base_ms=3.0,
                       n_observations=20)


# 8 Gbit/s = 1e6 bytes/ms; 10_000 bytes per token -> 0.01 ms per token on the wire
BPT = 10_000


def test_threshold_linear_hand_computed():
    # floor 2 ms + 0.01 ms/token == 0.05 ms/token  ->  R = 2 / 0.04 = 50 tokens
    rec, findings = recommend_threshold(_fit(), _prefill(), bytes_per_token=BPT,
                                        descriptors_per_token=0, max_context_tokens=10_000)
    assert rec.value == 50
    assert rec.evidence.break_even_tokens == pytest.approx(50.0)
    assert rec.evidence.pull_ms_at_break_even == pytest.approx(2.5)
    assert rec.evidence.recompute_ms_at_break_even == pytest.approx(2.5)
    assert rec.unit == "tokens" and rec.name == "kv_recompute_threshold"
    assert findings == []


def test_threshold_prices_the_engines_pickup_of_a_finished_read():
    # floor 2 ms + pickup 1 ms + 0.01 ms/token == 0.05 ms/token  ->  R = 3 / 0.04 = 75 tokens
    pickup = pickup_of([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.5, 1.0, 9.0], n_boot=50)
    assert pickup is not None and pickup.ms == 1.0 and pickup.n == 9
    assert pickup.ci_ms[0] <= 1.0 <= pickup.ci_ms[1] and "median of 9" in pickup.source
    rec, _ = recommend_threshold(_fit(), _prefill(), bytes_per_token=BPT, descriptors_per_token=0,
                                 max_context_tokens=10_000, pickup=pickup)
    assert rec.value == 75
    ev = rec.evidence
    assert ev.floor_ms == 2.0 and ev.pickup_ms == 1.0 and ev.pull_ms_at_break_even == pytest.approx(3.75)
    assert "pickup" in rec.assumptions[0]
    # too few measured pickups: none priced, and the assumptions say so
    assert pickup_of([1.0] * (PICKUP_MIN_SAMPLES - 1)) is None
    rec, _ = recommend_threshold(_fit(), _prefill(), bytes_per_token=BPT, descriptors_per_token=0,
                                 max_context_tokens=10_000)
    assert rec.value == 50 and "not priced" in rec.assumptions[0]
    assert "pickup_ms" not in rec.evidence.as_dict()


def test_threshold_with_attention_term_hand_computed():
    # recompute = 0.05 R + (R^2/2)/1000 * 4us/1e3 = 0.05R + 2e-6 R^2; pull = 2 + 0.01R
    # 2e-6 R^2 + 0.04 R - 2 = 0  ->  R = (-0.04 + sqrt(0.0016 + 1.6e-5)) / 4e-6
    expected = (-0.04 + math.sqrt(0.04 ** 2 + 4 * 2e-6 * 2)) / (2 * 2e-6)
    rec, _ = recommend_threshold(_fit(), _prefill(prefix_us=4.0), bytes_per_token=BPT,
                                 descriptors_per_token=0, max_context_tokens=10_000)
    assert rec.evidence.break_even_tokens == pytest.approx(expected)
    assert rec.value == math.ceil(expected)


def test_threshold_range_from_fit_intervals():
    rec, _ = recommend_threshold(_fit(ci=0.1), _prefill(), bytes_per_token=BPT,
                                 descriptors_per_token=0, max_context_tokens=10_000)
    # optimistic: floor 1.8, 8.8 Gbit/s; pessimistic: floor 2.2, 7.2 Gbit/s
    lo = break_even_tokens(1.8, BPT * 8 / 8.8e9 * 1e3, _prefill())
    hi = break_even_tokens(2.2, BPT * 8 / 7.2e9 * 1e3, _prefill())
    assert rec.range == (math.ceil(lo), math.ceil(hi))
    assert rec.range[0] < rec.value < rec.range[1]


def test_threshold_never_when_floor_is_too_high():
    # floor 1 s: break-even 1000/0.04 = 25000 tokens > the 4000-token histories seen
    rec, findings = recommend_threshold(_fit(floor_ms=1000.0), _prefill(), bytes_per_token=BPT,
                                        descriptors_per_token=0, max_context_tokens=4000)
    assert rec.value == NEVER
    assert [f.code for f in findings] == ["reuse_never_pays"]
    assert "25000 tokens" in findings[0].message


def test_threshold_never_when_wire_is_slower_than_compute():
    rec, _ = recommend_threshold(_fit(bw_gbps=0.8), _prefill(), bytes_per_token=BPT,
                                 descriptors_per_token=0, max_context_tokens=10 ** 9)
    assert rec.value == NEVER and rec.evidence.break_even_tokens is None


def _workload(gaps, gap_tokens, final_tokens, duration_s=100.0) -> Workload:
    n = len(gaps) + len(final_tokens)
    return Workload(n_requests=n, qps=n / duration_s, prompt_tokens_p50=1000,
                    prompt_tokens_p90=1000, prompt_tokens_p99=1000, output_tokens_p50=10,
                    multi_turn_share=len(gaps) / max(n, 1), turns_per_conversation_mean=2.0,
                    gaps_s=tuple(gaps), reuse_outcomes={}, duration_s=duration_s,
                    n_conversations=len(final_tokens), gap_tokens=tuple(gap_tokens),
                    final_tokens=tuple(final_tokens),
                    requests=tuple([TracedRequest(1000, 0, math.nan)] * len(final_tokens)
                                   + [TracedRequest(1100, t, g) for g, t in zip(gaps, gap_tokens)]))


W3 = dict(gaps=[10.0, 20.0, 30.0], gap_tokens=[1000, 1000, 1000], final_tokens=[1000, 1000])


def test_ttl_uncapped_hand_computed():
    # router TTL = 30 s x 1.1 = 33 s; margin = min(30, 33/3) = 11 s -> decode TTL 44 s
    # HBM: 2 x 1e6 B x (1000 x (10+20+30) + 2000 x 44) / 100 s = 2.96 GB < 10 GB
    rec, findings = recommend_ttl(_workload(**W3), bytes_per_token=1e6, hbm_budget_gb=10.0,
                                  threshold_tokens=50)
    assert rec.value == 44
    assert rec.evidence.retained_gb_at_ttl == pytest.approx(2.96)
    assert rec.evidence.router_margin_s == pytest.approx(11.0)
    assert rec.evidence.router_params_ttl_s == pytest.approx(33.0)
    assert rec.evidence.captured_share == pytest.approx(1.0)
    assert findings == []
    assert rec.range[0] <= rec.value <= rec.range[1]


def test_ttl_capped_by_memory_hand_computed():
    # budget 2 GB: 2 x 1e6 x (1000 x (10 + 20 + T) + 2000 T) / 100 / 1e9 = 2 -> T = 23.33 s
    rec, findings = recommend_ttl(_workload(**W3), bytes_per_token=1e6, hbm_budget_gb=2.0,
                                  threshold_tokens=50)
    assert rec.value == 23
    assert rec.evidence.memory_cap_ttl_s == pytest.approx(70 / 3, rel=1e-6)
    # router TTL 23 - 5.75 = 17.25 s: only the 10 s gap is still reused
    assert rec.evidence.captured_share == pytest.approx(1 / 3)
    assert [f.code for f in findings] == ["ttl_capped_by_memory"]
    assert rec.evidence.retained_gb_at_ttl <= 2.0


def test_ttl_zero_budget_retains_nothing():
    rec, findings = recommend_ttl(_workload(**W3), bytes_per_token=1e6, hbm_budget_gb=0.0,
                                  threshold_tokens=50)
    assert rec.value == 0 and rec.evidence.captured_share == 0.0
    assert [f.code for f in findings] == ["ttl_capped_by_memory"]


def test_ttl_ignores_histories_below_threshold():
    rec, _ = recommend_ttl(_workload([10.0, 300.0], [1000, 10], [1000]), bytes_per_token=1e3,
                           hbm_budget_gb=10.0, threshold_tokens=50)
    # router TTL 11 s (the 10 s gap + 10%), plus the router margin: a quarter of the TTL, but at
    # least vLLM's 5 s readback margin + 1 s (kvtune.vllm_pd.MIN_ROUTER_MARGIN_S)
    assert rec.evidence.uncapped_ttl_s == pytest.approx(11.0 + 6.0)


def test_ttl_no_multi_turn():
    rec, findings = recommend_ttl(_workload([], [], [1000, 1000, 1000]), bytes_per_token=1e6,
                                  hbm_budget_gb=10.0, threshold_tokens=50)
    assert rec.value == 0 and rec.range == (0, 0)
    assert [f.code for f in findings] == ["no_multi_turn"]


def test_mode_choices_and_exclusions():
    wl = _workload(**W3)
    fit, pc = _fit(), _prefill()
    kw = dict(bytes_per_token=BPT, descriptors_per_token=0, use_simulator=False)
    rec, _ = recommend_mode(wl, fit, pc, threshold=50, ttl_s=44, **kw)
    ttft = rec.evidence.as_dict()["expected_ttft_ms"]
    assert rec.evidence.model == "analytic"
    assert set(ttft) == {"pull", "push", "bidirectional"}
    # analytic: push saves pull's control hop exactly; bidirectional skips recomputing histories
    assert ttft["pull"]["p50"] - ttft["push"]["p50"] == pytest.approx(2.0)
    assert ttft["bidirectional"]["p50"] < ttft["pull"]["p50"]
    best = min(rec.evidence.allowed, key=lambda m: ttft[m]["p50"])
    gain = 1 - ttft[best]["p50"] / ttft["pull"]["p50"]
    assert rec.value == (best if gain > 0.02 else "pull")
    rec, _ = recommend_mode(wl, fit, pc, threshold=NEVER, ttl_s=44, early_decode_ok=False, **kw)
    assert rec.value == "pull"
    assert set(rec.evidence.excluded) == {"push", "bidirectional"}
    no_turns = _workload([], [], [1000, 1000])
    rec, _ = recommend_mode(no_turns, fit, pc, threshold=50, ttl_s=0, **kw)
    assert rec.value in ("pull", "push") and "bidirectional" in rec.evidence.excluded


def test_a_close_call_between_modes_is_simulated_again_on_a_larger_sample(monkeypatch):
    import kvtune.recommend.mode as M

    calls = []

    def fake_simulated(*args, max_requests, **kwargs):
        calls.append(max_requests)
        close = max_requests == M.DEFAULT_MAX_REQUESTS  # first sample: push and bidi 0.5% apart
        ttft = {"pull": (300.0, 400.0), "push": (200.0, 260.0),
                "bidirectional": (201.0 if close else 180.0, 250.0)}
        return ttft, ()
    monkeypatch.setattr(M, "_simulated", fake_simulated)
    kw = dict(bytes_per_token=BPT, descriptors_per_token=0)
    rec, _ = recommend_mode(_workload(**W3), _fit(), _prefill(), threshold=50, ttl_s=44, **kw)
    assert calls == [M.DEFAULT_MAX_REQUESTS, M.CLOSE_CALL_MAX_REQUESTS]
    assert rec.value == "bidirectional" and any("compared again" in a for a in rec.assumptions)
    # a clear call is made on the first sample
    calls.clear()
    monkeypatch.setattr(M, "_simulated", lambda *a, max_requests, **k: (
        calls.append(max_requests) or ({"pull": (300.0, 1.0), "push": (200.0, 1.0),
                                        "bidirectional": (250.0, 1.0)}, ())))
    rec, _ = recommend_mode(_workload(**W3), _fit(), _prefill(), threshold=50, ttl_s=44, **kw)
    assert calls == [M.DEFAULT_MAX_REQUESTS] and rec.value == "push"
    assert not any("compared again" in a for a in rec.assumptions)


@pytest.fixture(scope="module")
def case_spans():
    case = syn.SyntheticCase(workload=syn.SyntheticWorkload(n_conversations=30))
    return case.spans(mode=sc.Mode.BIDIRECTIONAL, seed=7)


def test_mode_uses_the_simulator_when_present(case_spans):
    pytest.importorskip("kvtune.sim.estimate")
    tu = recommend(case_spans, n_boot=20)
    assert tu.mode.evidence.model == "kvtune.sim"
    assert set(tu.mode.evidence.expected_ttft_ms) == {"pull", "push", "bidirectional"}
    assert tu.mode.evidence.analytic_ttft_ms != tu.mode.evidence.expected_ttft_ms


def test_recommend_end_to_end_on_synthetic(case_spans):
    tu = recommend(case_spans, n_boot=50, use_simulator=False)
    assert isinstance(tu, Tuning)
    assert tu.span_count == len(case_spans) and tu.source == "synthetic"
    assert tu.fit is not None
    assert tu.fit.bandwidth_gbps == pytest.approx(40.0, rel=0.1)
    assert isinstance(tu.threshold.value, int) and tu.threshold.value > 0
    assert tu.threshold.range[0] <= tu.threshold.value <= tu.threshold.range[1]
    assert tu.ttl.value > 0
    assert tu.mode.value in ("pull", "push", "bidirectional")
    assert "fabric_chosen" in {f.code for f in tu.findings}
    d = tu.as_dict()
    assert set(d) >= {"threshold", "ttl", "mode", "findings", "fit", "source", "span_count"}


def test_recommend_finds_tcp_fallback_and_stalls():
    wl = syn.SyntheticWorkload(n_conversations=8, fabric="efa", transport="tcp")
    spans = syn.serving_spans(wl, mode="pull", seed=1)
    rdma = spans.index[spans["name"] == sc.SpanName.DECODE_START.value][0]
    spans.loc[rdma, "end_ns"] = spans.loc[rdma, "start_ns"] + 3_000_000_000  # a 3 s stall
    tu = recommend(spans, n_boot=20, use_simulator=False)
    codes = {f.code for f in tu.findings}
    assert {"tcp_fallback", "stalled_transfers"} <= codes
    stall = next(f for f in tu.findings if f.code == "stalled_transfers")
    assert stall.evidence["worst_phase"] == "decode_start_ms" and stall.evidence["count"] == 1


def test_long_push_rendezvous_waiting_for_prefill_is_not_a_stall():
    slow = syn.PrefillTruth(per_token_ms=1.0)  # 2000-token prompts take >= 2 s to prefill
    spans = syn.serving_spans(syn.SyntheticWorkload(n_conversations=6), mode="push", prefill=slow,
                              seed=2)
    tu = recommend(spans, n_boot=10, use_simulator=False)
    assert "stalled_transfers" not in {f.code for f in tu.findings}


def test_geometry_sets_bytes_per_token(case_spans):
    from kvtune.geometry import KvGeometry

    g = KvGeometry(layers=64, kv_heads=8, head_dim=128, dtype_bytes=2)
    plain = recommend(case_spans, n_boot=10, use_simulator=False)
    with_g = recommend(case_spans, n_boot=10, use_simulator=False, geometry=g)
    # from the transfers: bytes cover whole 16-token blocks, so within a block's worth at most
    assert plain.extra["bytes_per_token"] == pytest.approx(syn.SyntheticWorkload().bytes_per_token,
                                                           rel=0.005)
    assert with_g.extra["bytes_per_token"] == g.bytes_per_token == 262144
    assert with_g.extra["descriptors_per_token"] == pytest.approx(128 / 16)
    # twice the bytes per token: the wire costs more per token, so break-even moves up
    assert with_g.threshold.evidence.break_even_tokens > plain.threshold.evidence.break_even_tokens


def test_recommend_bad_input():
    frame = syn.spans_frame([{"name": sc.SpanName.REQUEST.value, "host": "r", "start_ns": 0,
                              "end_ns": 1, "attrs": {}}])
    with pytest.raises(AnalysisError, match="no KV transfers"):
        recommend(frame)
    one_size = syn.serving_spans(syn.SyntheticWorkload(n_conversations=4, turns=(1,),
                                                       prompt_sigma=0.0), seed=1)
    with pytest.raises(AnalysisError, match="1 distinct size"):
        recommend(one_size)
    with pytest.raises(ConfigError, match="hbm_budget_gb"):
        recommend(one_size, hbm_budget_gb=-1)


def _versioned(spans, decode_vllm: str):
    """The spans as the processes would export them: the decode's on ``decode_vllm``, the others
    (prefill, router) on vLLM 0.32.0, all on NIXL 1.5.1 (resource attributes, as
    kvtune.telemetry sets them). Returns (spans, the services on 0.32.0)."""
    spans = spans.copy()
    decode_svc = sc.service_name(sc.Role.DECODE)
    decode = (spans["service"].astype(str) == decode_svc).to_numpy(dtype=bool)
    assert decode.any() and not decode.all()
    res = {svc: {sc.SERVICE_NAME: svc, sc.NIXL_VERSION: "1.5.1",
                 sc.VLLM_VERSION: decode_vllm if svc == decode_svc else "0.32.0"}
           for svc in set(spans["service"].astype(str))}
    spans["resource"] = [res[svc] for svc in spans["service"].astype(str)]
    return spans, sorted(set(res) - {decode_svc})


def test_versions_from_resources_reach_recommendation_json_and_report(tmp_path):
    import json

    from kvtune.export import files

    spans, others = _versioned(syn.serving_spans(syn.SyntheticWorkload(n_conversations=6),
                                                 mode="pull", seed=3), "0.32.0")
    every = sorted([*others, "kvtune-decode"])
    assert "kvtune-prefill" in every
    tu = recommend(spans, n_boot=10, use_simulator=False)
    assert tu.extra["versions"] == {"vllm": {"0.32.0": every}, "nixl": {"1.5.1": every}}
    assert "mixed_versions" not in {f.code for f in tu.findings}
    out = files.write(tu, tmp_path / "rec")
    rec = json.loads((out / "recommendation.json").read_text())
    assert rec["versions"]["vllm"] == {"0.32.0": every}
    assert "Measured on vLLM 0.32.0, NIXL 1.5.1." in (out / "REPORT.md").read_text()


def test_a_trace_mixing_vllm_releases_gets_a_finding(tmp_path):
    spans, others = _versioned(syn.serving_spans(syn.SyntheticWorkload(n_conversations=6),
                                                 mode="pull", seed=3), "0.33.0")
    tu = recommend(spans, n_boot=10, use_simulator=False)
    (mixed,) = [f for f in tu.findings if f.code == "mixed_versions"]
    assert mixed.severity == "warning"
    assert mixed.evidence["versions"] == {"vllm": {"0.32.0": others,
                                                   "0.33.0": ["kvtune-decode"]}}
    assert f"vllm 0.32.0 ({', '.join(others)}), 0.33.0 (kvtune-decode)" in mixed.message
    # Spans without version attributes (older exports) name nothing and find nothing.
    plain = syn.serving_spans(syn.SyntheticWorkload(n_conversations=6), mode="pull", seed=3)
    tu = recommend(plain, n_boot=10, use_simulator=False)
    assert tu.extra["versions"] == {"vllm": {}, "nixl": {}}
    assert "mixed_versions" not in {f.code for f in tu.findings}


def test_threshold_range_includes_the_prefill_fits_interval():
    # fabric exact; per-token recompute 0.04..0.06 ms: break-even 2/(0.06-0.01)=40 .. 2/(0.04-0.01)=67
    from dataclasses import replace
    pc = replace(_prefill(), per_token_ci_ms=(0.04, 0.06), per_token_prefix_ci_us=(0.0, 0.0))
    rec, _ = recommend_threshold(_fit(), pc, bytes_per_token=BPT, descriptors_per_token=0,
                                 max_context_tokens=10_000)
    assert rec.value == 50
    assert rec.range == (40, 67)
    assert rec.evidence.break_even_range_prefill_tokens == pytest.approx((40.0, 200 / 3))
    assert rec.evidence.break_even_range_fabric_tokens == pytest.approx((50.0, 50.0))
    # without a prefill interval only the fabric's uncertainty is in the range (and it says so)
    rec, _ = recommend_threshold(_fit(), _prefill(), bytes_per_token=BPT, descriptors_per_token=0,
                                 max_context_tokens=10_000)
    assert rec.range == (50, 50)
    assert any("gave no interval" in a for a in rec.assumptions)


def test_prefill_fit_interval_covers_the_truth_on_noisy_spans():
    import numpy as np
    import pandas as pd

    from kvtune.analysis import prefill_cost
    rng = np.random.default_rng(3)
    r = rng.integers(100, 8000, 300).astype(float)
    ms = (5.0 + 0.03 * r + (r ** 2 / 2) / 1000 * 2.0 / 1e3) * (1 + 0.05 * rng.standard_normal(300))
    spans = pd.DataFrame({"name": sc.SpanName.PREFILL.value, sc.COMPUTED_TOKENS: r,
                          sc.CACHED_TOKENS: 0.0, sc.PROMPT_TOKENS: r, "status": "OK",
                          "duration_ms": ms})
    pc = prefill_cost(spans)
    lo, hi = pc.per_token_ci_ms
    assert lo < 0.03 < hi and hi - lo < 0.01
    lo, hi = pc.per_token_prefix_ci_us
    assert lo < 2.0 < hi


def test_evidence_json_keeps_the_shape_recommendation_json_always_had(case_spans):
    tu = recommend(case_spans, n_boot=20, use_simulator=False)
    d = tu.as_dict()
    assert set(d["threshold"]["evidence"]) >= {
        "break_even_tokens", "floor_ms", "bandwidth_gbps", "per_descriptor_us", "bytes_per_token",
        "descriptors_per_token", "wire_ms_per_token", "prefill_per_token_ms",
        "prefill_per_token_prefix_us", "max_context_tokens", "fit_r2", "fit_n_transfers",
        "prefill_n_observations", "pull_ms_at_break_even", "recompute_ms_at_break_even"}
    assert set(d["ttl"]["evidence"]) == {
        "n_gaps", "hbm_budget_gb", "bytes_per_token", "threshold_tokens", "duration_s",
        "peak_to_mean", "gap_s_p50", "gap_s_p90", "gap_s_max", "uncapped_ttl_s",
        "memory_cap_ttl_s", "retained_gb_at_ttl", "captured_share", "captured_share_uncapped",
        "router_decoder_ttl_s", "router_margin_s", "router_params_ttl_s"}
    assert set(d["mode"]["evidence"]) >= {
        "model", "expected_ttft_ms", "analytic_ttft_ms", "allowed", "excluded",
        "multi_turn_share", "prompt_tokens_p50", "qps", "early_decode_ok",
        "prefill_utilisation_pull", "reused_share_bidirectional"}
    assert set(d["mode"]["evidence"]["expected_ttft_ms"]["pull"]) == {"p50", "p99"}
    # cases with less to say leave keys out, as before
    rec, _ = recommend_ttl(_workload([], [], [1000]), bytes_per_token=BPT, hbm_budget_gb=1.0,
                           threshold_tokens=50)
    assert set(rec.as_dict()["evidence"]) == {
        "n_gaps", "hbm_budget_gb", "bytes_per_token", "threshold_tokens", "duration_s",
        "peak_to_mean", "router_decoder_ttl_s", "router_margin_s", "captured_share"}
    rec, _ = recommend_threshold(_fit(bw_gbps=0.8), _prefill(), bytes_per_token=BPT,
                                 descriptors_per_token=0, max_context_tokens=10 ** 9)
    assert "pull_ms_at_break_even" not in rec.as_dict()["evidence"]
