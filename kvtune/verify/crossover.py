"""The measured recompute/pull crossover: turn-2 TTFT over history lengths with reuse on (the
router offers the history back and ``kv_recompute_threshold`` is 1: every history is pulled back
from the decode) and off (the router offers nothing: the prefill recomputes the history).

Each swept conversation has two turns. Turn 1 sends a short prompt (under one 128-token block,
so the prefill's own prefix cache keeps none of it) and asks for ``history - prompt`` output
tokens; turn 2 sends that history plus a short follow-up. The history the prefill can pull back
is then the whole turn-1 prompt and output, and turn 2's TTFT is recompute vs pull of that many
tokens.

Both arms run on one deployment (bidirectional, threshold 1), paired: every (length, repeat)
has a reuse-on and a reuse-off conversation, sent back to back in a random order, one
conversation at a time, the pairs shuffled (so neither drift nor the deployment's start follows
the arm or the length). The off arm's turns each go to the router as a conversation of their own
(``ConversationPlan.link_turns`` False), so the router has no history to offer. An earlier
design ran the arms on two deployments (threshold 1 vs never): each start of the pair carries
its own offset of a few milliseconds, larger than the short histories' difference, and the
sweep then measured that offset.
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
REUSE_ARMS: Final = ("on", "off")


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

    def config(self) -> VerifyConfig:
        """The one deployment both arms run on."""
        return VerifyConfig("crossover", "bidirectional", REUSE_ON_THRESHOLD_TOKENS, self.ttl_s,
                            source="crossover sweep: reuse-on conversations pull every history "
                                   "back; reuse-off conversations are offered none")


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
    """The sweep's conversations (deterministic): per (length, repeat) a reuse-on and a
    reuse-off conversation, adjacent, in a random order; the pairs shuffled."""
    rng = random.Random(spec.seed)

    def tokens(k: int) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_PLAIN_TOKEN_ID, VOCAB_SIZE) for _ in range(k))

    order = [(h, r) for r in range(spec.repeats) for h in spec.lengths_tokens]
    rng.shuffle(order)
    out = []
    for h, r in order:
        arms = list(REUSE_ARMS)
        rng.shuffle(arms)
        for arm in arms:
            out.append(ConversationPlan(
                conversation_id=f"{ID_PREFIX}-{h}-{r}-{arm}", start_s=0.0, system_tokens=(),
                turns=(TurnPlan(1, tokens(spec.prompt_tokens), h - spec.prompt_tokens, 0.0),
                       TurnPlan(2, tokens(spec.follow_up_tokens), 1, spec.think_time_s)),
                link_turns=arm == "on"))
    return out


def history_of(conversation_id: str) -> tuple[int, str] | None:
    """(history tokens, arm) of a sweep conversation's id, else None."""
    parts = conversation_id.split("-")
    if (len(parts) == 4 and parts[0] == ID_PREFIX and parts[1].isdigit()
            and parts[3] in REUSE_ARMS):
        return int(parts[1]), parts[3]
    return None


def points(result: ConfigResult) -> tuple[CrossoverPoint, ...]:
    """Turn 2 of every sweep conversation that succeeded, with the history the router offered."""
    out = []
    for r in result.requests:
        ha = history_of(r.conversation_id)
        if r.turn == 2 and r.ok and r.ttft_ms is not None and ha is not None:
            out.append(CrossoverPoint(ha[0], ha[1], float(r.ttft_ms), r.offered_tokens))
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
        if p.reuse == "on" and p.offered_tokens == 0:
            continue  # the router had nothing to offer (expired, or its store failed): not reuse
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
                  progress: bool = True) -> tuple[CrossoverResult, ConfigResult]:
    """Run the sweep (both arms on one deployment) and analyse it."""
    from kvtune.verify.measure import measure_config

    cfg = spec.config()
    result = measure_config(cfg, backend, plans(spec), workdir / f"crossover-{cfg.name}",
                            max_concurrency=1, progress=progress)
    return analyze(points(result), recommendation, seed=spec.seed), result
