"""The tiny local model: real Hugging Face files (config, bf16 safetensors, fast tokenizer with a
chat template), deterministic, cached, and built without any hub access."""
from __future__ import annotations

import hashlib
import json
import os
import struct

import pytest

from kvtune.errors import ConfigError, KvtuneError
from kvtune.local.tiny_model import (
    EOS_TOKEN, HIDDEN_SIZE, MARKER_FILE, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS, VOCAB_SIZE,
    make_tiny_model,
)


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def safetensors_header(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3")


def test_config_has_the_toy_qwen3_shape(qwen):
    cfg = json.loads((qwen / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (NUM_LAYERS, HIDDEN_SIZE) == (2, 256)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (NUM_HEADS, NUM_KV_HEADS) \
        == (4, 2)
    assert cfg["vocab_size"] == VOCAB_SIZE == 2048
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"


def test_weights_are_bf16_safetensors_of_the_right_shapes(qwen):
    header = safetensors_header(qwen / "model.safetensors")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    assert tensors and {v["dtype"] for v in tensors.values()} == {"BF16"}
    assert tensors["model.embed_tokens.weight"]["shape"] == [VOCAB_SIZE, HIDDEN_SIZE]
    head_dim = HIDDEN_SIZE // NUM_HEADS
    assert tensors["model.layers.1.self_attn.k_proj.weight"]["shape"] == [NUM_KV_HEADS * head_dim,
                                                                          HIDDEN_SIZE]
    assert not any(k.startswith("model.layers.2.") for k in tensors)


def test_tokenizer_loads_offline_round_trips_and_has_a_chat_template(qwen, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(qwen)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == VOCAB_SIZE
    text = "The prefill engine sends 4096 KV blocks to the decode, then waits."
    ids = tok(text)["input_ids"]
    assert 0 < len(ids) < len(text)  # BPE merged something
    assert tok.decode(ids) == text
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id is not None
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_same_seed_gives_identical_files_and_another_seed_differs(qwen, tmp_path):
    again = make_tiny_model(tmp_path / "again")
    other = make_tiny_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha(again / name) == sha(qwen / name), name
    assert sha(other / "model.safetensors") != sha(qwen / "model.safetensors")


def test_an_existing_build_is_reused(qwen):
    before = {p.name: p.stat().st_mtime_ns for p in qwen.iterdir()}
    assert make_tiny_model(qwen) == qwen
    assert {p.name: p.stat().st_mtime_ns for p in qwen.iterdir()} == before


def test_llama_arch(tmp_path):
    out = make_tiny_model(tmp_path / "llama", arch="llama")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_key_value_heads"] == NUM_KV_HEADS
    assert (out / MARKER_FILE).exists()


@pytest.mark.parametrize("kwargs, field", [
    ({"arch": "gpt2"}, "arch"), ({"seed": -1}, "seed"), ({"seed": "0"}, "seed"),
])
def test_bad_arguments_name_the_field(tmp_path, kwargs, field):
    with pytest.raises(ConfigError, match=field) as err:
        make_tiny_model(tmp_path / "m", **kwargs)
    assert isinstance(err.value, KvtuneError)
    assert not (tmp_path / "m").exists()


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=MARKER_FILE):
        make_tiny_model(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".mine.tmp")]
