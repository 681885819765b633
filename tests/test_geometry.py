"""KV geometry: bytes per token, vLLM's descriptor layout, presets and HF configs."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvtune.errors import ConfigError, KvtuneError
from kvtune.geometry import KvGeometry, from_hf_config, preset
from kvtune.spans import Layout


def test_qwen3_32b_is_256_kib_per_token_and_splits_over_tp():
    g = preset("qwen3-32b")
    assert (g.layers, g.kv_heads, g.head_dim, g.dtype_bytes) == (64, 8, 128, 2)
    assert g.bytes_per_token == 256 * 1024
    assert g.block_bytes == 16 * 8 * 128 * 2
    assert g.bytes_per_block == 16 * 256 * 1024
    assert preset("qwen3-32b", tp_size=4).bytes_per_token == 64 * 1024
    # more ranks than KV heads: heads are replicated, one per rank
    assert preset("qwen3-32b", tp_size=16).bytes_per_token == 64 * 2 * 1 * 128 * 2


def test_partial_block_moves_whole():
    g = preset("qwen3-32b")
    assert g.blocks(17) == 2
    assert g.transfer_bytes(17) == 2 * g.bytes_per_block


def test_per_block_descriptors_follow_vllm_layout():
    g = KvGeometry(layers=2, kv_heads=1, head_dim=4, dtype_bytes=2, block_size_tokens=2)
    block = 2 * 1 * 4 * 2
    d = g.descriptors(3, Layout.PER_BLOCK, capacity_blocks=5)  # 2 blocks of 4 regions
    assert d.shape == (4 * 2, 2)
    region = 5 * block
    expected = [(r * region + j * block, block) for r in range(4) for j in range(2)]
    assert [tuple(x) for x in d.tolist()] == expected
    assert g.descriptor_count(3, "per_block") == 8
    assert int(d[:, 1].sum()) == g.transfer_bytes(3)


def test_merged_descriptors_one_per_region():
    g = KvGeometry(layers=3, kv_heads=2, head_dim=8, dtype_bytes=2, block_size_tokens=4)
    d = g.descriptors(10, "merged", capacity_blocks=7)
    assert d.shape == (6, 2)
    assert (d[:, 1] == 3 * g.block_bytes).all()
    assert np.array_equal(d[:, 0], np.arange(6) * 7 * g.block_bytes)
    assert g.descriptor_count(10, Layout.MERGED) == 6
    assert int(d[:, 1].sum()) == g.transfer_bytes(10)


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match="'layers'"):
        KvGeometry(layers=0, kv_heads=8, head_dim=128, dtype_bytes=2)
    with pytest.raises(ConfigError, match="tp_size"):
        KvGeometry(64, 8, 128, 2, tp_size=3)
    with pytest.raises(ConfigError, match="layout"):
        preset("qwen3-32b").descriptor_count(16, "diagonal")
    with pytest.raises(ConfigError, match="capacity_blocks"):
        preset("qwen3-32b").descriptors(64, "per_block", capacity_blocks=1)
    with pytest.raises(ConfigError, match="model preset"):
        preset("gpt-7")
    with pytest.raises(KvtuneError, match="tokens"):
        preset("tiny").blocks(0)


def _write(tmp_path, cfg) -> str:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def test_from_hf_config_reads_head_dim_or_derives_it(tmp_path):
    qwen = {"num_hidden_layers": 64, "num_key_value_heads": 8, "num_attention_heads": 64,
            "head_dim": 128, "hidden_size": 5120, "torch_dtype": "bfloat16"}
    g = from_hf_config(_write(tmp_path, qwen), tp_size=2)
    assert g.bytes_per_token == preset("qwen3-32b").bytes_per_token // 2
    llama = {"num_hidden_layers": 32, "num_key_value_heads": 8, "num_attention_heads": 32,
             "hidden_size": 4096, "torch_dtype": "float16"}
    g = from_hf_config(tmp_path)  # a directory holding config.json
    assert g.layers == 64
    g = from_hf_config(_write(tmp_path, llama))
    assert g.head_dim == 128 and g.dtype_bytes == 2 and g.bytes_per_token == 32 * 2 * 8 * 128 * 2


def test_from_hf_config_errors_name_file_and_field(tmp_path):
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        from_hf_config(_write(tmp_path, {"num_key_value_heads": 8}))
    with pytest.raises(ConfigError, match="torch_dtype"):
        from_hf_config(_write(tmp_path, {"num_hidden_layers": 2, "num_key_value_heads": 2,
                                         "head_dim": 64, "torch_dtype": "int3"}))
    with pytest.raises(ConfigError, match="head_dim"):
        from_hf_config(_write(tmp_path, {"num_hidden_layers": 2, "num_key_value_heads": 2,
                                         "torch_dtype": "bfloat16"}))
    with pytest.raises(ConfigError, match="not found"):
        from_hf_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match="bad.json"):
        from_hf_config(tmp_path / "bad.json")
