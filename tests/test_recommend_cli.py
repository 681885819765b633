"""`kvtune analyze` and `kvtune recommend` through kvtune's CLI, on OTLP-JSON span files."""
from __future__ import annotations

import json
import os

import pytest

from kvtune import spans as sc
from kvtune.cli import main
from kvtune.testing import synthetic as syn
from kvtune.vllm_pd import KV_CONNECTOR

MODULES = (("analyze", "kvtune.analysis.cli"), ("recommend", "kvtune.recommend.cli"))


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    spans = syn.SyntheticCase(workload=syn.SyntheticWorkload(n_conversations=20)).spans(
        mode=sc.Mode.BIDIRECTIONAL, seed=3)
    path = tmp_path_factory.mktemp("trace") / "spans.jsonl"
    syn.write_otlp_json(spans, path)
    return path


def test_analyze_prints_fit_per_fabric(trace, tmp_path, capsys):
    csv = tmp_path / "t.csv"
    rc = main(["analyze", str(trace), "--transfers-csv", str(csv), "--n-boot", "20"], MODULES)
    out = capsys.readouterr().out
    assert rc == 0
    assert "fit [ucx-tcp-loopback READ]: floor" in out and "fit [efa READ]: floor" in out
    assert "prefill (kv.prefill" in out and "workload (kv.request)" in out
    header = csv.read_text().splitlines()[0].split(",")
    from kvtune.analysis import TRANSFER_COLUMNS
    assert header == list(TRANSFER_COLUMNS)


def test_recommend_writes_the_files(trace, tmp_path, capsys):
    out = tmp_path / "cfg"
    rc = main(["recommend", str(trace), "--out", str(out), "--model", "Qwen/Qwen3-32B",
               "--fabric", "efa", "--connector", "vllm", "--decode-url", "http://10.0.0.2:8200"],
              MODULES)
    printed = capsys.readouterr().out
    assert rc == 0
    assert "kv_recompute_threshold" in printed and f"written: {out}" in printed
    rec = json.loads((out / "recommendation.json").read_text())
    assert rec["trace_source"].endswith("spans.jsonl") and rec["span_count"] > 0
    assert rec["fit"]["source"].endswith("spans.jsonl")
    kv = json.loads((out / "decode.kv-transfer-config.json").read_text())
    assert kv[KV_CONNECTOR] in ("NixlConnector", "NixlPushConnector")
    assert "http://10.0.0.2:8200" in (out / "router.yaml").read_text()
    # a second run refuses to overwrite without --force
    rc = main(["recommend", str(trace), "--out", str(out)], MODULES)
    assert rc == 2 and "exists" in capsys.readouterr().err


def test_recommend_on_spans_without_transfers_fails_clearly(tmp_path, capsys):
    frame = syn.spans_frame([{"name": sc.SpanName.REQUEST.value, "host": "router",
                              "start_ns": syn.T0_NS, "end_ns": syn.T0_NS + 10 ** 6,
                              "trace_id": "1" * 32, "span_id": "2" * 16, "attrs": {}}])
    path = tmp_path / "empty.jsonl"
    syn.write_otlp_json(frame, path)
    out = tmp_path / "cfg"
    rc = main(["recommend", str(path), "--out", str(out)], MODULES)
    err = capsys.readouterr().err
    assert rc == 2 and "no KV transfers" in err
    assert not out.exists() and os.listdir(tmp_path) == ["empty.jsonl"]
