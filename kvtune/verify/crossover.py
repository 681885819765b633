"""The measured recompute/pull crossover: turn-2 TTFT over history lengths with reuse forced on
(``kv_recompute_threshold`` 1: every history is pulled back from the decode) and forced off (a
threshold no history reaches: always recomputed), both in bidirectional mode.

Each swept conversation has two turns. Turn 1 sends a short prompt (under one 128-token block,
so the prefill's own prefix cache keeps none of it) and asks for ``history - prompt`` output
tokens; turn 2 sends that history plus a short follow-up. The history the prefill can pull back
is then the whole turn-1 prompt and output, and turn 2's TTFT is recompute vs pull of that many
tokens. Conversations run one at a time, lengths interleaved (so drift does not follow length).
"""
from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvtune.errors import ConfigError
from kvtune.local.workload import FIRST_PLAIN_TOKEN_ID, ConversationPlan, TurnPlan
from kvtune.local.tiny_model import VOCAB_SIZE
from kvtune.verify import stats
from kvtune.verify.backends import Backend
from kvtune.verify.configs import VerifyConfig
from kvtune.verify.results import ConfigResult, CrossoverPoint, CrossoverResult

REUSE_ON_THRESHOLD_TOKENS: Final = 1
MAX_HISTORY_TOKENS: Final = 1900
"""Longest swept history: the local pair's ``--max-model-len`` is 2048 (room for the follow-up)."""
MIN_HISTORY_TOKENS: Final = 16
ID_PREFIX: Final = "xo"


@dataclass(frozen=True)
class CrossoverSpec:
    lengths_tokens: tuple[int, ...]
    """History lengths to sweep (turn 1's prompt + output), tokens."""
    repeats: int = 5
    """Conversations per length and configuration."""
    prompt_tokens: int = 8
    follow_up_tokens: int = 8
    think_time_s: float = 0.2
    ttl_s: float | None = None
    """``decoder_kv_blocks_ttl`` of both sweep configurations (None: vLLM's default)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if len(set(self.lengths_tokens)) < 2:
            raise ConfigError(f"crossover: lengths_tokens expected at least 2 distinct lengths, "
                              f"got {self.lengths_tokens}")
        bad = [n for n in self.lengths_tokens
               if not isinstance(n, int) or not self.prompt_tokens < n <= MAX_HISTORY_TOKENS]
        if bad:
            raise ConfigError(f"crossover: lengths_tokens expected integers in "
                              f"({self.prompt_tokens}, {MAX_HISTORY_TOKENS}], got {bad}")
        if self.repeats < 2:
            raise ConfigError(f"crossover: repeats expected >= 2, got {self.repeats}")
        if not 1 <= self.prompt_tokens < 128 or self.follow_up_tokens < 1:
            raise ConfigError("crossover: prompt_tokens expected 1..127 (under one block) and "
                              "follow_up_tokens >= 1")

    def configs(self) -> tuple[VerifyConfig, VerifyConfig]:
        from kvtune.export.files import NEVER_THRESHOLD_TOKENS

        return (VerifyConfig("reuse-on", "bidirectional", REUSE_ON_THRESHOLD_TOKENS, self.ttl_s,
                             source="crossover sweep: every history pulled back"),
                VerifyConfig("reuse-off", "bidirectional", NEVER_THRESHOLD_TOKENS, self.ttl_s,
                             source="crossover sweep: every history recomputed"))


def lengths_around(break_even_tokens: float | None, range_tokens: Sequence[float] | None = None,
                   *, n: int = 6) -> tuple[int, ...]:
    """``n`` history lengths, geometric, spanning the recommended range and a factor of 4 around
    the predicted break-even (clipped to what the local pair holds)."""
    if n < 2:
        raise ConfigError(f"crossover: n expected >= 2, got {n}")
    be = break_even_tokens if break_even_tokens and break_even_tokens > 0 else 128.0
    lo, hi = be / 4.0, be * 4.0
    if range_tokens is not None and len(range_tokens) == 2:
        vals = [float(v) for v in range_tokens if isinstance(v, (int, float)) and v > 0]
        if vals:
            lo, hi = min(lo, min(vals)), max(hi, max(vals))
    lo = max(MIN_HISTORY_TOKENS, lo)
    hi = min(MAX_HISTORY_TOKENS, max(hi, lo * 2))
    out = sorted({int(round(math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i / (n - 1))))
                  for i in range(n)})
    return tuple(out)


def plans(spec: CrossoverSpec) -> list[ConversationPlan]:
    """The sweep's conversations (deterministic), lengths interleaved."""
    rng = random.Random(spec.seed)

    def tokens(k: int) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_PLAIN_TOKEN_ID, VOCAB_SIZE) for _ in range(k))

    order = [(h, r) for r in range(spec.repeats) for h in spec.lengths_tokens]
    rng.shuffle(order)
    return [ConversationPlan(
        conversation_id=f"{ID_PREFIX}-{h}-{r}", start_s=0.0, system_tokens=(),
        turns=(TurnPlan(1, tokens(spec.prompt_tokens), h - spec.prompt_tokens, 0.0),
               TurnPlan(2, tokens(spec.follow_up_tokens), 1, spec.think_time_s)))
        for h, r in order]


