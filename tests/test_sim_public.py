"""The public preset reproduces the published results, and the mode comparison flips where it
should. Deterministic seeds; each simulation takes well under a second."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtune.sim import presets as P
from kvtune.sim import simulate
from kvtune.spans import Mode
from kvtune.sim.estimate import best_mode, expected_ttft

TOLERANCE = 0.15  # the bar: each published TTFT within 15%
BENEFIT_TOLERANCE = 0.10  # and the reuse benefit (no-reuse over reuse TTFT) within 10%


@pytest.mark.parametrize("context", sorted(P.PUBLIC_REUSE_TTFT_MS))
@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no_reuse"])
def test_public_preset_reproduces_bidirectional_ttft(context, reuse):
    published = (P.PUBLIC_REUSE_TTFT_MS if reuse else P.PUBLIC_NO_REUSE_TTFT_MS)[context]
    res = simulate(P.reuse_scenario(context, reuse=reuse))
    later = res.requests[res.requests["turn"] >= 2]
    assert len(later) >= 40 and set(res.requests["turn"]) == set(range(1, P.REUSE_TURNS + 1))
    if reuse:  # the later turns really pulled their history back
        assert (later["reuse_outcome"] == "pull").mean() > 0.9
    else:
        assert (res.requests["computed_tokens"] == res.requests["prompt_tokens"]).all()
    # the decode's own prefix cache holds the last turn: the forward READ moves the new tokens
    assert (later["forward_tokens"] < 2 * P.REUSE_NEW_TOKENS).all()
    got = res.ttft().mean_ms  # the blog averages each prompt length's requests
    assert got == pytest.approx(published, rel=TOLERANCE), (context, reuse, got, published)


@pytest.mark.parametrize("context", sorted(P.PUBLIC_REUSE_TTFT_MS))
def test_public_preset_reproduces_the_reuse_benefit(context):
    # the quantity the bidirectional advice rests on: no-reuse TTFT over reuse TTFT
    on = simulate(P.reuse_scenario(context, reuse=True)).ttft().mean_ms
    off = simulate(P.reuse_scenario(context, reuse=False)).ttft().mean_ms
    published = P.PUBLIC_NO_REUSE_TTFT_MS[context] / P.PUBLIC_REUSE_TTFT_MS[context]
    assert off / on == pytest.approx(published, rel=BENEFIT_TOLERANCE), (context, off / on, published)


def test_reverse_transfer_pays_the_prefill_engine_loop_per_descriptor():
    base = P.public_h200_qwen3_32b()
    res = simulate(P.reuse_scenario(24000, reuse=True))
    pulled = res.requests[res.requests["reuse_outcome"] == "pull"]
    r = next(t for t in res.timeline.requests if t.outcome == "pull")
    desc = base.transfer.descriptors(r.rev_tokens)
    want = desc * (base.transfer.per_descriptor_us + base.prefill.loop_per_descriptor_us) / 1e3
    assert r.rev_setup_end - r.rev_setup_start == pytest.approx(want)
    # the whole reverse READ at ~25k tokens: the published "about 130 ms" order, far above the floor
    assert 100 < pulled["reverse_ms"].median() < 300


def test_reuse_gain_grows_with_context():
    gain = {}
    for ctx in P.PUBLIC_REUSE_TTFT_MS:
        with_reuse = simulate(P.reuse_scenario(ctx, reuse=True)).ttft().mean_ms
        without = simulate(P.reuse_scenario(ctx, reuse=False)).ttft().mean_ms
        gain[ctx] = without - with_reuse
    assert gain[24000] > 5 * max(gain[2000], 1.0)


def _pull_over_push(tokens: int, qps: float, seed: int = 0,
                    duration_s: float = P.PUSH_PULL_DURATION_S) -> float:
    """Steady-state pull/push p50 TTFT ratio (the warm-up left out)."""
    p50 = {m: simulate(P.push_pull_scenario(m, tokens, qps, seed=seed, duration_s=duration_s))
           .ttft(warmup_s=P.PUSH_PULL_WARMUP_S).p50_ms for m in ("push", "pull")}
    return p50["pull"] / p50["push"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_push_beats_pull_about_threefold_on_long_prompts_at_high_load(seed):
    tokens, qps, published = P.PUBLIC_PUSH_PULL["long"]
    assert 0.8 * published <= _pull_over_push(tokens, qps, seed) <= 1.2 * published


def test_pull_over_push_is_steady_not_growing_with_run_length():
    # a queue near but below saturation: a run twice as long measures the same ratio
    tokens, qps, _ = P.PUBLIC_PUSH_PULL["long"]
    short = _pull_over_push(tokens, qps, duration_s=P.PUSH_PULL_DURATION_S)
    long = _pull_over_push(tokens, qps, duration_s=2 * P.PUSH_PULL_DURATION_S)
    assert long == pytest.approx(short, rel=0.1)


def test_pull_penalty_grows_with_load_and_passes_threefold_at_saturation():
    tokens, _, published = P.PUBLIC_PUSH_PULL["long"]
    ratios = [_pull_over_push(tokens, q, duration_s=900.0) for q in (2.0, 8.0, 10.0)]
    assert ratios[0] < ratios[1] < ratios[2]
    assert ratios[0] < 1.5  # light load: only the inline setup itself, no queue
    assert ratios[2] > published


def test_pull_decode_loop_is_the_bottleneck_at_high_load():
    tokens, qps, _ = P.PUBLIC_PUSH_PULL["long"]
    push = simulate(P.push_pull_scenario("push", tokens, qps))
    pull = simulate(P.push_pull_scenario("pull", tokens, qps))
    horizon_ms = P.PUSH_PULL_DURATION_S * 1e3
    assert push.decode_stall_ms == 0.0
    assert pull.decode_stall_ms / horizon_ms > 0.75  # most of the decode loop builds descriptors
    assert pull.decode_stall_ms / horizon_ms < 1.0   # ... but it keeps up (below saturation)
    assert pull.requests["tpot_ms"].median() > 3 * push.requests["tpot_ms"].median()
    # the prefill side is the same in both modes
    assert pull.requests["queue_ms"].median() == pytest.approx(push.requests["queue_ms"].median(), abs=1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_push_and_pull_nearly_equal_on_short_prompts_at_low_load(seed):
    tokens, qps, _ = P.PUBLIC_PUSH_PULL["short"]
    assert 1.0 <= _pull_over_push(tokens, qps, seed) < 1.2


def _workload(**fields) -> object:
    """A ``kvtune.analysis.Workload`` when that class exists, else an object with its fields."""
    base = dict(n_requests=1000, qps=1.0, prompt_tokens_p50=1000.0, prompt_tokens_p90=1000.0,
                prompt_tokens_p99=1000.0, output_tokens_p50=256.0, multi_turn_share=0.0,
                turns_per_conversation_mean=1.0, gaps_s=(), reuse_outcomes={}, duration_s=300.0)
    base.update(fields)
    try:
        from kvtune.analysis import Workload
    except ImportError:
        return SimpleNamespace(**base)
    return Workload(**base)


def _fits():
    preset = P.public_h200_qwen3_32b()
    t, pre = preset.transfer, preset.prefill
    fit = SimpleNamespace(floor_ms=t.floor_ms, bandwidth_gbps=t.bandwidth_gbps,
                          per_descriptor_us=t.per_descriptor_us)
    cost = SimpleNamespace(per_token_ms=pre.per_token_ms, per_token_prefix_us=pre.per_token_prefix_us,
                           base_ms=pre.base_ms)
    return fit, cost


def test_recommendation_picks_push_for_long_single_shot_prompts_at_high_qps():
    w = _workload(qps=8.0, prompt_tokens_p50=16000.0, prompt_tokens_p90=17000.0,
                  prompt_tokens_p99=18000.0, output_tokens_p50=256.0)
    est = expected_ttft(w, *_fits())
    assert set(est) == {Mode.PUSH, Mode.PULL, Mode.BIDIRECTIONAL}
    assert best_mode(est) == "push"
    assert est[Mode.PULL].p50_ms > 1.3 * est[Mode.PUSH].p50_ms


def test_recommendation_picks_bidirectional_for_long_agent_sessions():
    w = _workload(qps=2.0, prompt_tokens_p50=8000.0, prompt_tokens_p90=10000.0,
                  prompt_tokens_p99=12000.0, output_tokens_p50=300.0, multi_turn_share=0.9,
                  turns_per_conversation_mean=10.0, gaps_s=(2.0, 4.0, 6.0, 10.0, 15.0))
    est = expected_ttft(w, *_fits())
    assert best_mode(est) == "bidirectional"
    assert est[Mode.BIDIRECTIONAL].reuse_share > 0.5


def test_expected_ttft_accepts_a_config_and_a_replay_frame():
    import pandas as pd
    cfg = P.push_pull_scenario("push", 2000, 2.0, duration_s=20.0)
    est = expected_ttft(cfg, modes=("push", "pull"))
    assert set(est) == {Mode.PUSH, Mode.PULL} and est[Mode.PUSH].n_requests > 10
    frame = pd.DataFrame({"arrival_s": [0.0, 0.5, 1.0], "prompt_tokens": [1000, 2000, 3000],
                          "output_tokens": [10, 10, 10]})
    est = expected_ttft(frame, modes=("pull",))
    assert est[Mode.PULL].n_requests == 3
