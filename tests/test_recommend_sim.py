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
    if ev["break_even_tokens"] is not None:
        assert ev["pull_ms_at_break_even"] == pytest.approx(ev["recompute_ms_at_break_even"])
