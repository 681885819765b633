"""kvtune.export.write: files vLLM (installed 0.32) and the router accept as they are; atomicity."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import yaml

from kvtune import spans as sc
from kvtune.analysis import FloorFit
from kvtune.errors import ConfigError
from kvtune.export import FILES, NEVER_THRESHOLD_TOKENS, write
from kvtune.geometry import KvGeometry
from kvtune.recommend import NEVER, Recommendation, Tuning
from kvtune.recommend.evidence import ModeEvidence, ThresholdEvidence, TtftMs, TtlEvidence
from kvtune.vllm_pd import (BIDIRECTIONAL_KV_XFER, KV_CONNECTOR, KV_CONNECTOR_EXTRA_CONFIG,
                            KV_CONNECTOR_MODULE_PATH, KV_CONSUMER, KV_PRODUCER)

EXPECTED_FILES = [
    "prefill.kv-transfer-config.json", "decode.kv-transfer-config.json",
    "prefill.vllm-serve.args", "decode.vllm-serve.args", "router.yaml", "recommendation.json",
    "REPORT.md", ".kvtune-export",
]
GEOMETRY = KvGeometry(layers=64, kv_heads=8, head_dim=128, dtype_bytes=2, tp_size=2)


def _tuning(mode: str = "bidirectional", threshold: int | str = 300, ttl: int = 120) -> Tuning:
    fit = FloorFit(floor_ms=2.0, bandwidth_gbps=40.0, per_descriptor_us=5.0,
                   floor_ci_ms=(1.9, 2.1), bandwidth_ci_gbps=(39.0, 41.0),
                   per_descriptor_ci_us=(4.8, 5.2), r2=0.99, n_transfers=144, n_sizes=6,
                   source="t.jsonl")
    ttft = {m: TtftMs(100.0, 200.0) for m in ("pull", "push", "bidirectional")}
    thr_ev = ThresholdEvidence(
        break_even_tokens=None, floor_ms=2.0, bandwidth_gbps=40.0, per_descriptor_us=5.0,
        bytes_per_token=1024.0, descriptors_per_token=1.0, wire_ms_per_token=0.01,
        prefill_per_token_ms=0.02, prefill_per_token_prefix_us=0.0, max_context_tokens=4000,
        fit_r2=0.99, fit_n_transfers=144, prefill_n_observations=100)
    ttl_ev = TtlEvidence(n_gaps=0, hbm_budget_gb=10.0, bytes_per_token=1024.0,
                         threshold_tokens=300.0, duration_s=60.0, peak_to_mean=2.0)
    return Tuning(
        threshold=Recommendation("kv_recompute_threshold", threshold, (200, 400), "tokens",
                                 thr_ev, ("a",)),
        ttl=Recommendation("decoder_kv_blocks_ttl", ttl, (100, 140), "s", ttl_ev, ()),
        mode=Recommendation("mode", mode, (mode, "pull"), "mode",
                            ModeEvidence(model="analytic", excluded={}, expected_ttft_ms=ttft), ()),
        findings=(), fit=fit, source="t.jsonl", span_count=1234)


def _read(d, name):
    return (d / name).read_text()


@pytest.fixture(scope="module")
def vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


@pytest.mark.parametrize("mode", ["pull", "push", "bidirectional"])
def test_files_load_in_vllm_and_router(tmp_path, vllm_parser, mode):
    from vllm.config import KVTransferConfig

    from kvtune.router.config import config_from_dict

    out = write(_tuning(mode), tmp_path / "out", geometry=GEOMETRY, model="Qwen/Qwen3-32B")
    assert sorted(os.listdir(out)) == sorted(EXPECTED_FILES) and list(FILES) == EXPECTED_FILES
    for role, kv_role in (("prefill", KV_PRODUCER), ("decode", KV_CONSUMER)):
        data = json.loads(_read(out, f"{role}.kv-transfer-config.json"))
        cfg = KVTransferConfig(**data)  # vLLM's own dataclass accepts every key
        assert cfg.kv_role == kv_role
        assert cfg.kv_connector_module_path == "kvtune.connectors"
        assert cfg.kv_connector == ("KvtuneNixlPushConnector" if mode == "push"
                                    else "KvtuneNixlPullConnector")
        # the keys vLLM's NIXL scheduler reads (base_scheduler.py)
        assert cfg.get_from_extra_config("kv_recompute_threshold", None) == 300
        assert cfg.get_from_extra_config("decoder_kv_blocks_ttl", None) == 120
        assert cfg.get_from_extra_config(BIDIRECTIONAL_KV_XFER, None) is (mode == "bidirectional")
        args = _read(out, f"{role}.vllm-serve.args").splitlines()
        ns = vllm_parser.parse_args(args)  # SystemExit on any unknown flag
        assert ns.model_tag == "Qwen/Qwen3-32B"
        assert isinstance(ns.kv_transfer_config, KVTransferConfig)
        assert ns.kv_transfer_config.kv_connector_extra_config == data[KV_CONNECTOR_EXTRA_CONFIG]
        assert ns.block_size == 16 and ns.tensor_parallel_size == 2
        assert ns.port == (8100 if role == "prefill" else 8200)
    router = config_from_dict(yaml.safe_load(_read(out, "router.yaml")), source="router.yaml")
    assert router.mode.value == mode
    if mode == "bidirectional":
        assert router.decoder_ttl_s == 120 and 0 < router.margin_s < 120
    if mode == "push":
        pre = json.loads(_read(out, "prefill.kv-transfer-config.json"))
        assert router.prefill[0].engine_id == pre["engine_id"]


def test_args_flags_exist_in_vllm_serve(tmp_path, vllm_parser):
    out = write(_tuning(), tmp_path / "out", geometry=GEOMETRY, model="m")
    known = {o for a in vllm_parser._actions for o in a.option_strings}
    flags = [a for a in _read(out, "prefill.vllm-serve.args").splitlines() if a.startswith("--")]
    assert flags == ["--port", "--kv-transfer-config", "--block-size", "--tensor-parallel-size"]
    assert set(flags) <= known


def test_recommendation_json_contents(tmp_path):
    out = write(_tuning(), tmp_path / "out", model="m")
    rec = json.loads(_read(out, "recommendation.json"))
    assert rec["kvtune_version"] == __import__("kvtune").__version__
    assert rec["trace_source"] == "t.jsonl" and rec["span_count"] == 1234
    assert rec["fit_quality"] == {"r2": 0.99, "n_transfers": 144, "n_sizes": 6, "n_outliers": 0}
    assert rec["recommendations"]["kv_recompute_threshold"]["value"] == 300
    assert rec["recommendations"]["kv_recompute_threshold"]["range"] == [200, 400]
    assert rec["recommendations"]["decoder_kv_blocks_ttl"]["value"] == 120
    assert rec["recommendations"]["mode"]["value"] == "bidirectional"
    assert rec["written"]["kv_recompute_threshold"] == 300
    assert rec["files"] == EXPECTED_FILES
    report = _read(out, "REPORT.md")
    assert "kv_recompute_threshold | **300** tokens" in report and "bidirectional" in report


def test_never_threshold_writes_always_recompute(tmp_path):
    out = write(_tuning(mode="pull", threshold=NEVER, ttl=0), tmp_path / "out", model="m")
    extra = json.loads(_read(out, "decode.kv-transfer-config.json"))[KV_CONNECTOR_EXTRA_CONFIG]
    assert extra["kv_recompute_threshold"] == NEVER_THRESHOLD_TOKENS
    assert extra[BIDIRECTIONAL_KV_XFER] is False
    assert "decoder_kv_blocks_ttl" not in extra  # 0 would also be push's registration timeout
    router = yaml.safe_load(_read(out, "router.yaml"))
    assert router["mode"] == "pull" and "decoder_ttl_s" not in router
    assert "Reuse never pays" in _read(out, "REPORT.md")


def test_vllm_connector_family(tmp_path):
    out = write(_tuning(mode="push"), tmp_path / "out", model="m", connector="vllm")
    data = json.loads(_read(out, "prefill.kv-transfer-config.json"))
    assert data[KV_CONNECTOR] == "NixlPushConnector" and KV_CONNECTOR_MODULE_PATH not in data


def test_nothing_written_half_way(tmp_path):
    def boom(tmp):
        assert sorted(os.listdir(tmp)) == sorted(EXPECTED_FILES)  # complete before the rename
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write(_tuning(), tmp_path / "out", model="m", _before_commit=boom)
    assert os.listdir(tmp_path) == []  # no out dir, no temp dir left behind


def test_existing_output_is_refused_or_replaced_whole(tmp_path):
    out = write(_tuning(threshold=300), tmp_path / "out", model="m")
    (out / "stale.txt").write_text("old")
    with pytest.raises(ConfigError, match="exists.*overwrite"):
        write(_tuning(threshold=301), out, model="m")
    assert json.loads(_read(out, "recommendation.json"))["written"]["kv_recompute_threshold"] == 300
    write(_tuning(threshold=301), out, model="m", overwrite=True)
    assert sorted(os.listdir(out)) == sorted(EXPECTED_FILES)
    assert json.loads(_read(out, "recommendation.json"))["written"]["kv_recompute_threshold"] == 301
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_bad_model_name_is_refused_before_writing(tmp_path):
    with pytest.raises(ConfigError, match="model"):
        write(_tuning(), tmp_path / "out", model="my model")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["m\x00x", "m\x1b[31m", "m\u202ex", "m\u200bx", "m\x7f"])
def test_model_name_with_a_control_character_is_refused(name, tmp_path):
    """Before: a NUL (or an escape sequence, or a bidirectional override) in the model name was
    written raw into the serve-args file."""
    with pytest.raises(ConfigError, match="field 'model'.*control characters"):
        write(_tuning(), tmp_path / "out", model=name)
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == []


def test_unknown_mode_is_refused(tmp_path):
    t = _tuning()
    t = dataclasses.replace(t, mode=dataclasses.replace(t.mode, value=sc.Mode.PROBE.value))
    with pytest.raises(ConfigError, match="mode 'probe'"):
        write(t, tmp_path / "out", model="m")
