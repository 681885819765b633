"""The tuning computed once and handed to the notebooks: the saved form loses nothing the drawings
and the export use, a file of other inputs is refused, and the notebooks draw the file they get."""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from kvtune import analysis, nb, plots
from kvtune.errors import ConfigError
from kvtune.export import write as export_write
from kvtune.recommend import recommend
from kvtune.recommend import saved
from kvtune.recommend.saved import read_tuning, tuning_inputs, write_tuning
from kvtune.testing import synthetic
from kvtune.tune import figures
from kvtune.tune.findings import FindingsView
from kvtune.tune.run import TUNING_FILE, run_tune

INPUTS = dict(model="", tp_size=1, hbm_budget_gb=2.0, early_decode_ok=True, seed=0)


@pytest.fixture(scope="module")
def spans_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spans") / "spans.jsonl"
    synthetic.write_otlp_json(synthetic.SyntheticCase().spans(mode="bidirectional"), path)
    return path


@pytest.fixture(scope="module")
def spans(spans_file):
    return nb.load_spans(str(spans_file))


@pytest.fixture(scope="module")
def computed(spans):
    return recommend(spans, hbm_budget_gb=INPUTS["hbm_budget_gb"], seed=INPUTS["seed"])


def _drawings(tuning, spans, out: Path) -> dict[str, str]:
    """Everything the notebooks and the export make from a tuning, as text."""
    prefill, wl = analysis.prefill_cost(spans), analysis.workload(spans)
    curve = figures.ttl_curve(tuning, wl)
    configs = export_write(tuning, out, model="m")
    got = {
        "threshold": plots.threshold_curve(tuning, prefill).to_json(),
        "ttl": json.dumps(curve, sort_keys=True, default=str),
        "mode": plots.mode_ttft(tuning.mode.as_dict()["evidence"]["expected_ttft_ms"],
                                chosen=tuning.mode.value,
                                excluded=tuning.mode.as_dict()["evidence"].get("excluded")).to_json(),
        "findings": FindingsView.of(tuning)._repr_html_(),
    }
    for f in sorted(configs.iterdir()):
        got[f.name] = f.read_text()
    rec = json.loads(got["recommendation.json"])
    rec.pop("generated_at")  # the clock, not the tuning (two drawings may straddle a second)
    got["recommendation.json"] = json.dumps(rec, sort_keys=True)
    return got


def test_saved_tuning_reads_back_equal_and_draws_the_same(computed, spans, spans_file, tmp_path):
    path = write_tuning(computed, tmp_path / "tuning.json",
                        tuning_inputs(traces=str(spans_file), **INPUTS))
    loaded = read_tuning(path, expect=tuning_inputs(traces=str(spans_file), **INPUTS))
    assert loaded.as_dict() == computed.as_dict()
    assert loaded.fit == computed.fit  # FloorFit with its tuples, not lists
    assert _drawings(loaded, spans, tmp_path / "a") == _drawings(computed, spans, tmp_path / "b")


def test_notebook_helper_computes_when_no_file_is_given(computed, spans, spans_file):
    got = nb.tuning(spans, "", traces=str(spans_file), **INPUTS)
    assert got.as_dict() == computed.as_dict()


@pytest.mark.parametrize("field, value", [("seed", 1), ("hbm_budget_gb", 3.0), ("model", "qwen3-8b"),
                                          ("traces", "/elsewhere/spans.jsonl")])
def test_a_tuning_of_other_inputs_is_refused_naming_the_input(computed, spans_file, tmp_path,
                                                              field, value):
    path = write_tuning(computed, tmp_path / "tuning.json",
                        tuning_inputs(traces=str(spans_file), **INPUTS))
    other = {"traces": str(spans_file), **INPUTS, field: value}
    with pytest.raises(ConfigError, match=rf"{path}.* computed with {field}="):
        nb.tuning(None, str(path), **other)


