"""When serving transfers cannot support a floor fit, the probe's transfers stand in, said so."""
from __future__ import annotations

import pytest

from kvtune import spans as S
from kvtune.errors import AnalysisError
from kvtune.recommend import recommend
from kvtune.testing import synthetic


def _one_size_serving(df):
    df = df.copy()
    serving = (df["kv.mode"].astype("object") != S.Mode.PROBE.value).to_numpy(dtype=bool)
    df.loc[serving & df["kv.bytes"].notna().to_numpy(dtype=bool), "kv.bytes"] = 131072
    return df


def test_serving_fit_impossible_falls_back_to_probe_with_a_finding():
    spans = _one_size_serving(synthetic.SyntheticCase().spans(mode="bidirectional"))
    tuning = recommend(spans, n_boot=50)
    assert tuning.extra["fit_source"] == "probe transfers (fallback)"
    finding = next(f for f in tuning.findings if f.code == "fit_from_probe")
    assert finding.severity == "warning" and "serving transfers" in finding.message
    truth = synthetic.FabricTruth()
    assert tuning.fit.floor_ms == pytest.approx(truth.floor_ms, rel=0.2)


def test_serving_fit_used_when_possible():
    tuning = recommend(synthetic.SyntheticCase().spans(mode="bidirectional"), n_boot=50)
    assert tuning.extra["fit_source"] == "serving transfers"
    assert not [f for f in tuning.findings if f.code == "fit_from_probe"]


def test_no_probe_to_fall_back_on_keeps_the_serving_error():
    spans = _one_size_serving(synthetic.serving_spans(mode="bidirectional"))
    with pytest.raises(AnalysisError, match="cannot fit floor and bandwidth"):
        recommend(spans, n_boot=50)


def test_probe_splits_the_serving_slope_for_the_simulator():
    """Serving descriptors grow with bytes, so the serving fit folds per-descriptor work into its
    bandwidth; the probe (two layouts) separates them and the simulator gets the link's bandwidth."""
    truth = synthetic.FabricTruth()
    tuning = recommend(synthetic.SyntheticCase().spans(mode="bidirectional"), n_boot=50)
    assert tuning.fit.per_descriptor_us is None  # the serving fit cannot tell them apart
    assert tuning.fit.bandwidth_gbps < truth.bandwidth_gbps
    assert any(f.code == "slope_split_by_probe" for f in tuning.findings)
    played = {i.name: i for i in tuning.mode.evidence.sim_inputs}
    assert played["transfer.bandwidth_gbps"].value == pytest.approx(truth.bandwidth_gbps, rel=0.1)
    assert played["transfer.per_descriptor_us"].value > 0
    assert "fabric probe" in played["transfer.bandwidth_gbps"].source


def test_no_probe_no_split():
    tuning = recommend(synthetic.serving_spans(mode="bidirectional"), n_boot=50)
    assert not any(f.code == "slope_split_by_probe" for f in tuning.findings)
    played = {i.name: i for i in tuning.mode.evidence.sim_inputs}
    assert played["transfer.bandwidth_gbps"].value == pytest.approx(tuning.fit.bandwidth_gbps)
