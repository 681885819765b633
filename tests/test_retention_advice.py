"""Fixed TTL vs the renewable decode lease (issue 28, phase 2): conversations from spans, the
policy model in the simulator, the advice, and what the export writes."""
from __future__ import annotations

import dataclasses
import json
import math

import pandas as pd
import pytest
import yaml

from kvtune import spans as sc
from kvtune import vllm_pd
from kvtune.analysis.conversations import Conversation, conversations
from kvtune.export import write
from kvtune.recommend import recommend
from kvtune.recommend import retention as R
from kvtune.recommend import tuning as tuning_mod
from kvtune.sim.retention import FixedTtl, Lease, play, sweep_ttl
from kvtune.testing import synthetic as syn

T0, S = 1_700_000_000_000_000_000, 1_000_000_000
BLOCK = 16
TOK = 1600  # 100 blocks


def _conv(gaps, end_after_s=None, cid="c") -> Conversation:
    return Conversation(cid, tuple(gaps), tuple([TOK] * len(gaps)), TOK, end_after_s)


# --- the policy model (kvtune.sim.retention) --------------------------------------------------
def test_fixed_ttl_hand_computed():
    c = _conv([10.0, 100.0, 460.0])  # 460 s: held 460 s, past the router's 450 s: recomputed
    r = play([c], FixedTtl(480.0), block_tokens=BLOCK)
    assert r.block_s == pytest.approx(100 * (10 + 100 + 460 + 480))
    assert r.captured_share == pytest.approx(2 / 3)
    assert r.n_released_at_end == 0


def test_fixed_ttl_holds_an_ended_conversation_for_the_whole_ttl():
    ended = play([_conv([5.0], end_after_s=0.0)], FixedTtl(480.0), block_tokens=BLOCK)
    open_ = play([_conv([5.0])], FixedTtl(480.0), block_tokens=BLOCK)
    assert ended.block_s == open_.block_s == pytest.approx(100 * (5 + 480))


def test_lease_explicit_end_releases_at_once():
    lease = Lease(lease_s=30.0, renew_every_s=10.0, idle_s=450.0, first_hold_s=480.0)
    r = play([_conv([5.0, 20.0], end_after_s=0.0)], lease, block_tokens=BLOCK)
    assert r.block_s == pytest.approx(100 * (5 + 20))  # nothing held after the end
    assert r.n_released_at_end == 1 and r.captured_share == 1.0
    later = play([_conv([5.0], end_after_s=12.5)], lease, block_tokens=BLOCK)
    assert later.block_s == pytest.approx(100 * (5 + 12.5))


def test_lease_gap_past_the_live_window_lapses():
    lease = Lease(lease_s=30.0, renew_every_s=10.0, idle_s=95.0, first_hold_s=30.0)
    assert lease.lapse_s == 90.0 + 30.0  # last renewal at 90 s (the 100 s one is past idle)
    r = play([_conv([200.0])], lease, block_tokens=BLOCK)
    assert r.captured_share == 0.0  # the router forgot the params: the turn recomputes
    # held until the lapse across the gap, and again after the last turn
    assert r.block_s == pytest.approx(100 * (120.0 + 120.0))
    inside = play([_conv([94.0])], lease, block_tokens=BLOCK)
    assert inside.captured_share == 1.0
    # the decode's own first hold is a floor: renewals never shorten it
    assert dataclasses.replace(lease, first_hold_s=480.0).lapse_s == 480.0


def test_lease_captures_the_480s_ttl_reuse_with_a_fraction_of_its_block_seconds():
    # agents: short tool-call gaps, one long think, most conversations end explicitly
    convs = [_conv([0.5, 2.0, 30.0, 300.0], end_after_s=0.0, cid=f"e{i}") for i in range(8)]
    convs += [_conv([1.0, 8.0], cid=f"o{i}") for i in range(2)]
    ttl = play(convs, FixedTtl(480.0), block_tokens=BLOCK)
    lease = R.choose_lease(convs, 480.0)
    assert lease.idle_s == vllm_pd.router_ttl_s(480.0)
    leased = play(convs, lease, block_tokens=BLOCK)
    assert leased.captured_tokens >= ttl.captured_tokens and leased.captured_share == 1.0
    assert leased.block_s < 0.5 * ttl.block_s


