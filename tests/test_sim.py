"""kvtune.sim: mechanisms on hand-computed cases, reuse outcomes, spans, replay, CLI."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from kvtune import spans as S
from kvtune.errors import KvtuneError, SimError
from kvtune.sim import (REQUEST_COLUMNS, DecodeModel, Dist, Overheads, PrefillModel, ReuseSettings,
                        SimConfig, TransferModel, WorkloadSpec, from_fit, simulate)
from kvtune.sim.workload import spec_from_workload

PROMPT = 4096


def tiny(mode: str, **changes) -> SimConfig:
    """A small deployment with round numbers, for hand-computed timelines."""
    cfg = SimConfig(
        mode=mode,
        prefill=PrefillModel(base_ms=5.0, per_token_ms=0.01, per_token_prefix_us=0.0),
        decode=DecodeModel(step_base_ms=10.0, step_per_seq_ms=1.0, step_per_kilotoken_us=0.0),
        transfer=TransferModel(floor_ms=20.0, bandwidth_gbps=80.0, per_descriptor_us=1.0,
                               kv_bytes_per_token=1000, block_tokens=16, descriptors_per_block=10,
                               notify_ms=0.5),
        overheads=Overheads(router_ms=1.0, hop_ms=2.0, registration_base_ms=1.0,
                            registration_per_block_us=0.0),
        workload=WorkloadSpec(qps=1.0, duration_s=1.0, prompt_tokens=Dist.fixed(PROMPT),
                              output_tokens=Dist.fixed(4), turns=Dist.fixed(1)),
    )
    return cfg.with_(**changes) if changes else cfg


def one_request(mode: str, **changes) -> pd.DataFrame:
    frame = pd.DataFrame({"arrival_s": [0.0], "prompt_tokens": [PROMPT], "output_tokens": [4]})
    return simulate(tiny(mode, requests=frame, **changes)).requests


def test_push_single_request_matches_hand_computed_timeline():
    df = one_request("push")
    # prefill: arrives 1 + 2 = 3 ms, computes 5 + 4096 * 0.01 = 45.96 ms -> done 48.96
    # registration: decode at 3, sent at 4, at prefill at 6; descriptors (256 blocks * 10 * 1 us
    # = 2.56 ms) built 6 -> 8.56, overlapping the prefill. WRITE posted at 48.96:
    # 4096 * 1000 B * 8 / 80 Gb/s = 0.4096 ms + 20 floor -> 69.3696; notified 69.8696;
    # the idle decode schedules it at once; first step 10 + 1 = 11 ms -> 80.8696; +2 hop.
    assert df.loc[0, "ttft_ms"] == pytest.approx(82.8696, abs=1e-6)
    assert df.loc[0, "transfer_ms"] == pytest.approx(69.3696 - 6.0, abs=1e-6)  # setup start -> done
    assert df.loc[0, "prefill_ms"] == pytest.approx(45.96)


def test_pull_single_request_matches_hand_computed_timeline():
    df = one_request("pull")
    # prefill done 48.96; back to the router and on to the decode: + 2 * 2 = 52.96; the decode
    # builds descriptors inline (2.56) -> READ posted 55.52; done 55.52 + 0.4096 + 20 = 75.9296;
    # its completion seen 0.5 later, scheduled at once (idle decode), first step 11 ms ->
    # 87.4296; + 2 hop.
    assert df.loc[0, "ttft_ms"] == pytest.approx(89.4296, abs=1e-6)
    assert df.loc[0, "transfer_ms"] == pytest.approx(75.9296 - 52.96, abs=1e-6)


def test_push_hides_descriptor_setup_behind_prefill_and_pull_pays_it():
    push, pull = one_request("push"), one_request("pull")
    extra = pull.loc[0, "ttft_ms"] - push.loc[0, "ttft_ms"]
    # when idle, pull pays the two extra hops and the inline descriptor setup; both see the
    # transfer's end notify_ms later (push: the notification; pull: its READ's completion)
    assert extra == pytest.approx(2 * 2.0 + 2.56, abs=1e-6)


PATH_COSTS = dict(tokenize_per_kilotoken_ms=0.5, handoff_per_kilotoken_ms=0.25,
                  prefill_intake_ms=1.5, decode_intake_ms=2.5, handover_ms=3.0)


def test_pull_pays_each_engines_intake_tokenisation_and_the_longer_handoff():
    base = one_request("pull").loc[0, "ttft_ms"]
    got = one_request("pull", overheads=PATH_COSTS).loc[0, "ttft_ms"]
    kt = PROMPT / 1000
    # prefill leg: tokenised (0.5 ms/kt) then taken in (1.5); decode leg: the handoff grows by
    # 0.25 ms/kt, the decode's API server tokenises it too and its engine takes it in (2.5)
    assert got - base == pytest.approx(kt * 0.5 + 1.5 + kt * 0.25 + kt * 0.5 + 2.5, abs=1e-6)


def test_push_pays_the_prefill_intake_and_the_handover_not_the_decode_intake():
    base = one_request("push").loc[0, "ttft_ms"]
    got = one_request("push", overheads=PATH_COSTS).loc[0, "ttft_ms"]
    # the decode leg (intake, registration) overlaps the 46 ms prefill; the WRITE waits for the
    # handover after it
    assert got - base == pytest.approx(PROMPT / 1000 * 0.5 + 1.5 + 3.0, abs=1e-6)


def test_intake_spans_cover_each_engines_intake(tmp_path):
    res = simulate(tiny("pull", overheads=PATH_COSTS, requests=pd.DataFrame(
        {"arrival_s": [0.0], "prompt_tokens": [PROMPT], "output_tokens": [4]})))
    queue = {s.attributes[S.ROLE]: (s.end_time - s.start_time) / 1e6
             for s in res.spans() if s.name == S.SpanName.QUEUE.value}
    assert queue == {"prefill": pytest.approx(1.5), "decode": pytest.approx(2.5)}


def test_negative_path_costs_are_refused():
    with pytest.raises(SimError, match="Overheads.decode_intake_ms"):
        tiny("pull", overheads={"decode_intake_ms": -1.0})
    with pytest.raises(SimError, match="PrefillModel.loop_per_descriptor_us"):
        tiny("pull", prefill={"loop_per_descriptor_us": float("nan")})


def test_decode_prefix_caching_apart_from_the_prefills():
    wl = WorkloadSpec(qps=1.0, duration_s=5.0, prompt_tokens=Dist.fixed(1600),
                      output_tokens=Dist.fixed(16), turns=Dist.fixed(3), new_tokens=Dist.fixed(160),
                      think_time_s=Dist.fixed(0.5), users=1)
    res = simulate(tiny("pull", workload=wl, reuse={"prefix_caching": False,
                                                     "decode_prefix_caching": True}))
    later = res.requests[res.requests["turn"] >= 2]
    assert len(later) >= 2
    # the prefill recomputes every prompt; the decode's cache holds the last turn's prompt and
    # output, so the READ moves only the whole blocks it lacks (the new 160 tokens and the rest
    # of the last partial block)
    assert (later["computed_tokens"] == later["prompt_tokens"]).all()
    held = (later["history_tokens"] // 16) * 16
    assert (later["forward_tokens"] == later["prompt_tokens"] - held).all()


def test_pull_descriptor_setup_stalls_running_decodes():
    wl = WorkloadSpec(qps=4.0, duration_s=20.0, prompt_tokens=Dist.fixed(8000),
                      output_tokens=Dist.fixed(200), turns=Dist.fixed(1))
    slow_setup = TransferModel(floor_ms=5.0, bandwidth_gbps=800.0, per_descriptor_us=2.0,
                               kv_bytes_per_token=1000, descriptors_per_block=64)
    push = simulate(tiny("push", workload=wl, transfer=slow_setup))
    pull = simulate(tiny("pull", workload=wl, transfer=slow_setup))
    assert push.decode_stall_ms == 0.0
    # 500 blocks * 64 descriptors * 2 us = 64 ms per request, inline in the decode loop
    assert pull.decode_stall_ms == pytest.approx(64.0 * len(pull.requests), rel=1e-9)
    assert pull.requests["tpot_ms"].median() > push.requests["tpot_ms"].median()
    assert pull.requests["ttft_ms"].median() > push.requests["ttft_ms"].median()


def test_decode_loop_descriptor_cost_is_paid_inline_by_pull_only():
    loop = replace(tiny("pull").decode, loop_per_descriptor_us=0.5)
    base_push, base_pull = one_request("push"), one_request("pull")
    push, pull = one_request("push", decode=loop), one_request("pull", decode=loop)
    # 256 blocks * 10 descriptors * 0.5 us = 1.28 ms more inline work before the READ is posted
    assert pull.loc[0, "ttft_ms"] - base_pull.loc[0, "ttft_ms"] == pytest.approx(1.28, abs=1e-6)
    assert push.loc[0, "ttft_ms"] == pytest.approx(base_push.loc[0, "ttft_ms"], abs=1e-9)
    res = simulate(tiny("pull", decode=loop, requests=pd.DataFrame(
        {"arrival_s": [0.0], "prompt_tokens": [PROMPT], "output_tokens": [4]})))
    assert res.decode_stall_ms == pytest.approx(2.56 + 1.28, abs=1e-9)


def test_ttft_warmup_leaves_out_early_arrivals():
    frame = pd.DataFrame({"arrival_s": [0.0, 0.5, 2.0, 3.0], "prompt_tokens": [PROMPT] * 4,
                          "output_tokens": [4] * 4})
    res = simulate(tiny("push", requests=frame))
    assert res.ttft().n_requests == 4
    assert res.ttft(warmup_s=1.0).n_requests == 2
    assert res.ttft(warmup_s=10.0).n_requests == 0


def test_request_table_columns_and_units():
    res = simulate(tiny("push", workload=replace(tiny("push").workload, qps=5.0, duration_s=4.0)))
    df = res.requests
    assert tuple(df.columns) == REQUEST_COLUMNS
    assert len(df) > 5
    assert (df["ttft_ms"] > 0).all() and (df["e2e_ms"] >= df["ttft_ms"]).all()
    assert (df["first_token_s"] * 1e3 >= df["arrival_s"] * 1e3 + df["prefill_ms"]).all()
    assert set(df["mode"]) == {"push"}
    assert df["reuse_outcome"].eq("").all()


def test_deterministic_for_a_seed_and_different_across_seeds():
    cfg = tiny("pull", workload=WorkloadSpec(qps=6.0, duration_s=5.0,
                                             prompt_tokens=Dist("lognormal", (2000, 0.5)),
                                             output_tokens=Dist.fixed(16)))
    a, b = simulate(cfg).requests, simulate(cfg).requests
    pd.testing.assert_frame_equal(a, b)
    c = simulate(cfg.with_(seed=1)).requests
    assert not a["prompt_tokens"].equals(c["prompt_tokens"])


def two_turns(think_s: float, *, ttl_s: float = 30.0, threshold: int = 1024, first: int = 3000,
              capacity: int = 1 << 40, users: int = 1) -> SimConfig:
    wl = WorkloadSpec(qps=0.5, duration_s=2.0, prompt_tokens=Dist.fixed(first),
                      output_tokens=Dist.fixed(50), turns=Dist.fixed(2), new_tokens=Dist.fixed(100),
                      think_time_s=Dist.fixed(think_s), users=users)
    return tiny("bidirectional", workload=wl,
                reuse=ReuseSettings(ttl_s=ttl_s, threshold_tokens=threshold),
                decode=replace(tiny("push").decode, kv_capacity_tokens=capacity))


def test_bidirectional_pulls_history_back_and_computes_only_new_tokens():
    res = simulate(two_turns(1.0))
    df = res.requests.set_index("turn")
    assert df.loc[1, "reuse_outcome"] == S.ReuseOutcome.NONE.value
    assert df.loc[2, "reuse_outcome"] == S.ReuseOutcome.PULL.value
    assert df.loc[2, "history_tokens"] == 3050
    assert df.loc[2, "cached_tokens"] == 3050 and df.loc[2, "computed_tokens"] == 100
    assert df.loc[2, "reverse_tokens"] == 3050 and df.loc[2, "reverse_ms"] > 20.0  # the floor
    # turn 1's history was reused; turn 2's is kept until its TTL runs out
    assert [r.outcome for r in res.retentions] == [S.RetentionOutcome.REUSED.value,
                                                   S.RetentionOutcome.EXPIRED.value]


def test_bidirectional_recomputes_below_the_threshold_and_after_expiry():
    below = simulate(two_turns(1.0, threshold=10_000)).requests.set_index("turn")
    assert below.loc[2, "reuse_outcome"] == S.ReuseOutcome.RECOMPUTE.value
    assert below.loc[2, "computed_tokens"] == below.loc[2, "prompt_tokens"]
    expired = simulate(two_turns(5.0, ttl_s=2.0))
    assert expired.requests.set_index("turn").loc[2, "reuse_outcome"] == S.ReuseOutcome.EXPIRED.value
    assert expired.retentions[0].outcome == S.RetentionOutcome.EXPIRED.value
    assert expired.retentions[0].end - expired.retentions[0].start == pytest.approx(2000.0)


def test_retention_is_capacity_limited():
    # 3 users' histories (3050 tokens each) do not fit beside each other in 5000 tokens
    res = simulate(two_turns(1.0, capacity=5000, users=3).with_(
        workload={"duration_s": 30.0, "users": 3}))
    outcomes = {r.outcome for r in res.retentions}
    assert S.RetentionOutcome.EVICTED.value in outcomes
    assert (res.requests["reuse_outcome"] == S.ReuseOutcome.EXPIRED.value).any()


def test_replay_frame_links_turns_of_a_conversation():
    frame = pd.DataFrame({
        "arrival_s": [0.0, 0.1, 3.0], "prompt_tokens": [2000, 500, 2150], "output_tokens": [50, 5, 20],
        "conversation_id": ["a", "b", "a"]})
    df = simulate(tiny("bidirectional", requests=frame)).requests
    assert list(df["prompt_tokens"]) == [2000, 500, 2150]
    assert list(df["turn"]) == [1, 1, 2]
    assert df.loc[2, "history_tokens"] == 2050
    assert df.loc[2, "reuse_outcome"] == S.ReuseOutcome.PULL.value


def test_replay_rejects_bad_frames():
    with pytest.raises(SimError, match="missing column"):
        simulate(tiny("push", requests=pd.DataFrame({"arrival_s": [0.0]})))
    with pytest.raises(SimError, match="prompt_tokens"):
        simulate(tiny("push", requests=pd.DataFrame(
            {"arrival_s": [0.0], "prompt_tokens": [-3], "output_tokens": [1]})))


def test_config_errors_name_the_field():
    with pytest.raises(SimError, match="SimConfig.mode"):
        tiny("sideways")
    with pytest.raises(SimError, match="WorkloadSpec.qps"):
        WorkloadSpec(qps=0)
    with pytest.raises(KvtuneError, match="Dist"):
        Dist.parse("zipf:1")
    with pytest.raises(SimError, match="DecodeModel.loop_per_descriptor_us"):
        tiny("pull", decode=DecodeModel(step_base_ms=1.0, loop_per_descriptor_us=-1.0))
    with pytest.raises(SimError, match="floor_fit.floor_ms"):
        from_fit(SimpleNamespace(floor_ms=None, bandwidth_gbps=1.0), None)


def test_dist_parse_and_sample():
    assert Dist.parse("16000") == Dist.fixed(16000)
    d = Dist.parse("lognormal:2000,0.5")
    x = d.sample(np.random.default_rng(0), 20000)
    assert np.median(x) == pytest.approx(2000, rel=0.03)
    assert Dist.parse("empirical:1,2,3").mean() == 2.0


def test_from_fit_takes_fabric_and_prefill_fields():
    fit = SimpleNamespace(floor_ms=12.5, bandwidth_gbps=100.0, per_descriptor_us=None)
    cost = SimpleNamespace(per_token_ms=0.02, per_token_prefix_us=1.5, base_ms=3.0)
    cfg = from_fit(fit, cost, mode="pull")
    assert cfg.mode is S.Mode.PULL
    assert (cfg.transfer.floor_ms, cfg.transfer.bandwidth_gbps, cfg.transfer.per_descriptor_us) == (12.5, 100.0, 0.0)
    assert cfg.prefill.compute_ms(1000, 2000) == pytest.approx(3.0 + 20.0 + (2000 + 500) * 1.5 / 1e3)
    try:
        from kvtune.analysis import FloorFit
    except ImportError:  # built in parallel
        return
    real = FloorFit(floor_ms=7.0, bandwidth_gbps=50.0, per_descriptor_us=0.3, floor_ci_ms=(6.0, 8.0),
                    bandwidth_ci_gbps=(40.0, 60.0), per_descriptor_ci_us=(0.2, 0.4), r2=0.99,
                    n_transfers=100, n_sizes=6)
    cfg = from_fit(real, None)
    assert cfg.transfer.floor_ms == 7.0 and cfg.transfer.per_descriptor_us == 0.3


def test_spec_from_workload_summary():
    w = SimpleNamespace(n_requests=500, qps=3.0, prompt_tokens_p50=4000, prompt_tokens_p90=9000,
                        prompt_tokens_p99=15000, output_tokens_p50=200, multi_turn_share=0.8,
                        turns_per_conversation_mean=5.0, gaps_s=(2.0, 4.0, 8.0), reuse_outcomes={},
                        duration_s=120.0)
    spec = spec_from_workload(w)
    assert spec.qps == 3.0 and spec.duration_s == 120.0
    assert spec.prompt_tokens.kind == "lognormal" and spec.prompt_tokens.params[0] == 4000
    assert spec.turns.mean() == pytest.approx(5.0, rel=0.1)
    assert spec.think_time_s == Dist("empirical", (2.0, 4.0, 8.0))
    with pytest.raises(SimError, match="workload.qps"):
        spec_from_workload(SimpleNamespace(qps=None, prompt_tokens_p50=1))


def test_spec_from_workload_draws_sessions_as_traced():
    # two-turn sessions (the public reuse benchmark's users): a geometric law with mean 2 would
    # make half of them single-turn and some 4+ turns; the traced counts are what is played
    base = dict(n_requests=40, qps=1.0, prompt_tokens_p50=4000, prompt_tokens_p90=4000,
                output_tokens_p50=200, turns_per_conversation_mean=2.0, gaps_s=(3.0,) * 20,
                duration_s=60.0)
    assert spec_from_workload(SimpleNamespace(**base, turns_per_conversation=(2,) * 20)
                              ).turns == Dist.fixed(2)
    mixed = spec_from_workload(SimpleNamespace(**base, turns_per_conversation=(1, 3, 3)))
    assert mixed.turns == Dist("empirical", (1.0, 3.0, 3.0))
    geometric = spec_from_workload(SimpleNamespace(**base))
    assert geometric.turns.kind == "empirical" and len(set(geometric.turns.params)) > 3


def _sim_for_spans(mode: str):
    if mode == "bidirectional":
        return simulate(two_turns(1.0).with_(workload={"duration_s": 10.0, "qps": 1.0}))
    return simulate(tiny(mode, workload=replace(tiny(mode).workload, qps=4.0, duration_s=3.0)))


@pytest.mark.parametrize("mode", ["push", "pull", "bidirectional"])
def test_spans_follow_the_convention_and_round_trip(tmp_path, mode):
    res = _sim_for_spans(mode)
    path = tmp_path / "spans.jsonl"
    n = res.write_spans(path)
    mem = res.spans()
    assert n == len(mem) > 0
    names = {s.name for s in mem}
    assert names <= S.span_names()
    for s in mem:
        for key in s.attributes:
            assert key in S.ATTRIBUTE_TYPES, key
            assert isinstance(s.attributes[key], S.ATTRIBUTE_TYPES[key]) or (
                S.ATTRIBUTE_TYPES[key] is float and isinstance(s.attributes[key], int)), key
        assert s.end_time >= s.start_time
    expected = {S.SpanName.REQUEST, S.SpanName.QUEUE, S.SpanName.PREFILL,
                S.SpanName.DESCRIPTOR_SETUP, S.SpanName.RDMA, S.SpanName.NOTIFY,
                S.SpanName.DECODE_START}
    if mode == "push":
        expected |= {S.SpanName.REGISTRATION, S.SpanName.RENDEZVOUS}
    if mode == "bidirectional":
        expected |= {S.SpanName.REUSE_DECISION, S.SpanName.RETENTION}
    assert names == {e.value for e in expected}
    rdma = [s for s in mem if s.name == S.SpanName.RDMA.value]
    op = {S.NixlOp.WRITE.value} if mode == "push" else {S.NixlOp.READ.value}
    assert {s.attributes[S.NIXL_OP] for s in rdma if s.attributes[S.DIRECTION] == "forward"} == op
    lines = path.read_text().splitlines()
    doc = json.loads(lines[0])
    services = {a["value"]["stringValue"] for rs in doc["resourceSpans"]
                for a in rs["resource"]["attributes"] if a["key"] == S.SERVICE_NAME}
    assert services == {S.service_name(r) for r in ("router", "prefill", "decode")}

    traces = pytest.importorskip("kvtune.traces")
    df = traces.load(path)
    assert len(df) == n
    assert set(df["name"]) == names
    assert all(v == 0 for v in df.attrs["clock_offsets_ns"].values())  # one consistent clock
    req = df[df["name"] == S.SpanName.REQUEST.value]
    merged = req.merge(res.requests, left_on=S.REQUEST_ID, right_on="request_id")
    assert np.allclose(merged[S.TTFT_MS].astype(float), merged["ttft_ms"])
    tids = df[S.TRANSFER_ID].dropna()
    assert tids.str.endswith(":forward").any()
    if mode == "bidirectional":
        assert tids.str.endswith(":reverse").any()


def test_transfers_table_from_simulated_spans(tmp_path):
    traces = pytest.importorskip("kvtune.traces")
    analysis = pytest.importorskip("kvtune.analysis")
    if not hasattr(analysis, "transfers"):
        pytest.skip("kvtune.analysis.transfers not built yet")
    res = _sim_for_spans("push")
    res.write_spans(tmp_path / "s.jsonl")
    tr = analysis.transfers(traces.load(tmp_path / "s.jsonl")).set_index("request_id")
    reqs = {r.idx: r for r in res.timeline.requests}
    assert len(tr) == len(reqs)
    for idx, r in reqs.items():
        row = tr.loc[f"sim-{idx:08d}"]
        assert row["bytes"] == PROMPT * 1000 and row["descriptors"] == 256 * 10
        assert row["descriptor_setup_ms"] == pytest.approx(2.56, abs=1e-3)
        # WRITE: the 20 ms floor + 0.4096 ms on the wire, plus any wait for the link
        assert row["rdma_ms"] == pytest.approx(r.rdma_end - r.rdma_post, abs=1e-3)
        assert row["rdma_ms"] >= 20.4096 - 1e-3
        assert row["decode_start_ms"] == pytest.approx(r.decode_start - r.kv_ready, abs=1e-3)


def test_cli_writes_spans_requests_and_summary(tmp_path, capsys):
    from kvtune.cli import main
    out = tmp_path / "run"
    rc = main(["sim", "--preset", "public-h200-qwen3-32b", "--mode", "push", "--qps", "2",
               "--prompt-tokens", "4000", "--duration-s", "5", "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "push" and summary["requests"] > 0
    n_spans = sum(len(ss["spans"]) for line in (out / "spans.jsonl").read_text().splitlines()
                  for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"])
    assert summary["spans"] == n_spans > summary["requests"]
    reqs = pd.read_csv(out / "requests.csv")
    assert tuple(reqs.columns) == REQUEST_COLUMNS and len(reqs) == summary["requests"]
    assert json.loads(capsys.readouterr().out) == summary


def test_cli_reports_bad_arguments(tmp_path, capsys):
    from kvtune.cli import main
    rc = main(["sim", "--prompt-tokens", "zipf:2", "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "Dist.kind" in capsys.readouterr().err


def test_ttft_estimate_handles_empty_selection():
    res = simulate(tiny("push", requests=pd.DataFrame(
        {"arrival_s": [0.0], "prompt_tokens": [10], "output_tokens": [1]})))
    est = res.ttft(min_turn=2)
    assert est.n_requests == 0 and math.isnan(est.p50_ms)


def test_replay_from_simulated_spans_reproduces_the_traffic(tmp_path):
    traces = pytest.importorskip("kvtune.traces")
    from kvtune.sim.workload import load_replay, requests_from_spans
    first = simulate(two_turns(1.0).with_(workload={"duration_s": 10.0, "users": 2}))
    first.write_spans(tmp_path / "a.jsonl")
    frame = requests_from_spans(traces.load(tmp_path / "a.jsonl"))
    assert len(frame) == len(first.requests)
    assert sorted(frame["prompt_tokens"]) == sorted(first.requests["prompt_tokens"])
    assert frame["arrival_s"].min() == 0.0
    again = simulate(tiny("bidirectional", requests=load_replay(str(tmp_path / "a.jsonl"))))
    df = again.requests
    assert list(df["turn"].value_counts().sort_index()) == list(
        first.requests["turn"].value_counts().sort_index())
    assert (df.loc[df["turn"] == 2, "reuse_outcome"] == S.ReuseOutcome.PULL.value).all()
    with pytest.raises(SimError, match="kv.request"):
        requests_from_spans(traces.load(tmp_path / "a.jsonl").query("name == 'kv.prefill'"))


def test_xpyd_spreads_requests_over_instances():
    wl = WorkloadSpec(qps=20.0, duration_s=5.0, prompt_tokens=Dist.fixed(2000),
                      output_tokens=Dist.fixed(50), turns=Dist.fixed(1))
    one = simulate(tiny("push", workload=wl))
    two = simulate(tiny("push", workload=wl, prefill_instances=2, decode_instances=3))
    assert two.config.topology == "2P3D"
    assert set(two.requests["prefill_instance"]) == {0, 1}
    assert set(two.requests["decode_instance"]) == {0, 1, 2}
    # prefill is the bottleneck here (20 x 25 ms per second): a second instance removes the queue
    assert two.requests["queue_ms"].mean() < one.requests["queue_ms"].mean()
    assert two.ttft().p50_ms < one.ttft().p50_ms


def test_cli_replays_span_files(tmp_path, capsys):
    from kvtune.cli import main
    src = simulate(two_turns(1.0).with_(workload={"duration_s": 6.0, "users": 2}))
    src.write_spans(tmp_path / "in.jsonl")
    rc = main(["sim", "--mode", "bidirectional", "--replay", str(tmp_path / "in.jsonl"),
               "--out", str(tmp_path / "out"), "--no-spans"])
    assert rc == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["requests"] == len(src.requests)
    assert not (tmp_path / "out" / "spans.jsonl").exists()


@pytest.mark.parametrize("mode", ["push", "pull", "bidirectional"])
def test_prefix_caching_on_the_prefill_is_a_local_hit(mode):
    cfg = two_turns(1.0).with_(mode=mode, reuse={"prefix_caching": True})
    df = simulate(cfg).requests.set_index("turn")
    if mode == "bidirectional":
        # the decode holds 3050 (prompt + output), the prefill 2992 (whole blocks of its prompt):
        # vLLM pulls only the 58 it lacks, and only when they reach the threshold (1024 here)
        assert df.loc[2, "reuse_outcome"] == S.ReuseOutcome.RECOMPUTE.value
        assert df.loc[2, "cached_tokens"] == 2992
        low = simulate(cfg.with_(reuse={"prefix_caching": True, "threshold_tokens": 16}))
        turn2 = low.requests.set_index("turn").loc[2]
        assert turn2["reuse_outcome"] == S.ReuseOutcome.PULL.value
        assert turn2["cached_tokens"] == 3050 and turn2["reverse_tokens"] == 58
    else:  # the prefill cached turn 1's prompt (whole 16-token blocks: 2992 of 3000); turn 2
        # computes the rest, the output and the new tokens
        assert df.loc[2, "cached_tokens"] == 2992
        assert df.loc[2, "computed_tokens"] == df.loc[2, "prompt_tokens"] - 2992
        # the decode's own cache holds turn 1's prompt + output (3050 -> 3040 in whole blocks):
        # a pull's READ moves only the rest, as vLLM's decode-side prefix hit does, and push
        # registers only the blocks it lacks, so the prefill WRITEs only those (kv.bytes of the
        # push WRITEs on the local pair: one block for a turn adding 56 tokens to 2560)
        assert df.loc[2, "forward_tokens"] == df.loc[2, "prompt_tokens"] - 3040
        assert df.loc[1, "forward_tokens"] == df.loc[1, "prompt_tokens"]
    if mode != "bidirectional":  # a cache smaller than the prompt keeps only a prefix of it
        small = simulate(cfg.with_(reuse={"prefix_caching": True, "prefill_cache_tokens": 1000}))
        assert small.requests.set_index("turn").loc[2, "cached_tokens"] == 992


def test_retention_released_when_recomputed_unless_the_decode_keeps_it_as_prefix():
    rec = simulate(two_turns(1.0, threshold=10_000))
    assert rec.retentions[0].outcome == S.RetentionOutcome.RELEASED.value
    keep = simulate(two_turns(1.0, threshold=10_000).with_(reuse={"decode_local_prefix": True}))
    assert keep.retentions[0].outcome == S.RetentionOutcome.REUSED.value
    turn2 = keep.requests.set_index("turn").loc[2]
    assert turn2["forward_tokens"] == turn2["prompt_tokens"] - 3050  # only what the decode lacks


def test_reuse_only_within_the_routers_ttl():
    """The router offers retained history back only until the decode TTL minus its margin (vLLM's
    5 s readback margin + 1 s): 2-4 s gaps are reused at a 30 s TTL, never at 5 s or 8 s."""
    from kvtune.sim import presets, simulate
    from kvtune.spans import ReuseOutcome

    def pulled(ttl_s: float) -> int:
        cfg = presets.configure(mode="bidirectional", qps=0.5, duration_s=120.0, prompt_tokens=4000,
                                turns=2, new_tokens=50, think_time_s="uniform:2,4", ttl_s=ttl_s,
                                threshold_tokens=16, seed=3)
        return sum(r.outcome == ReuseOutcome.PULL.value for r in simulate(cfg).timeline.requests)

    assert pulled(30.0) > 10
    assert pulled(8.0) == 0 and pulled(5.0) == 0


def test_round_robin_users_send_their_conversations_turns_in_turn():
    wl = WorkloadSpec(qps=1.0, duration_s=30.0, prompt_tokens=Dist.fixed(500),
                      output_tokens=Dist.fixed(4), turns=Dist.fixed(3), new_tokens=Dist.fixed(50),
                      think_time_s=Dist.fixed(0.0), users=1, conversations_per_user=3)
    df = simulate(tiny("pull", workload=wl)).requests.sort_values("arrival_s")
    # one request at a time, each right after the previous one finished
    assert (df["arrival_s"].to_numpy()[1:] >= df["done_s"].to_numpy()[:-1] - 1e-9).all()
    first = df.head(9)
    # three conversations' first turns, then their second turns, then their third
    assert first["turn"].tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert first["conversation_id"].tolist()[:3] == first["conversation_id"].tolist()[3:6]
    # a finished conversation is replaced: the user keeps three going
    assert df["conversation_id"].nunique() > 3
    with pytest.raises(SimError, match="conversations_per_user"):
        replace(wl, conversations_per_user=0)
