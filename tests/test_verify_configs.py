"""kvtune.verify.configs and workload_file: every accepted form, and clear errors for bad input."""
from __future__ import annotations

import json

import pytest

from kvtune.errors import ConfigError
from kvtune.export.files import NEVER_THRESHOLD_TOKENS
from kvtune.local.workload import WorkloadConfig, generate
from kvtune.verify import configs as C
from kvtune.verify import workload_file as W
from kvtune.vllm_pd import (BIDIRECTIONAL_KV_XFER, KV_CONNECTOR, KV_CONNECTOR_EXTRA_CONFIG,
                            KV_PRODUCER, KV_ROLE)


def _rec(mode="bidirectional", threshold=55, ttl=22):
    return {"recommendations": {
        "mode": {"value": mode, "range": [mode, "pull"]},
        "kv_recompute_threshold": {"value": threshold, "range": [17, 74],
                                   "evidence": {"break_even_tokens": 54.9}},
        "decoder_kv_blocks_ttl": {"value": ttl, "range": [4, 22]}}}


def test_builtin_defaults():
    d = C.load_config("defaults")
    assert (d.name, d.mode, d.recompute_threshold_tokens, d.ttl_s) == (
        "defaults", "pull", None, None)
    b = C.load_config("base=defaults:bidirectional")
    assert (b.name, b.mode) == ("base", "bidirectional")
    assert b.kv_extra_config() == {BIDIRECTIONAL_KV_XFER: True}


def test_tune_dir_recommendation_json_and_never(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "recommendation.json").write_text(json.dumps(_rec()))
    r = C.load_config(str(tmp_path))
    assert (r.name, r.mode, r.recompute_threshold_tokens, r.ttl_s) == (
        "recommended", "bidirectional", 55, 22.0)
    assert r.pair_kwargs() == {"mode": "bidirectional", "recompute_threshold": 55, "ttl_s": 22.0}
    assert C.load_config(f"mine={tmp_path / 'configs'}").name == "mine"
    p = tmp_path / "never.json"
    p.write_text(json.dumps(_rec(threshold="never")))
    assert C.load_config(str(p)).recompute_threshold_tokens == NEVER_THRESHOLD_TOKENS


def test_pull_recommendation_drops_threshold_and_ttl(tmp_path):
    p = tmp_path / "recommendation.json"
    p.write_text(json.dumps(_rec(mode="pull")))
    r = C.load_config(str(p))
    assert (r.mode, r.recompute_threshold_tokens, r.ttl_s) == ("pull", None, None)


def test_kv_transfer_config_file(tmp_path):
    p = tmp_path / "prefill.kv-transfer-config.json"
    p.write_text(json.dumps({KV_CONNECTOR: "KvtuneNixlPullConnector", KV_ROLE: KV_PRODUCER,
                             KV_CONNECTOR_EXTRA_CONFIG: {"kv_recompute_threshold": 300,
                                                         BIDIRECTIONAL_KV_XFER: True,
                                                         "decoder_kv_blocks_ttl": 60}}))
    r = C.load_config(str(p))
    assert (r.name, r.mode, r.recompute_threshold_tokens, r.ttl_s) == ("prefill", "bidirectional",
                                                                        300, 60.0)
    p.write_text(json.dumps({KV_CONNECTOR: "NixlPushConnector"}))
    assert C.load_config(str(p)).mode == "push"


def test_yaml_config_file(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("mode: bidirectional\nkv_recompute_threshold: 128\ndecoder_kv_blocks_ttl: 30\n")
    r = C.load_config(str(p))
    assert (r.name, r.recompute_threshold_tokens, r.ttl_s) == ("mine", 128, 30.0)


@pytest.mark.parametrize("text,match", [
    ("mode: bidirectional\nthreshold: 3\n", "unknown keys \\['threshold'\\]"),
    ("kv_recompute_threshold: 3\n", "field 'mode'"),
    ("mode: sideways\n", "field 'mode': expected one of"),
    ("mode: bidirectional\nkv_recompute_threshold: -1\n", "kv_recompute_threshold"),
    ("mode: bidirectional\ndecoder_kv_blocks_ttl: abc\n", "decoder_kv_blocks_ttl"),
    ("- a\n- b\n", "expected a mapping"),
    ("mode: [unclosed\n", "expected JSON or YAML"),
])
def test_bad_config_files_name_file_and_field(tmp_path, text, match):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        C.load_config(str(p))
    assert "bad.yaml" in str(err.value)


def test_missing_spec_and_bad_names(tmp_path):
    with pytest.raises(ConfigError, match="no such file or directory"):
        C.load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="without recommendation.json"):
        C.load_config(str(tmp_path))
    with pytest.raises(ConfigError, match="field 'name'"):
        C.VerifyConfig("has space", "pull")


def test_workload_file_round_trip(tmp_path):
    import dataclasses

    plans = generate(WorkloadConfig(n_conversations=3, seed=4))
    plans[1] = dataclasses.replace(plans[1], link_turns=False)
    path = W.save(plans, tmp_path / "w.json")
    assert W.load(path) == plans
    assert [p.link_turns for p in W.load(path)] == [True, False, True]


def _doc(**conv):
    c = {"conversation_id": "c0", "start_s": 0.0, "system_tokens": [5],
         "turns": [{"user_tokens": [7, 8], "max_tokens": 4, "think_time_s": 0.0},
                   {"user_tokens": [9], "max_tokens": 2, "think_time_s": 1.5}]}
    c.update(conv)
    return {"format": W.FORMAT, "conversations": [c]}


def test_workload_from_json_accepts_the_documented_example():
    (plan,) = W.from_json(_doc())
    assert plan.system_tokens == (5,) and [t.turn for t in plan.turns] == [1, 2]
    assert plan.turns[1].think_time_s == 1.5


@pytest.mark.parametrize("data,match", [
    ({"format": "other"}, "field 'format'"),
    ({"format": W.FORMAT, "conversations": []}, "non-empty list"),
    (_doc(conversation_id=""), "conversation_id"),
    (_doc(start_s=-1), "start_s"),
    (_doc(turns=[]), "turns"),
    (_doc(turns=[{"user_tokens": [1], "max_tokens": 0}]), "max_tokens"),
    (_doc(turns=[{"user_tokens": [1], "max_tokens": 2, "think_time_s": 3}]), "first turn"),
    (_doc(turns=[{"user_tokens": [-1], "max_tokens": 2}]), "non-negative integer token ids"),
    (_doc(turns=[{"user_tokens": [], "max_tokens": 2}]), "non-empty list of token ids"),
    (_doc(system_tokens="abc"), "system_tokens"),
    (_doc(link_turns="no"), "link_turns"),
])
def test_bad_workloads_name_the_field(data, match):
    with pytest.raises(ConfigError, match=match):
        W.from_json(data, source="w.json")


def test_duplicate_conversation_ids_and_unreadable_files(tmp_path):
    d = _doc()
    d["conversations"].append(dict(d["conversations"][0]))
    with pytest.raises(ConfigError, match="appears twice"):
        W.from_json(d)
    p = tmp_path / "w.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="w.json: expected JSON"):
        W.load(p)
    with pytest.raises(ConfigError, match="no such file"):
        W.load(tmp_path / "none.json")