@pytest.mark.parametrize("ttl_s", [84.0, 120.0, 480.0, 1800.0])
@pytest.mark.parametrize("median_gap_s", [0.5, 25.0, 90.0])
def test_chosen_lease_never_holds_more_than_its_ttl(ttl_s, median_gap_s):
    gaps = [median_gap_s / 10, median_gap_s, median_gap_s * 10, ttl_s * 2]
    convs = [_conv(gaps, cid=f"o{i}") for i in range(3)]
    lease = R.choose_lease(convs, ttl_s)
    assert lease.lapse_s <= ttl_s
    fixed, leased = (play(convs, p, block_tokens=BLOCK) for p in (FixedTtl(ttl_s), lease))
    assert leased.block_s <= fixed.block_s and leased.captured_tokens == fixed.captured_tokens


def test_sweep_is_monotone_in_capture_and_memory():
    convs = [_conv([5.0, 50.0, 500.0, 5000.0])]
    out = sweep_ttl(convs, (60.0, 480.0, 7200.0), block_tokens=BLOCK)
    shares = [r.captured_share for _, r in out]
    held = [r.block_s for _, r in out]
    assert shares == sorted(shares) and held == sorted(held) and shares[0] < shares[-1]


def test_threshold_leaves_short_histories_out_of_reuse():
    c = Conversation("c", (5.0, 5.0), (100, 2000), 2000)
    r = play([c], FixedTtl(480.0), threshold_tokens=256, block_tokens=BLOCK)
    assert r.reusable_tokens == 2000 and r.captured_share == 1.0
    nothing = play([c], FixedTtl(480.0), threshold_tokens=math.inf, block_tokens=BLOCK)
    assert math.isnan(nothing.captured_share)


# --- conversations from spans (kvtune.analysis.conversations) ---------------------------------
def _span(name: str, start_s: float, end_s: float, **attrs) -> dict:
    return {"name": name, "host": "router", "start_ns": T0 + int(start_s * S),
            "end_ns": T0 + int(end_s * S), "attrs": attrs}


def _request(conv: str, turn: int, start_s: float, end_s: float, prompt: int, output: int,
             **attrs) -> dict:
    return _span(sc.SpanName.REQUEST.value, start_s, end_s, **{
        sc.CONVERSATION_ID: conv, sc.TURN: turn, sc.PROMPT_TOKENS: prompt,
        sc.OUTPUT_TOKENS: output, **attrs})


def test_conversations_gaps_and_ends_from_spans():
    rows = [
        _request("a", 1, 0.0, 1.0, 1000, 100),
        _request("a", 2, 4.0, 5.0, 1200, 100),
        _request("a", 3, 65.0, 66.0, 1400, 50, **{sc.CONVERSATION_END: True}),
        _request("b", 1, 0.0, 2.0, 500, 20),
        _request("b", 2, 12.0, 13.0, 600, 20),
        # the decode released b's blocks 7 s after its last turn (POST /v1/conversations/end)
        _span(sc.SpanName.RETENTION.value, 13.0, 20.0, **{
            sc.CONVERSATION_ID: "b", sc.TURN: 2,
            sc.RETENTION_OUTCOME: sc.RetentionOutcome.ENDED.value}),
        _request("c", 1, 0.0, 1.0, 300, 30),
        _request("c", 2, 3.0, 4.0, 400, 30),
        _span(sc.SpanName.RETENTION.value, 4.0, 484.0, **{
            sc.CONVERSATION_ID: "c", sc.TURN: 2,
            sc.RETENTION_OUTCOME: sc.RetentionOutcome.LAPSED.value}),
    ]
    got = {c.conversation_id: c for c in conversations(syn.spans_frame(rows))}
    assert got["a"] == Conversation("a", (3.0, 60.0), (1100, 1300), 1450, 0.0)
    assert got["b"].gaps_s == (10.0,) and got["b"].end_after_s == pytest.approx(7.0)
    assert got["c"].gap_tokens == (330,) and got["c"].final_tokens == 430
    assert not got["c"].ended  # a lapse is no explicit end


