"""Cross-check with the simulator (built in parallel): spans it writes, read back through the loader,
give back the simulator's own cost model."""
from __future__ import annotations

from dataclasses import replace

import pytest

from kvtune.recommend import recommend

sim = pytest.importorskip("kvtune.sim")
presets = pytest.importorskip("kvtune.sim.presets")


@pytest.mark.parametrize("mode", ["pull", "bidirectional"])
def test_recommend_recovers_the_simulators_model(tmp_path, mode):
    from kvtune.traces import load

    cfg = presets.public_h200_qwen3_32b(mode=mode)
    cfg = replace(cfg, workload=replace(cfg.workload, duration_s=120.0,
                                        prompt_tokens=sim.Dist.parse("lognormal:2000,0.6"),
                                        turns=sim.Dist.parse("uniform:1,5")))
    path = tmp_path / "sim.jsonl"
    sim.simulate(cfg).write_spans(path)
    tu = recommend(load(str(path)), n_boot=50, use_simulator=False)

    assert tu.fit is not None
    assert tu.fit.floor_ms == pytest.approx(cfg.transfer.floor_ms, rel=0.02)
    assert tu.fit.floor_ci_ms[0] <= cfg.transfer.floor_ms * 1.001
    assert tu.fit.floor_ci_ms[1] >= cfg.transfer.floor_ms * 0.999
    pc = tu.extra["prefill_cost"]
    assert pc["per_token_ms"] == pytest.approx(cfg.prefill.per_token_ms, rel=0.02)
    assert pc["per_token_prefix_us"] == pytest.approx(cfg.prefill.per_token_prefix_us, rel=0.05)
    assert pc["base_ms"] == pytest.approx(cfg.prefill.base_ms, rel=0.05)
    assert tu.extra["bytes_per_token"] == pytest.approx(cfg.transfer.kv_bytes_per_token, rel=0.005)
    # the threshold is the break-even of exactly these recovered costs
    ev = tu.threshold.evidence
    if ev.break_even_tokens is not None:
        assert ev.pull_ms_at_break_even == pytest.approx(ev.recompute_ms_at_break_even)


def _recommend_on_pull_traffic(tmp_path, duration_s: float, **changes):
    """recommend() on the spans of the public preset in pull mode (``changes``: SimConfig.with_)
    serving 2k-token multi-turn traffic for ``duration_s``."""
    from kvtune.traces import load

    cfg = presets.public_h200_qwen3_32b(mode="pull")
    cfg = cfg.with_(**changes) if changes else cfg
    cfg = replace(cfg, workload=replace(cfg.workload, duration_s=duration_s, qps=1.0,
                                        prompt_tokens=sim.Dist.parse("lognormal:2000,0.6"),
                                        turns=sim.Dist.parse("uniform:1,5")))
    path = tmp_path / "sim.jsonl"
    sim.simulate(cfg).write_spans(path)
    return recommend(load(str(path)), n_boot=20)


def test_mode_evidence_names_every_simulator_input_and_its_source(tmp_path):
    tu = _recommend_on_pull_traffic(tmp_path, 90.0)
    ev = tu.mode.evidence
    assert ev.model == "kvtune.sim"
    by_name = {i.name: i for i in ev.sim_inputs}
    assert by_name["transfer.floor_ms"].source.startswith("measured: floor fit")
    assert by_name["transfer.floor_ms"].value == pytest.approx(tu.fit.floor_ms)
    assert by_name["prefill.per_token_ms"].source == "measured: prefill fit"
    assert by_name["transfer.kv_bytes_per_token"].source.startswith("measured")
    assert by_name["decode.loop_per_descriptor_us"].source == "preset public-h200-qwen3-32b"
    assert by_name["workload.qps"].source.startswith("measured: trace workload")
    if tu.threshold.value != "never":
        assert by_name["reuse.threshold_tokens"].value == tu.threshold.value
        assert by_name["reuse.threshold_tokens"].source.startswith("setting")
    js = tu.as_dict()["mode"]["evidence"]["sim_inputs"]
    assert {"name": "decode.loop_per_descriptor_us", "value": 0.23,
            "source": "preset public-h200-qwen3-32b"} in js
    # both models' winners are named; when they differ a finding says why and the range holds both
    assert ev.analytic_best in ev.allowed and ev.simulated_best == tu.mode.value
    disagree = [f for f in tu.findings if f.code == "mode_models_disagree"]
    if ev.models_agree:
        assert not disagree
    else:
        assert len(disagree) == 1 and set(tu.mode.range) == {ev.simulated_best, ev.analytic_best}
        assert "decode.loop_per_descriptor_us" in disagree[0].message


def test_models_disagree_finding_says_which_preset_values_the_analytic_model_lacks():
    from kvtune.recommend.mode import _disagreement
    from kvtune.sim import SimInput

    f = _disagreement("push", "bidirectional", {"push": (100.0, 1.0), "bidirectional": (110.0, 1.0)},
                      {"push": (90.0, 1.0), "bidirectional": (80.0, 1.0)},
                      (SimInput("decode.loop_per_descriptor_us", 0.23, "preset p"),
                       SimInput("prefill.per_token_ms", 0.02, "measured: prefill fit")))
    assert f.code == "mode_models_disagree" and f.severity == "warning"
    assert "the simulator push" in f.message and "the analytic model bidirectional" in f.message
    assert "decode.loop_per_descriptor_us = 0.23 (preset p)" in f.message
    assert "prefill.per_token_ms" not in f.message
    assert f.evidence["preset_inputs"] == [{"name": "decode.loop_per_descriptor_us", "value": 0.23,
                                            "source": "preset p"}]


def test_the_simulator_predicts_its_own_traced_ttft_without_a_shared_bias(tmp_path):
    # spans of a deployment whose requests pay the path outside the fitted phases (API servers'
    # tokenisation, engine intakes, a handoff growing with the prompt): the recommendation's
    # simulator, calibrated from those spans, must predict the TTFT they measured
    tu = _recommend_on_pull_traffic(
        tmp_path, 300.0, overheads={"hop_ms": 2.0, "router_ms": 1.0, "tokenize_per_kilotoken_ms": 1.5,
                                    "handoff_per_kilotoken_ms": 1.0, "prefill_intake_ms": 6.0,
                                    "decode_intake_ms": 8.0}, transfer={"notify_ms": 1.0})
    ev = tu.mode.evidence
    measured = tu.extra["measured_ttft_ms"]["pull"]["p50_ms"]
    hop = next(i.value for i in ev.sim_inputs if i.name == "overheads.hop_ms")
    predicted = ev.simulated_ttft_ms["pull"].p50 - hop
    assert predicted == pytest.approx(measured, rel=0.05)
    assert ev.sim_scale == pytest.approx(1.0, abs=0.05)
    by_name = {i.name: i for i in ev.sim_inputs if i.mode is None}
    for name, want in (("overheads.prefill_intake_ms", 6.0), ("overheads.decode_intake_ms", 8.0),
                       ("overheads.tokenize_per_kilotoken_ms", 1.5),
                       ("overheads.handoff_per_kilotoken_ms", 1.0)):
        assert by_name[name].value == pytest.approx(want, rel=0.1), name
        assert by_name[name].source.startswith("measured")
