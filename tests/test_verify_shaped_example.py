"""The recorded tuning-truth run (``examples/verify-shaped``): `kvtune tune` on the shaped 1 Gbit/s
link, then `kvtune verify --modes --workload tune --crossover` against it (see its README).

The committed evidence must support the committed claims: the recommendation is what kvtune
computes from the committed spans, the prediction check and the crossover are what the recorded
measurements give, and the run measured what the must-show list asks for (40+ requests a
configuration, every mode, a crossover sweep around the recommended threshold)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtune.verify import predictions, results, verdict, workload_file

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verify-shaped"


@pytest.fixture(scope="module")
def recorded() -> results.VerifyResult:
    return results.read(EXAMPLE / "verify" / results.RESULT_FILE)


@pytest.fixture(scope="module")
def rec() -> dict:
    return json.loads((EXAMPLE / "tune" / "configs" / "recommendation.json").read_text())


def test_every_mode_and_the_baseline_were_measured_with_40_plus_requests(recorded):
    modes = {c.config.mode for c in recorded.configs}
    assert modes == {"pull", "push", "bidirectional"}
    names = [c.config.name for c in recorded.configs]
    assert names[:2] == ["defaults", "recommended"]
    for c in recorded.configs:
        assert len(c.requests) >= 40 and c.n_failed == 0, c.config.name
        assert c.ttft_p50 is not None and c.ttft_p50.low_ms <= c.ttft_p50.value_ms
    assert "veth-tbf-1000mbit" in recorded.target


def test_the_prediction_check_is_what_the_recorded_measurements_give(recorded, rec):
    plans = workload_file.load(EXAMPLE / "verify-workload.json")
    again = predictions.check(rec, recorded.configs, plans)
    assert again == recorded.predictions
    assert {m.mode for m in again.modes if m.measured_p50_ms is not None} == {
        "pull", "push", "bidirectional"}
    assert again.ranked_first == rec["recommendations"]["mode"]["value"]


def test_the_verdict_is_what_the_recorded_requests_give(recorded):
    again = verdict.comparisons(recorded.configs, "defaults")
    assert [(c.candidate, c.verdict) for c in again] == [
        (c.candidate, c.verdict) for c in recorded.comparisons]


def test_the_crossover_is_what_the_recorded_points_give(recorded, rec):
    from kvtune.verify import crossover as X

    cx = recorded.crossover
    assert cx is not None and len(cx.estimate.lengths_tokens) >= 4
    assert X.analyze(cx.points, rec) == cx
    lo, hi = rec["recommendations"]["kv_recompute_threshold"]["range"]
    assert list(cx.recommended_range_tokens) == [lo, hi]


def test_the_recommendation_is_what_kvtune_computes_from_the_committed_spans(rec):
    from kvtune.recommend import recommend
    from kvtune.traces import load

    tu = recommend(load(str(EXAMPLE / "tune" / "spans"), progress=False))
    got = {k: v["value"] for k, v in tu.as_dict().items() if isinstance(v, dict) and "value" in v}
    want = {k: v["value"] for k, v in rec.items() if isinstance(v, dict) and "value" in v
            and k in got}
    assert got == want