# --- the advice (kvtune.recommend.retention) -------------------------------------------------
def test_compare_recommends_the_lease_only_when_it_saves():
    ending = [_conv([1.0, 30.0], end_after_s=0.0, cid=f"e{i}") for i in range(9)] + [_conv([2.0])]
    adv = R.compare(ending, ttl_s=120.0, mode="bidirectional", threshold_tokens=0,
                    block_tokens=BLOCK)
    assert adv.policy == R.POLICY_LEASE and adv.lease_recommended
    assert adv.block_s["lease"] < adv.block_s["fixed_ttl"]
    assert adv.captured_share["lease"] >= adv.captured_share["fixed_ttl"]
    assert R.LEASE_MIN_S <= adv.lease_s <= vllm_pd.router_margin_s(120.0)
    assert adv.renew_every_s <= min(adv.lease_s, 120.0) - vllm_pd.MIN_ROUTER_MARGIN_S
    assert {s["ttl_s"] for s in adv.sweep} >= {120.0, 480.0}
    assert R.RetentionAdvice.from_dict(json.loads(json.dumps(adv.as_dict()))) == adv
    never_end = [_conv([1.0, 30.0], cid=f"o{i}") for i in range(10)]
    kept = R.compare(never_end, ttl_s=120.0, mode="bidirectional", threshold_tokens=0,
                     block_tokens=BLOCK)
    assert kept.policy == R.POLICY_FIXED_TTL and kept.lease_s is None
    pull = R.compare(ending, ttl_s=120.0, mode="pull", threshold_tokens=0, block_tokens=BLOCK)
    assert pull.policy == R.POLICY_FIXED_TTL
    with pytest.raises(ValueError, match="shortest lease"):
        R.compare(ending, ttl_s=10.0, mode="bidirectional", threshold_tokens=0,
                  block_tokens=BLOCK)


@pytest.fixture(scope="module")
def case_spans():
    case = syn.SyntheticCase(workload=syn.SyntheticWorkload(n_conversations=30))
    return case.spans(mode=sc.Mode.BIDIRECTIONAL, seed=7)


def test_comparison_failure_is_a_finding_and_changes_no_value(case_spans, monkeypatch):
    base = recommend(case_spans, n_boot=20, use_simulator=False)

    def boom(*a, **k):
        raise RuntimeError("model broke")

    monkeypatch.setattr(tuning_mod, "compare_retention", boom)
    broken = recommend(case_spans, n_boot=20, use_simulator=False)
    for name in ("threshold", "ttl", "mode"):
        assert getattr(broken, name).as_dict() == getattr(base, name).as_dict()
    assert broken.retention is None
    assert "retention_comparison_failed" in {f.code for f in broken.findings}
    assert "retention_comparison_failed" not in {f.code for f in base.findings}


# --- what the export writes --------------------------------------------------------------------
def _tuning_with(case_spans, policy: str):
    tu = recommend(case_spans, n_boot=10, use_simulator=False)
    tu = dataclasses.replace(tu, ttl=dataclasses.replace(tu.ttl, value=120))
    ttl = float(tu.ttl.value)
    ret = {"policy": policy, "lease_s": 30.0 if policy == R.POLICY_LEASE else None,
           "renew_every_s": 10.0 if policy == R.POLICY_LEASE else None,
           "idle_s": vllm_pd.router_ttl_s(ttl) if policy == R.POLICY_LEASE else None,
           "ttl_s": ttl, "block_s": {"fixed_ttl": 1000.0, "lease": 200.0},
           "captured_share": {"fixed_ttl": 0.9, "lease": 0.9}, "sweep": [],
           "evidence": {"why": "test", "ended_share": 0.8}}
    mode = dataclasses.replace(tu.mode, value=sc.Mode.BIDIRECTIONAL.value)
    return dataclasses.replace(tu, mode=mode, retention=ret)