def history_of(conversation_id: str) -> int | None:
    parts = conversation_id.split("-")
    if len(parts) == 3 and parts[0] == ID_PREFIX and parts[1].isdigit():
        return int(parts[1])
    return None


def points(on: ConfigResult, off: ConfigResult) -> tuple[CrossoverPoint, ...]:
    out = []
    for label, res in (("on", on), ("off", off)):
        for r in res.requests:
            h = history_of(r.conversation_id)
            if r.turn == 2 and r.ok and r.ttft_ms is not None and h is not None:
                out.append(CrossoverPoint(h, label, float(r.ttft_ms)))
    return tuple(out)


def recommended_threshold(rec: Mapping[str, Any] | None
                          ) -> tuple[float | None, tuple[float, float] | None, float | None]:
    """(value, range, predicted break-even) of ``recommendation.json``'s threshold, where
    numeric."""
    item = ((rec or {}).get("recommendations") or {}).get("kv_recompute_threshold") or {}
    value = item.get("value")
    rng = item.get("range")
    be = (item.get("evidence") or {}).get("break_even_tokens")

    def num(v: object) -> float | None:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    r = (num(rng[0]), num(rng[1])) if isinstance(rng, (list, tuple)) and len(rng) == 2 else None
    return num(value), (r if r is not None and None not in r else None), num(be)


def analyze(pts: Sequence[CrossoverPoint], rec: Mapping[str, Any] | None = None, *,
            seed: int = 0) -> CrossoverResult:
    """The measured crossover of ``pts`` and how it sits against ``rec``'s threshold (pure)."""
    on: dict[int, list[float]] = {}
    off: dict[int, list[float]] = {}
    for p in pts:
        (on if p.reuse == "on" else off).setdefault(p.history_tokens, []).append(p.ttft_ms)
    est = stats.crossover(on, off, seed=seed)
    value, rng, be = recommended_threshold(rec)
    inside = None
    if rng is not None:
        if est.tokens is not None:
            inside = rng[0] <= est.tokens <= rng[1]
        elif est.side == "reuse_always_faster":
            inside = rng[0] <= est.lengths_tokens[0]
        elif est.side == "recompute_always_faster":
            inside = rng[1] >= est.lengths_tokens[-1]
    return CrossoverResult(tuple(pts), est, value, rng, be, inside)


def run_crossover(spec: CrossoverSpec, backend: Backend, workdir: Path, *,
                  recommendation: Mapping[str, Any] | None = None,
                  progress: bool = True) -> tuple[CrossoverResult, tuple[ConfigResult, ...]]:
    """Run the sweep under both configurations and analyse it."""
    from kvtune.verify.measure import measure_config

    conv = plans(spec)
    on_cfg, off_cfg = spec.configs()
    results = tuple(measure_config(c, backend, conv, workdir / f"crossover-{c.name}",
                                   max_concurrency=1, progress=progress)
                    for c in (on_cfg, off_cfg))
    return analyze(points(*results), recommendation, seed=spec.seed), results
