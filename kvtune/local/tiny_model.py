"""A tiny random-weight model and an offline tokenizer, for running real vLLM on a CPU.

``make_tiny_model(dir)`` writes a Hugging Face model directory (config, bf16 safetensors weights,
generation config, a byte-level BPE ``PreTrainedTokenizerFast`` with a chat template) that vLLM
loads with ``HF_HUB_OFFLINE=1``. Nothing comes from a hub: the weights are random (seeded) and the
tokenizer is trained with ``tokenizers`` on a corpus generated here. The same arguments give the
same files, and a directory already built with the same arguments is re-used.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Final

from kvtune.errors import ConfigError

ARCHS: Final = ("qwen3", "llama")
"""Architectures ``make_tiny_model`` can build (both are real vLLM model classes)."""

VOCAB_SIZE: Final = 2048
HIDDEN_SIZE: Final = 256
INTERMEDIATE_SIZE: Final = 512
NUM_LAYERS: Final = 2
NUM_HEADS: Final = 4
NUM_KV_HEADS: Final = 2
HEAD_DIM: Final = HIDDEN_SIZE // NUM_HEADS
MAX_POSITION_EMBEDDINGS: Final = 4096
INITIALIZER_RANGE: Final = 0.2
"""Std of the random weights. Larger than the usual 0.02 so that the logits are spread out and the
greedy choice is not a near-tie that bf16 rounding differences between a P/D pair and a single
instance could flip."""

EOS_TOKEN: Final = "<|endoftext|>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
SPECIAL_TOKENS: Final = (EOS_TOKEN, IM_START, IM_END)
FIRST_PLAIN_TOKEN_ID: Final = len(SPECIAL_TOKENS)
"""Generated and reference prompts use token ids from here up (the tokenizer trainer gives the
special tokens ids 0..2)."""

CHAT_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""A ChatML-style template, as Qwen models use."""

MARKER_FILE: Final = "kvtune_tiny_model.json"
"""Written last into a finished model directory; holds the build parameters (the cache key)."""
BUILD_VERSION: Final = 1
"""Bump when the files this module writes change, so cached directories are rebuilt."""

_WORDS: Final = (
    "the a an of to in on at for with from by and or but not is are was were be been has have had "
    "do does did will would can could should may might must shall this that these those it its "
    "he she they we you I me him her them us my your our their what which who whom whose when "
    "where why how all any both each few more most other some such no nor only own same so than "
    "too very just now then here there again once under over above below up down out off into "
    "through during before after about against between request token cache block transfer "
    "prefill decode engine model layer memory network latency bandwidth throughput server client "
    "router queue batch schedule kernel tensor attention key value head prompt output turn "
    "conversation agent tool call result answer question search file read write open close list "
    "python function class method return error retry timeout deadline budget cost price time "
    "second minute hour day week month year number string integer float vector matrix graph "
    "node edge path tree root leaf branch merge split sort filter map reduce sum count mean "
    "median percentile histogram trace span metric log event alert dashboard panel query "
    "please thanks hello goodbye yes no maybe sure okay great good bad fast slow big small new "
    "old first last next previous early late high low long short hot cold warm remote local "
    "think plan step check verify test build run deploy measure compare explain summarize"
).split()


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Deterministic pseudo-sentences plus digits and punctuation, enough to fill the vocabulary."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 100000)))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(".?!:;,")
        if i % 7 == 0:
            sentence = f"{IM_START}user\n{sentence}{IM_END}\n{IM_START}assistant\n"
        lines.append(sentence)
    return lines


def _build_tokenizer(out: Path, seed: int) -> int:
    """Train a byte-level BPE tokenizer with exactly ``VOCAB_SIZE`` entries; returns the EOS id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    # The model's vocabulary is fixed; fill any shortfall with reserved tokens so that every id the
    # model can sample decodes to something.
    n = tok.get_vocab_size()
    if n < VOCAB_SIZE:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - n)])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise ConfigError(f"tiny tokenizer: vocab_size expected {VOCAB_SIZE}, "
                          f"got {tok.get_vocab_size()}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END], model_max_length=MAX_POSITION_EMBEDDINGS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return int(tok.token_to_id(EOS_TOKEN))


def _build_model(out: Path, arch: str, seed: int, eos_id: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, \
        Qwen3ForCausalLM

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS, initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    if arch == "qwen3":
        config, cls = Qwen3Config(**common), Qwen3ForCausalLM
    else:
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)


def make_tiny_model(dir: str | os.PathLike[str], *, arch: str = "qwen3", seed: int = 0) -> Path:
    """Build (or re-use) a tiny random-weight ``arch`` model with its tokenizer in ``dir``.

    2 layers, hidden 256, 4 heads, 2 KV heads, vocab 2048, bf16. Returns the directory's path.
    The build goes to a temporary sibling directory that is renamed into place, so concurrent
    callers and interrupted builds never leave a half-written model behind.
    """
    if arch not in ARCHS:
        raise ConfigError(f"make_tiny_model: arch expected one of {ARCHS}, got {arch!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"make_tiny_model: seed expected a non-negative int, got {seed!r}")
    out = Path(dir).expanduser().resolve()
    key = {"arch": arch, "seed": seed, "build_version": BUILD_VERSION, "vocab_size": VOCAB_SIZE,
           "hidden_size": HIDDEN_SIZE, "num_hidden_layers": NUM_LAYERS}
    if _cached(out, key):
        return out
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER_FILE).exists():
            raise ConfigError(f"make_tiny_model: {out} exists and is not a kvtune tiny model "
                              f"(no {MARKER_FILE}); expected an empty or absent directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        eos_id = _build_tokenizer(tmp, seed)
        _build_model(tmp, arch, seed, eos_id)
        (tmp / MARKER_FILE).write_text(json.dumps(key, sort_keys=True) + "\n")
        if _cached(out, key):  # another process finished first
            return out
        if out.exists():
            shutil.rmtree(out)
        try:
            os.rename(tmp, out)
        except OSError:
            if not _cached(out, key):  # lost a race to a different build: surface it
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _cached(out: Path, key: dict) -> bool:
    try:
        return json.loads((out / MARKER_FILE).read_text()) == key
    except (OSError, ValueError):
        return False
