"""``kvtune verify``'s CLI: it parses and coerces, then calls run_verify (patched here); bad input
exits 2 with the field named."""
from __future__ import annotations

import json

import pytest

from kvtune import cli
from kvtune.local.regime import FLEET, WARM
from kvtune.verify import crossover as X
from kvtune.verify.backends import ClusterBackend, LocalPairBackend
from kvtune.verify.run import MoreStarts, assemble
from kvtune.verify.tune_link import TUNE_VERIFY_AIM_PCT, TUNE_VERIFY_MAX_STARTS, TUNE_VERIFY_STARTS


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def fake(configs, backend, plans, out, **kw):
        seen.append((configs, backend, plans, out, kw))
        return assemble([], target=backend.description, workload=kw["workload"])
    monkeypatch.setattr("kvtune.verify.run.run_verify", fake)
    return seen


def test_two_configs_on_the_local_pair(calls, tmp_path, capsys):
    rc = cli.main(["verify", "--config", "defaults", "--config", "b=defaults:bidirectional",
                   "--conversations", "3", "--turns", "2", "2", "--out", str(tmp_path / "o"),
                   "--save-workload", str(tmp_path / "w.json"), "--connector", "vllm",
                   "--layout", "quiet", "--no-progress"])
    assert rc == 0
    ((configs, backend, plans, out, kw),) = calls
    assert [c.name for c in configs] == ["defaults", "b"]
    assert isinstance(backend, LocalPairBackend)
    assert backend.pair_kwargs == {"connector": "vllm", "layout": "quiet", "regime": WARM}
    assert "lab regime warm" in backend.description
    assert kw["starts"] == TUNE_VERIFY_STARTS and kw["turn_major"] is False  # A B A B A B
    # rounds are added while the run could not detect a 10% effect, up to 5 starts
    assert kw["more_starts"] == MoreStarts(TUNE_VERIFY_AIM_PCT, TUNE_VERIFY_MAX_STARTS)
    assert len(plans) == 3 and out == tmp_path / "o" and kw["crossover"] is None
    assert json.loads((tmp_path / "w.json").read_text())["format"] == "kvtune.workload/1"
    assert "3 conversations, 6 requests" in kw["workload"]


def test_tune_dir_defaults_and_crossover_grid(calls, tmp_path):
    (tmp_path / "t" / "configs").mkdir(parents=True)
    (tmp_path / "t" / "configs" / "recommendation.json").write_text(json.dumps({
        "recommendations": {
            "mode": {"value": "bidirectional"},
            "kv_recompute_threshold": {"value": 55, "range": [17, 74],
                                       "evidence": {"break_even_tokens": 54.9}},
            "decoder_kv_blocks_ttl": {"value": 22}}}))
    assert cli.main(["verify", "--tune-dir", str(tmp_path / "t"), "--crossover",
                     "--workload", "tune", "--no-progress"]) == 0
    ((configs, backend, plans, out, kw),) = calls
    assert [c.name for c in configs] == ["defaults", "recommended"]
    assert configs[1].recompute_threshold_tokens == 55
    assert out == tmp_path / "t" / "verify"
    # The sweep spans the workload's histories (one block to the longest), whatever the
    # recommendation's break-even (55) says.
    lengths = kw["crossover"].lengths_tokens
    assert lengths[0] == 128 and lengths[-1] == X.longest_history(plans)
    assert len(lengths) == X.N_LENGTHS


def test_tune_dir_replays_the_lab_regime_it_was_tuned_in(calls, tmp_path):
    (tmp_path / "t" / "configs").mkdir(parents=True)
    (tmp_path / "t" / "configs" / "recommendation.json").write_text(json.dumps({
        "lab": {"regime": "fleet", "why": "..."},
        "recommendations": {
            "mode": {"value": "bidirectional"}, "kv_recompute_threshold": {"value": 55},
            "decoder_kv_blocks_ttl": {"value": 22}}}))
    assert cli.main(["verify", "--tune-dir", str(tmp_path / "t"), "--workload", "tune",
                     "--conversations", "32", "--no-progress"]) == 0
    ((_, backend, plans, _, kw),) = calls
    assert backend.pair_kwargs["regime"] is FLEET and "lab regime fleet" in backend.description
    assert kw["turn_major"] is True and kw["max_concurrency"] == 1
    assert sorted(len(p.turns[0].user_tokens) for p in plans) == sorted(FLEET.first_prompt_tokens)
    # --lab overrides the tune directory's
    assert cli.main(["verify", "--tune-dir", str(tmp_path / "t"), "--lab", "warm",
                     "--no-progress"]) == 0
    assert calls[1][1].pair_kwargs["regime"] is WARM