def test_bad_tuning_files_are_refused_naming_the_file(computed, tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=rf"{bad}: not JSON"):
        read_tuning(bad)
    bad.write_text(json.dumps({"tuning": {}}))
    with pytest.raises(ConfigError, match=r"expected an object with \"kvtune_tuning\": 1"):
        read_tuning(bad)
    good = write_tuning(computed, tmp_path / "good.json",
                        tuning_inputs(traces="x", **INPUTS))
    doc = json.loads(good.read_text())
    del doc["tuning"]["mode"]
    bad.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"tuning\.mode missing"):
        read_tuning(bad)
    monkeypatch.setattr(saved, "MAX_FILE_BYTES", 100)
    with pytest.raises(ConfigError, match="over the 100-byte limit"):
        read_tuning(good)
    with pytest.raises(ConfigError, match="cannot read it"):
        read_tuning(tmp_path / "missing.json")


def _published(path: Path) -> dict:
    return nbformat.read(str(path), as_version=4).metadata["kvtune"]


def test_tune_computes_once_and_the_notebooks_draw_the_file_they_are_given(spans_file, tmp_path):
    """`kvtune tune` writes tuning.json and passes it; a notebook handed a file draws that file
    (a tampered threshold shows up) instead of computing; without one it computes the same."""
    shared = run_tune(str(spans_file), tmp_path / "shared", notebooks=["recompute_threshold"],
                      parameters={"hbm_budget_gb": 2.0}, progress=False)
    tuning_file = shared.out_dir / TUNING_FILE
    assert tuning_file.exists()
    src = [c.source for c in nbformat.read(str(shared.notebooks["recompute_threshold"]),
                                           as_version=4).cells
           if "injected-parameters" in c.metadata.get("tags", [])][0]
    assert f'tuning_json = "{tuning_file}"' in src
    computed_value = _published(shared.notebooks["recompute_threshold"])["kv_recompute_threshold"]

    alone = run_tune(str(spans_file), tmp_path / "alone", notebooks=["recompute_threshold"],
                     parameters={"hbm_budget_gb": 2.0}, progress=False, share_tuning=False)
    assert not (alone.out_dir / TUNING_FILE).exists()
    assert _published(alone.notebooks["recompute_threshold"])["kv_recompute_threshold"] \
        == computed_value

    doc = json.loads(tuning_file.read_text())
    doc["tuning"]["threshold"]["value"] = 4321
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(doc))
    drawn = run_tune(str(spans_file), tmp_path / "drawn", notebooks=["recompute_threshold"],
                     parameters={"hbm_budget_gb": 2.0, "tuning_json": str(tampered)},
                     progress=False)
    assert _published(drawn.notebooks["recompute_threshold"])["kv_recompute_threshold"] == 4321


def test_tune_with_only_notebooks_that_draw_no_tuning_computes_none(spans_file, tmp_path):
    result = run_tune(str(spans_file), tmp_path / "out", notebooks=["stalls"], progress=False)
    assert not (result.out_dir / TUNING_FILE).exists()


def test_an_unbounded_bandwidth_survives_the_saved_file_and_the_export(computed, spans_file,
                                                                          tmp_path):
    # A fit whose slope interval reaches 0 cannot bound the bandwidth above: math.inf, which
    # strict JSON writes as null. Reading it back must give inf again, and the export's report
    # must still be written (a warm lab run once failed here with a TypeError).
    import dataclasses
    import math
    lo = computed.fit.bandwidth_ci_gbps[0]
    unbounded = dataclasses.replace(computed, fit=dataclasses.replace(
        computed.fit, bandwidth_ci_gbps=(lo, math.inf)))
    path = write_tuning(unbounded, tmp_path / "tuning.json",
                        tuning_inputs(traces=str(spans_file), **INPUTS))
    assert json.loads(path.read_text())["tuning"]["fit"]["bandwidth_ci_gbps"][1] is None
    loaded = read_tuning(path)
    assert loaded.fit.bandwidth_ci_gbps == (lo, math.inf)
    export_write(loaded, tmp_path / "configs", overwrite=True)
    report = (tmp_path / "configs" / "REPORT.md").read_text()
    assert "Gbit/s [" in report and "inf]" in report
