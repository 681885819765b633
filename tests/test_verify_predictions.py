"""The recommendation's predictions against measured configurations (pure: no engines)."""
from __future__ import annotations

import pytest
from pathlib import Path

from kvtune.local.workload import ConversationPlan, TurnPlan
from kvtune.verify import configs as C
from kvtune.verify import measure, page, results
from kvtune.verify.predictions import check
from kvtune.verify.results import RequestMeasurement
from kvtune.verify.run import assemble


def _rec(mode: str = "push", threshold: int = 200, ttl: float = 4.0, share: float = 0.8) -> dict:
    return {"recommendations": {
        "kv_recompute_threshold": {"value": threshold},
        "decoder_kv_blocks_ttl": {"value": ttl, "evidence": {"captured_share": share}},
        "mode": {"value": mode, "evidence": {"model": "kvtune.sim", "expected_ttft_ms": {
            "pull": {"p50": 100.0, "p99": 200.0}, "push": {"p50": 80.0, "p99": 150.0},
            "bidirectional": {"p50": 90.0, "p99": 180.0}}}}}}


def _plans() -> list[ConversationPlan]:
    # two conversations: 2 turns each; turn 2 adds 20 new tokens to its history
    return [ConversationPlan(cid, 0.0, (), (TurnPlan(1, (7,) * 300, 8, 0.0),
                                            TurnPlan(2, (7,) * 20, 8, 1.0)))
            for cid in ("a", "b")]


def _measured(cfg: C.VerifyConfig, ttft_ms: float, reused: int | None = None,
              offered: int | None = None):
    # turn 2's prompt: 300 + 8 output + 20 new = 328 -> history 308 tokens
    reqs = tuple(RequestMeasurement(cid, turn, 300 if turn == 1 else 328,
                                    ttft_ms + i, 50.0, True,
                                    offered_tokens=None if offered is None or turn == 1
                                    else (offered if cid == "a" else 0))
                 for i, (cid, turn) in enumerate([(c, t) for c in "ab" for t in (1, 2)] * 3))
    return measure.summarize(cfg, reqs, reused_tokens=reused, memory=(), blocks_total=None,
                             wall_s=1.0)


def test_modes_ranking_and_reuse_against_measurements():
    m = [_measured(C.vllm_defaults(), 102.0),
         _measured(C.VerifyConfig("push", "push"), 70.0),
         _measured(C.VerifyConfig("bidi", "bidirectional", 200, 4.0), 130.0, reused=100,
                   offered=308)]
    got = check(_rec(), m, _plans())
    by = {x.mode: x for x in got.modes}
    assert by["pull"].config == "defaults" and by["pull"].held  # +7.5%: within 10%
    assert by["push"].error_share == pytest.approx(by["push"].measured_p50_ms / 80.0 - 1)
    assert by["bidirectional"].held is False  # ~+50%: outside 10%
    assert got.ranked_first == "push" and got.measured_best == "push"
    # every pair told apart by its measured intervals is checked: bidirectional was predicted
    # faster than pull (90 vs 100 ms) and measured slower
    assert set(got.ranked_pairs) == {("push", "pull", True), ("push", "bidirectional", True),
                                     ("pull", "bidirectional", False)}
    assert got.ranking_held is False
    r = got.reuse
    # history 308 tokens in 6 turn-2 requests; the router offered it back for conversation a only
    assert r.reusable_history_tokens == 6 * 308 and r.offered_tokens == 3 * 308
    assert r.measured_share == pytest.approx(0.5) and r.reused_tokens == 100
    assert r.error_points == pytest.approx(-30.0) and r.held is False
    assert any("reuse captured" in line for line in got.lines())


def test_measured_to_the_decodes_first_step_the_answer_hop_comes_off_the_prediction():
    import dataclasses

    rec = _rec()
    rec["recommendations"]["mode"]["evidence"]["sim_inputs"] = [
        {"name": "overheads.hop_ms", "value": 4.0, "source": "measured: router hops"}]
    pull = dataclasses.replace(_measured(C.vllm_defaults(), 110.0),
                               ttft_basis=results.TTFT_BASIS_DECODE)
    push = _measured(C.VerifyConfig("push", "push"), 70.0)  # the router's TTFT: nothing comes off
    by = {x.mode: x for x in check(rec, [pull, push], _plans()).modes}
    assert (by["pull"].predicted_p50_ms, by["pull"].answer_hop_ms) == (96.0, 4.0)
    assert by["pull"].basis == results.TTFT_BASIS_DECODE
    assert by["pull"].error_share == pytest.approx(by["pull"].measured_p50_ms / 96.0 - 1)
    assert (by["push"].predicted_p50_ms, by["push"].answer_hop_ms) == (80.0, 0.0)
    # the analytic model has no such hop
    rec["recommendations"]["mode"]["evidence"]["model"] = "analytic"
    by = {x.mode: x for x in check(rec, [pull, push], _plans()).modes}
    assert by["pull"].predicted_p50_ms == 100.0


def test_bidirectional_at_other_settings_is_not_the_predicted_one():
    m = [_measured(C.VerifyConfig("bidi", "bidirectional", 64, 480.0), 90.0, reused=100)]
    got = check(_rec(), m, _plans())
    bidi = next(x for x in got.modes if x.mode == "bidirectional")
    assert bidi.measured_p50_ms is None and bidi.held is None
    assert got.reuse is None and got.ranking_held is None


def test_ranking_fails_when_another_mode_measures_faster():
    m = [_measured(C.vllm_defaults(), 60.0), _measured(C.VerifyConfig("push", "push"), 70.0)]
    got = check(_rec(), m, _plans())
    assert got.measured_best == "pull" and got.ranking_held is False
    assert got.ranked_pairs == (("pull", "push", False),)


def test_modes_whose_intervals_overlap_are_not_ranked():
    m = [_measured(C.vllm_defaults(), 70.0), _measured(C.VerifyConfig("push", "push"), 71.0)]
    got = check(_rec(), m, _plans())
    assert got.ranked_pairs == () and got.ranking_held is None


def test_no_prediction_no_check():
    assert check({"recommendations": {}}, [], _plans()) is None


def test_per_mode_configs_fill_in_what_is_missing():
    rec = _rec(mode="bidirectional", threshold=300, ttl=5.0)
    have = [C.vllm_defaults(), C.from_recommendation(Path("recommendation.json"), data=rec)]
    extra = C.per_mode(rec, have)
    assert [c.name for c in extra] == ["push"]
    extra = C.per_mode(rec, [C.vllm_defaults()])
    assert [(c.name, c.recompute_threshold_tokens, c.ttl_s) for c in extra] == [
        ("push", None, None), ("bidirectional", 300, 5.0)]


def test_predictions_round_trip_and_show_on_the_page(tmp_path):
    m = [_measured(C.vllm_defaults(), 110.0), _measured(C.VerifyConfig("push", "push"), 70.0)]
    res = assemble(m, target="t", workload="w")
    import dataclasses
    res = dataclasses.replace(res, predictions=check(_rec(), m, _plans()))
    back = results.read(results.write(res, tmp_path / "v.json"))
    assert back.predictions == res.predictions
    html = page.render(back)
    assert 'id="predictions"' in html and 'id="fig-predictions"' in html
