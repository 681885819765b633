"""The recorded lab runs (``examples/fleet``, ``examples/warm``): ``make tune`` (``kvtune tune
--fabric auto --verify``) in each lab regime, its spans, recommendation, verification and figures
committed (see each README).

The committed evidence must support the committed claims: the recommendation is what kvtune
computes from the committed spans, and the verdict, the prediction check and the crossover are
what the recorded measurements give, recomputed here from the committed files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtune.verify import crossover as X
from kvtune.verify import predictions, results, verdict, workload_file
from kvtune.verify.tune_link import TUNE_VERIFY_SEED, TUNE_VERIFY_STARTS

ROOT = Path(__file__).resolve().parents[1] / "examples"
REGIMES = ("fleet", "warm")


def _example(name: str) -> Path:
    path = ROOT / name
    if not (path / "verify" / results.RESULT_FILE).is_file():
        pytest.fail(f"{path}: the recorded {name} run is missing")
    return path


@pytest.fixture(scope="module", params=REGIMES)
def example(request) -> tuple[str, Path, results.VerifyResult, dict]:
    path = _example(request.param)
    recorded = results.read(path / "verify" / results.RESULT_FILE)
    rec = json.loads((path / "tune" / "configs" / "recommendation.json").read_text())
    return request.param, path, recorded, rec


def test_the_run_is_the_regime_it_says_with_every_start(example):
    name, _, recorded, rec = example
    assert rec["lab"]["regime"] == name
    assert f"lab regime {name}" in recorded.target and "veth-tbf-1000mbit" in recorded.target
    for c in recorded.configs:
        assert c.starts == TUNE_VERIFY_STARTS and c.n_failed == 0, c.config.name
        assert sorted({r.start for r in c.requests}) == list(range(TUNE_VERIFY_STARTS))


def test_the_verdict_is_what_the_recorded_requests_give(example):
    _, _, recorded, _ = example
    baseline = recorded.comparisons[0].baseline
    again = verdict.comparisons(recorded.configs, baseline, seed=TUNE_VERIFY_SEED)
    assert [(c.candidate, c.verdict) for c in again] == [
        (c.candidate, c.verdict) for c in recorded.comparisons]


def test_the_prediction_check_is_what_the_recorded_measurements_give(example):
    _, path, recorded, rec = example
    plans = workload_file.load(path / "verify-workload.json")
    assert predictions.check(rec, recorded.configs, plans) == recorded.predictions


def test_the_crossover_is_what_the_recorded_points_give(example):
    _, _, recorded, rec = example
    cx = recorded.crossover
    assert cx is not None
    again = X.analyze(cx.points, rec, seed=TUNE_VERIFY_SEED, deployment=cx.deployment)
    assert again == cx
    # swept from one block to the workload's longest history, not around the prediction
    assert cx.estimate.lengths_tokens[0] == X.MIN_HISTORY_TOKENS


def test_the_recommendation_is_what_kvtune_computes_from_the_committed_spans(example):
    from kvtune.recommend import recommend
    from kvtune.traces import load

    _, path, _, rec = example
    tu = recommend(load(str(path / "tune" / "spans"), progress=False))
    got = {k: v["value"] for k, v in tu.as_dict().items() if isinstance(v, dict) and "value" in v}
    want = {k: v["value"] for k, v in rec.items() if isinstance(v, dict) and "value" in v
            and k in got}
    assert got == want


def test_fleet_advice_leaves_the_defaults_and_beats_them():
    path = _example("fleet")
    recorded = results.read(path / "verify" / results.RESULT_FILE)
    rec = json.loads((path / "tune" / "configs" / "recommendation.json").read_text())
    assert rec["recommendations"]["mode"]["value"] == "bidirectional"
    comp = verdict.headline_comparison(recorded)
    assert (comp.baseline, comp.candidate) == ("defaults", "recommended")
    ch = comp.p50
    assert ch.low_pct > 0 and ch.detectable_pct <= 10.0  # the whole interval on the faster side
    assert rec["verification"]["status"] == verdict.STATUS_BETTER
    assert recorded.predictions.ranking_held is True


def test_warm_advice_is_the_defaults_and_never_verified_against_themselves():
    path = _example("warm")
    recorded = results.read(path / "verify" / results.RESULT_FILE)
    rec = json.loads((path / "tune" / "configs" / "recommendation.json").read_text())
    comp = verdict.headline_comparison(recorded)
    assert comp.baseline == "recommended" and comp.candidate == "runner-up"
    assert rec["verification"]["status"].startswith(verdict.STATUS_DEFAULTS)
    assert "verified: faster" not in rec["verification"]["status"]
    # the decision's status names the runner-up's mode, recomputed from the recorded result
    runner = next(c.config.mode for c in recorded.configs if c.config.name == comp.candidate)
    assert runner == "bidirectional"
    assert f"the runner-up {runner} measured" in verdict.verification_entry(recorded)["status"]