def test_cluster_target(calls, tmp_path):
    assert cli.main(["verify", "--config", "defaults", "--config", "defaults:bidirectional",
                     "--prefill", "http://10.0.0.1:8100/", "--decode", "http://10.0.0.2:8200",
                     "--no-wait", "--out", str(tmp_path)]) == 0
    backend = calls[0][1]
    assert isinstance(backend, ClusterBackend)
    assert backend.prefill[0].url == "http://10.0.0.1:8100"


@pytest.mark.parametrize("argv,match", [
    (["verify"], "expected --config"),
    (["verify", "--config", "defaults", "--prefill", "http://h:1"], "go together"),
    (["verify", "--config", "nothing-here.yaml"], "no such file"),
    (["verify", "--config", "defaults", "--crossover", "--crossover-lengths", "a,b"],
     "comma-separated integers"),
    (["verify", "--config", "defaults", "--crossover", "--crossover-lengths", "64"],
     "at least 2 distinct"),
    (["verify", "--tune-dir", "/nonexistent-kvtune"], "no configs/recommendation.json"),
    (["verify", "--config", "defaults", "--lab", "cold"], "expected one of ['fleet', 'warm']"),
    (["verify", "--config", "defaults", "--lab", "fleet", "--prefill", "http://h:1", "--decode",
      "http://h:2"], "applies to the local pair"),
])
def test_bad_arguments_exit_2_naming_the_input(calls, argv, match, capsys, tmp_path):
    assert cli.main(argv + ["--out", str(tmp_path)]) == 2
    assert match in capsys.readouterr().err
    assert calls == []


def test_fabric_shapes_each_pair_or_stays_loopback(calls, tmp_path, capsys):
    rc = cli.main(["verify", "--config", "defaults", "--fabric", "shaped:1gbit",
                   "--out", str(tmp_path)])
    assert rc == 0 and calls[0][1].shaped_rate_mbit == 1000.0
    assert "veth-tbf-1000mbit" in calls[0][1].description
    assert "fabric" not in calls[0][1].pair_kwargs  # the link is built per deploy
    rc = cli.main(["verify", "--config", "defaults", "--fabric", "loopback", "--out",
                   str(tmp_path)])
    assert rc == 0 and calls[1][1].shaped_rate_mbit is None
    rc = cli.main(["verify", "--config", "defaults", "--fabric", "shaped:fast", "--out",
                   str(tmp_path)])
    assert rc == 2 and "RATE expected a number" in capsys.readouterr().err and len(calls) == 2


def test_tune_workload_replays_tunes_traffic_two_at_a_time(calls, tmp_path):
    rc = cli.main(["verify", "--config", "defaults", "--workload", "tune", "--conversations", "7",
                   "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    ((configs, backend, plans, out, kw),) = calls
    assert kw["max_concurrency"] == WARM.parallel_conversations == 2
    assert len(plans) == 7 and all(len(p.turns) == WARM.turns for p in plans)
    firsts = [len(p.turns[0].user_tokens) for p in plans]
    assert firsts[:3] == list(WARM.first_prompt_tokens)
    assert {len(t.user_tokens) for p in plans for t in p.turns[1:]} == {WARM.new_tokens_per_turn}


def test_modes_need_a_recommendation(calls, tmp_path, capsys):
    rc = cli.main(["verify", "--config", "defaults", "--modes", "--out", str(tmp_path)])
    assert rc == 2 and "--modes: needs --tune-dir" in capsys.readouterr().err and calls == []


def test_max_starts_at_or_below_starts_adds_no_round_and_a_bad_aim_is_refused(calls, tmp_path,
                                                                               capsys):
    base = ["verify", "--config", "defaults", "--config", "b=defaults:bidirectional",
            "--conversations", "3", "--out", str(tmp_path / "o"), "--no-progress"]
    assert cli.main(base + ["--starts", "2", "--max-starts", "2"]) == 0
    assert calls[-1][4]["more_starts"] is None
    assert cli.main(base + ["--aim-detectable", "0"]) == 2
    assert "--aim-detectable: expected a percentage > 0, got 0.0" in capsys.readouterr().err
