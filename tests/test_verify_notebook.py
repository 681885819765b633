"""The crossover notebook (notebooks/verify_crossover.ipynb) calls the library on a recorded
``kvtune verify --crossover`` result and draws it; its published values are the library's."""
from __future__ import annotations

import json
from pathlib import Path

from kvtune.tune.notebooks import run_notebook
from kvtune.verify import crossover, results

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "verify-local-smoke" / "verify.json"


def test_notebook_draws_the_recorded_sweep_against_a_recommendation(tmp_path):
    tune = tmp_path / "tune"
    (tune / "configs").mkdir(parents=True)
    rec = {"recommendations": {"kv_recompute_threshold": {
        "value": 100, "range": [20, 300], "evidence": {"break_even_tokens": 100.0}}}}
    (tune / "configs" / "recommendation.json").write_text(json.dumps(rec))
    run = run_notebook("verify_crossover", tmp_path / "nb",
                       {"verify_json": str(EXAMPLE), "tune_dir": str(tune)},
                       figures_dir=tmp_path / "figs")
    want = crossover.analyze(results.read(EXAMPLE).crossover.points, rec)
    assert run.values["measured_crossover_tokens"] == want.estimate.tokens
    assert run.values["crossover_inside_recommended_range"] == want.inside_range
    assert run.values["crossover_side"] == want.estimate.side
    assert run.values["crossover_diff_p50_ms"] == list(want.estimate.diff_p50_ms)
    assert (tmp_path / "figs" / "verify--crossover.json").exists()
