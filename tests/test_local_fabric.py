"""The local pair's fabric option: loopback, or a veth link between two network namespaces shaped
with ``tc tbf`` (``kvtune.local.fabric``). The real-vLLM test checks that the KV crossed the shaped
link (the link's own byte counters grow by at least the KV moved), not how fast."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from kvtune.local.fabric import FabricError, FabricSpec, ShapedLink, parse_fabric
from kvtune.local.pair import LocalPair
from kvtune.testing.reference import STANDARD_MAX_TOKENS, standard_prompts
from kvtune.vllm_pd import REMOTE_HOST


@pytest.mark.parametrize("spec, rate", [("loopback", None), ("LOOPBACK", None),
                                        ("shaped:200mbit", 200.0), ("shaped:1gbit", 1000.0),
                                        ("shaped:500kbit", 0.5),
                                        ("shaped:75", 75.0), ("shaped: 2.5 Mbit", 2.5)])
def test_fabric_specs_parse(spec, rate):
    if rate is not None and rate < 1:
        with pytest.raises(FabricError, match="between"):
            parse_fabric(spec)
        return
    assert parse_fabric(spec) == FabricSpec(rate)


def test_auto_is_the_shaped_gigabit_link_where_one_can_be_built(monkeypatch):
    import kvtune.local.fabric as F

    monkeypatch.setattr(F, "check_can_shape", lambda: None)
    assert parse_fabric("auto") == FabricSpec(F.AUTO_RATE_MBIT)

    def refuse() -> None:
        raise FabricError("shaped fabric: needs root")
    monkeypatch.setattr(F, "check_can_shape", refuse)
    assert parse_fabric("auto") == FabricSpec()


@pytest.mark.parametrize("spec, match", [("tcp", "'loopback', 'auto' or 'shaped:RATE'"),
                                         ("shaped:", "RATE expected a number"),
                                         ("shaped:fast", "RATE expected a number"),
                                         ("shaped:200tbit", "RATE expected a number"),
                                         ("shaped:0", "between"), (200, "expected")])
def test_bad_fabric_specs_say_what_was_expected(spec, match):
    with pytest.raises(FabricError, match=match):
        parse_fabric(spec)


def test_fabric_names_and_side_settings():
    assert FabricSpec().name == "local-ucx"
    assert FabricSpec(200.0).name == "veth-tbf-200mbit"
    link = ShapedLink(200)  # not opened: only its plan
    assert link.prefix("decode")[:3] == ["ip", "netns", "exec"] and link.prefix("prefill") == []
    for role in ("prefill", "decode"):
        env = link.env(role)
        assert env["UCX_TLS"] == "tcp"  # no shared-memory shortcut across the link
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == link.host(role)
    assert link.env("prefill")["UCX_NET_DEVICES"] != link.env("decode")["UCX_NET_DEVICES"]
    probe = link.probe_settings()
    assert probe["target_bind"] == link.decode_ip and probe["target_prefix"] == tuple(
        link.prefix("decode"))
    with pytest.raises(FabricError, match="rate_mbit"):
        ShapedLink(0)


def _tx_bytes(link: ShapedLink) -> int:
    out = subprocess.run(["ip", "-s", "-j", "link", "show", link.prefill_dev], check=True,
                         capture_output=True, text=True).stdout
    import json
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"]) + int(
        json.loads(out)[0]["stats64"]["rx"]["bytes"])


@pytest.mark.vllm
@pytest.mark.netns
def test_pull_pair_moves_kv_across_the_shaped_link(tmp_path, model_dir, reference):
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        pytest.skip("needs root, ip and tc to build the shaped link")
    with ShapedLink(400) as link:
        with LocalPair("pull", connector="kvtune", workdir=tmp_path, model_dir=model_dir,
                       fabric=link) as pair:
            assert pair.decode_url.startswith(f"http://{link.decode_ip}:")
            prompt = standard_prompts()[1]
            before = _tx_bytes(link)
            result = pair.complete(prompt, STANDARD_MAX_TOKENS)
            moved = _tx_bytes(link) - before
            assert result.token_ids == reference.outputs[1]
            assert result.kv_transfer_params[REMOTE_HOST] == link.prefill_ip
            kv_bytes = len(prompt) * 1024 // 2  # at least half the tiny model's 1 KiB per token
            assert moved >= kv_bytes, (moved, kv_bytes)


@pytest.mark.parametrize("argv, match", [
    (["tune", "--traces", "x.jsonl", "--fabric", "shaped:1gbit"], "applies only without --traces"),
    (["tune", "--fabric", "wifi"], "expected 'loopback', 'auto' or 'shaped:RATE'")])
def test_tune_rejects_a_bad_fabric_before_running_anything(argv, match, capsys, tmp_path):
    from kvtune.cli import main

    assert main(argv + ["--out", str(tmp_path / "out")]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