@pytest.mark.parametrize("policy", [R.POLICY_LEASE, R.POLICY_FIXED_TTL])
def test_router_yaml_carries_the_lease_only_when_recommended(case_spans, tmp_path, policy):
    from kvtune.router.config import config_from_dict

    tu = _tuning_with(case_spans, policy)
    out = write(tu, tmp_path / "out", model="m")
    router = config_from_dict(yaml.safe_load((out / "router.yaml").read_text()),
                              source="router.yaml")  # validates the lease fields
    decode = json.loads((out / "decode.kv-transfer-config.json").read_text())
    extra = decode[vllm_pd.KV_CONNECTOR_EXTRA_CONFIG]
    rec = json.loads((out / "recommendation.json").read_text())
    assert rec["retention"]["policy"] == policy
    report = (out / "REPORT.md").read_text()
    assert f"retention: **{policy}**" in report
    if policy == R.POLICY_LEASE:
        assert (router.lease_s, router.lease_renew_every_s) == (30.0, 10.0)
        assert extra[vllm_pd.LEASE_PORT] == 0
    else:
        assert router.lease_s is None and vllm_pd.LEASE_PORT not in extra
    # the TTL written is the TTL recommended, whichever policy
    assert extra[vllm_pd.DECODER_KV_BLOCKS_TTL] == int(tu.ttl.value)


def test_recommendation_round_trips_with_retention(case_spans):
    from kvtune.recommend.results import Tuning

    tu = recommend(case_spans, n_boot=10, use_simulator=False)
    d = json.loads(json.dumps(tu.as_dict()))
    assert Tuning.from_dict(d).as_dict() == d
    assert "retention" in d
    old = {k: v for k, v in d.items() if k != "retention"}  # a file written before phase 2
    assert Tuning.from_dict(old).retention is None


def test_frame_helper_is_the_loaders_shape():
    df = syn.spans_frame([_request("a", 1, 0.0, 1.0, 10, 1)])
    assert isinstance(df, pd.DataFrame) and sc.CONVERSATION_END in df.columns


def test_ttl_card_says_which_retention_policy():
    from kvtune.tune.headline import _retention_text

    assert _retention_text(None) == ""
    lease = {"policy": "lease", "lease_s": 30.0, "renew_every_s": 10.0,
             "block_s": {"fixed_ttl": 1000.0, "lease": 200.0},
             "captured_share": {"fixed_ttl": 0.9, "lease": 0.9}, "evidence": {"why": "x"}}
    text = _retention_text(lease)
    assert "Renewable lease recommended" in text and "200" in text and "1000" in text
    fixed = _retention_text({**lease, "policy": "fixed_ttl", "evidence": {"why": "few end"}})
    assert "fixed TTL stays (few end)" in fixed


def test_explicit_ends_in_a_trace_make_the_lease_the_advice_and_no_value_moves(case_spans,
                                                                                 tmp_path):
    from kvtune.router.config import config_from_dict

    df = case_spans.copy()
    req = (df["name"].astype("object") == sc.SpanName.REQUEST.value).to_numpy(dtype=bool)
    last = df[req].groupby(sc.CONVERSATION_ID)[sc.TURN].transform("max")
    ends = pd.Series(False, index=df.index)
    ends[last.index] = (df.loc[last.index, sc.TURN] == last).to_numpy(dtype=bool)
    df[sc.CONVERSATION_END] = ends.astype("boolean")
    assert ends.sum() == 30
    base = recommend(case_spans, n_boot=10, use_simulator=False)
    tu = recommend(df, n_boot=10, use_simulator=False)
    for name in ("threshold", "ttl", "mode"):
        assert getattr(tu, name).as_dict() == getattr(base, name).as_dict()
    assert base.retention["policy"] == R.POLICY_FIXED_TTL
    assert tu.retention["policy"] == R.POLICY_LEASE
    assert tu.retention["evidence"]["ended_share"] == 1.0
    assert tu.retention["block_s"]["lease"] < 0.9 * tu.retention["block_s"]["fixed_ttl"]
    assert tu.mode.value == sc.Mode.BIDIRECTIONAL.value  # this trace's advice (seed 7)
    out = write(tu, tmp_path / "out", model="m")
    router = config_from_dict(yaml.safe_load((out / "router.yaml").read_text()),
                              source="router.yaml")
    assert router.lease_s == tu.retention["lease_s"]
    assert router.lease_renew_every_s == tu.retention["renew_every_s"]
