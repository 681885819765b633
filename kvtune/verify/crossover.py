"""The measured recompute/pull crossover: turn-2 TTFT over history lengths with reuse on (the
router offers the history back and ``kv_recompute_threshold`` is 1: every history is pulled back
from the decode) and off (the router offers nothing: the prefill recomputes the history).

The swept lengths come from the workload, not from the recommendation: log-spaced from one KV
block (vLLM pulls whole blocks) to the longest history the workload holds
(:func:`lengths_from_workload`), so the sweep can land anywhere, and disagree.

Each swept conversation has two turns: turn 1 sends an ``h``-token prompt (one output token),
turn 2 sends that history plus a short follow-up. The prefill must lack the history at turn 2,
as in a fleet: the sweep runs in batches (one per repeat, every length in both arms, in a random
order), each batch turn by turn (every turn 1, then every turn 2, in the same order), on a
prefill whose prefix cache holds a fraction of a batch's traffic (the lab's fleet regime,
:mod:`kvtune.local.regime`), so that between a conversation's two turns the others evict it;
a batch with too little traffic for that gets filler conversations. Whether the prefill really
lacked the history is measured, not assumed: a reuse-off turn 2 whose prefill served a whole
block of it from its own cache is left out and counted (``CrossoverResult.local_hits``).

Both arms run on one deployment (bidirectional, threshold 1), paired: every (length, repeat) has
a reuse-on and a reuse-off conversation in the same batch (so neither drift nor the deployment's
start follows the arm or the length). The off arm's turns each go to the router as a
conversation of their own (``ConversationPlan.link_turns`` False), so the router has no history
to offer. Repeats are added, batch by batch, for the lengths whose difference is not yet resolved
(:data:`RESOLVED_MS`), up to :data:`MAX_REPEATS`.
"""
from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from kvtune.errors import ConfigError
from kvtune.local.regime import BLOCK_TOKENS, FLEET, LabRegime
from kvtune.local.tiny_model import VOCAB_SIZE
from kvtune.local.workload import (FIRST_PLAIN_TOKEN_ID, ConversationPlan, RequestResult,
                                   TurnPlan)
from kvtune.verify import stats
from kvtune.verify.backends import Backend
from kvtune.verify.configs import VerifyConfig, effective_settings
from kvtune.verify.results import ConfigResult, CrossoverPoint, CrossoverResult

if TYPE_CHECKING:
    from kvtune.verify.measure import Phase

REUSE_ON_THRESHOLD_TOKENS: Final = 1
SWEEP_REGIME: Final = FLEET
"""The engines the sweep runs on (a local pair): a prefill cache a batch's traffic evicts."""
MIN_HISTORY_TOKENS: Final = BLOCK_TOKENS
"""The shortest swept history: one KV block (vLLM pulls whole blocks; a shorter history has
nothing to pull)."""
FOLLOW_UP_TOKENS: Final = 8
MAX_HISTORY_TOKENS: Final = SWEEP_REGIME.max_model_len - FOLLOW_UP_TOKENS - 2
"""Longest swept history: what the sweep's engines hold with room for the follow-up."""
N_LENGTHS: Final = 7
REPEATS: Final = 6
"""Paired repeats every length gets."""
MAX_REPEATS: Final = 14
"""Repeats a length may get while its difference is not resolved."""
RESOLVED_MS: Final = 4.0
"""A length's difference (reuse on minus off, medians) is resolved when its 95% interval is at
most this wide each side, or excludes zero (the two arms told apart)."""
SWEEP_TTL_S: Final = 30.0
"""``decoder_kv_blocks_ttl`` of the sweep's own deployment: a batch's turn 2 comes a few seconds
after its turn 1 (the router offers a history for the TTL less its margin), and the decode
retains every turn's blocks for the TTL (a long one would fill it)."""
EVICT_FACTOR: Final = 2.0
"""A batch carries at least this many times the prefill's cache in turn-1 prompts (fillers
added), so that every conversation's history is evicted before its turn 2."""
ID_PREFIX: Final = "xo"
FILLER_PREFIX: Final = "xofill"
REUSE_ARMS: Final = ("on", "off")


@dataclass(frozen=True)
class CrossoverSpec:
    lengths_tokens: tuple[int, ...]
    """History lengths to sweep (turn 1's prompt + its output token), tokens."""
    repeats: int = REPEATS
    """Paired conversations per length and arm, before any added for resolution."""
    max_repeats: int = MAX_REPEATS
    follow_up_tokens: int = FOLLOW_UP_TOKENS
    ttl_s: float | None = SWEEP_TTL_S
    """``decoder_kv_blocks_ttl`` of the sweep's deployment (None: vLLM's default)."""
    prefill_cache_tokens: int = (SWEEP_REGIME.prefill_kv_blocks - 1) * BLOCK_TOKENS
    """What the sweep's prefill caches: each batch carries :data:`EVICT_FACTOR` times it."""
    seed: int = 0

    def __post_init__(self) -> None:
        if len(set(self.lengths_tokens)) < 2:
            raise ConfigError(f"crossover: lengths_tokens expected at least 2 distinct lengths, "
                              f"got {self.lengths_tokens}")
        bad = [n for n in self.lengths_tokens if not isinstance(n, int) or isinstance(n, bool)
               or not MIN_HISTORY_TOKENS <= n <= MAX_HISTORY_TOKENS]
        if bad:
            raise ConfigError(f"crossover: lengths_tokens expected integers in "
                              f"[{MIN_HISTORY_TOKENS}, {MAX_HISTORY_TOKENS}], got {bad}")
        if self.repeats < 2 or self.max_repeats < self.repeats:
            raise ConfigError(f"crossover: repeats expected >= 2 and <= max_repeats, got "
                              f"{self.repeats} and {self.max_repeats}")
        if self.follow_up_tokens < 1:
            raise ConfigError("crossover: follow_up_tokens expected >= 1")

    def config(self) -> VerifyConfig:
        """The one deployment both arms run on."""
        return VerifyConfig("crossover", "bidirectional", REUSE_ON_THRESHOLD_TOKENS, self.ttl_s,
                            source="crossover sweep: reuse-on conversations pull every history "
                                   "back; reuse-off conversations are offered none")


def lengths_from_workload(longest_history_tokens: int, *, n: int = N_LENGTHS) -> tuple[int, ...]:
    """``n`` history lengths log-spaced from one block to ``longest_history_tokens`` (clipped to
    what the sweep's engines hold): where the workload's histories are, whatever was predicted."""
    if n < 2:
        raise ConfigError(f"crossover: n expected >= 2, got {n}")
    hi = min(MAX_HISTORY_TOKENS, max(int(longest_history_tokens), 2 * MIN_HISTORY_TOKENS))
    lo = MIN_HISTORY_TOKENS
    return tuple(sorted({int(round(math.exp(math.log(lo) + (math.log(hi) - math.log(lo))
                                            * i / (n - 1)))) for i in range(n)}))


def longest_history(plans: Sequence[ConversationPlan]) -> int:
    """The longest history a turn of ``plans`` carries (system prompt, earlier user turns and
    their outputs), tokens."""
    best = 0
    for p in plans:
        h = len(p.system_tokens)
        for tp in p.turns[:-1]:
            h += len(tp.user_tokens) + tp.max_tokens
        best = max(best, h)
    return best


def lengths_for(plans: Sequence[ConversationPlan] | None = None,
                regime: LabRegime | None = None) -> tuple[int, ...]:
    """The sweep's default lengths: from ``plans``' longest history, else ``regime``'s."""
    longest = longest_history(plans) if plans else 0
    if longest < 2 * MIN_HISTORY_TOKENS and regime is not None:
        longest = regime.longest_history_tokens
    return lengths_from_workload(longest or MAX_HISTORY_TOKENS)


def batch_plans(spec: CrossoverSpec, lengths: Sequence[int], repeat: int, batch: int,
                rng: random.Random) -> list[ConversationPlan]:
    """One batch: a reuse-on and a reuse-off conversation per length (repeat ``repeat``), in a
    random order, then fillers (one-turn conversations of the longest length) until the batch's
    turn-1 prompts reach :data:`EVICT_FACTOR` x the prefill's cache."""
    def tokens(k: int) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_PLAIN_TOKEN_ID, VOCAB_SIZE) for _ in range(k))

    order = [(h, arm) for h in lengths for arm in REUSE_ARMS]
    rng.shuffle(order)
    out = [ConversationPlan(
        conversation_id=f"{ID_PREFIX}-{h}-{repeat}-{arm}", start_s=0.0, system_tokens=(),
        turns=(TurnPlan(1, tokens(h - 1), 1, 0.0),
               TurnPlan(2, tokens(spec.follow_up_tokens), 1, 0.0)),
        link_turns=arm == "on", batch=batch) for h, arm in order]
    carried, k = sum(lengths) * len(REUSE_ARMS), 0
    while carried < EVICT_FACTOR * spec.prefill_cache_tokens:
        n = MAX_HISTORY_TOKENS - 1
        out.append(ConversationPlan(f"{FILLER_PREFIX}-{batch}-{k}", 0.0, (),
                                    (TurnPlan(1, tokens(n), 1, 0.0),), link_turns=False,
                                    batch=batch))
        carried, k = carried + n, k + 1
    return out


def first_batches(spec: CrossoverSpec, rng: random.Random) -> list[ConversationPlan]:
    """The sweep's first :attr:`CrossoverSpec.repeats` repeats, each in two batches (every
    other length), so that a batch's turn 2 comes soon after its turn 1."""
    halves = (spec.lengths_tokens[::2], spec.lengths_tokens[1::2])
    return [p for r in range(spec.repeats) for i, half in enumerate(halves)
            for p in batch_plans(spec, half, r, 2 * r + i, rng)]


def plans(spec: CrossoverSpec) -> list[ConversationPlan]:
    """The sweep's first batches (deterministic)."""
    return first_batches(spec, random.Random(spec.seed))


def history_of(conversation_id: str) -> tuple[int, str] | None:
    """(history tokens, arm) of a sweep conversation's id, else None (fillers included)."""
    parts = conversation_id.split("-")
    if (len(parts) == 4 and parts[0] == ID_PREFIX and parts[1].isdigit()
            and parts[3] in REUSE_ARMS):
        return int(parts[1]), parts[3]
    return None


def points(result: ConfigResult) -> tuple[CrossoverPoint, ...]:
    """Turn 2 of every sweep conversation that succeeded, with the history the router offered
    and what the prefill's own cache held of it."""
    out = []
    for r in result.requests:
        ha = history_of(r.conversation_id)
        if r.turn == 2 and r.ok and r.ttft_ms is not None and ha is not None:
            out.append(CrossoverPoint(ha[0], ha[1], float(r.ttft_ms), r.offered_tokens,
                                      r.prefill_cached_tokens))
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


@dataclass(frozen=True)
class _Arms:
    on: dict[int, list[float]]
    off: dict[int, list[float]]
    not_offered: int
    """Reuse-on turns the router offered no history (it had expired, or its store failed)."""
    local_hits: int
    """Reuse-off turns whose prefill served a block or more of the history from its own cache
    (it did not lack it)."""


def _arms(pts: Sequence[CrossoverPoint]) -> _Arms:
    """TTFTs per length and arm, leaving out the turns that measure neither pulling nor
    recomputing the whole history."""
    arms = _Arms({}, {}, 0, 0)
    not_offered = local = 0
    traced = any(p.offered_tokens is not None for p in pts)  # files before offers were traced
    for p in pts:
        if p.reuse == "on" and traced and not p.offered_tokens:
            not_offered += 1
            continue
        if p.reuse == "off" and (p.prefill_cached_tokens or 0) >= BLOCK_TOKENS:
            local += 1
            continue
        (arms.on if p.reuse == "on" else arms.off).setdefault(p.history_tokens, []).append(
            p.ttft_ms)
    return _Arms(arms.on, arms.off, not_offered, local)


def _unresolved(on: Mapping[int, Sequence[float]], off: Mapping[int, Sequence[float]], *,
                seed: int = 0) -> list[int]:
    out = []
    for h in sorted(set(on) | set(off)):
        d = stats.median_difference_ci(on.get(h, ()), off.get(h, ()), seed=seed)
        if d is None or not (d[1] > 0 or d[2] < 0 or (d[2] - d[1]) / 2 <= RESOLVED_MS):
            out.append(h)
    return out


def unresolved(pts: Sequence[CrossoverPoint], *, seed: int = 0) -> list[int]:
    """The lengths whose difference is not resolved (:data:`RESOLVED_MS`)."""
    arms = _arms(pts)
    return _unresolved(arms.on, arms.off, seed=seed)


def unresolved_so_far(results: Sequence[RequestResult], *, seed: int = 0) -> dict[int, int]:
    """While the sweep runs: the lengths not resolved on the client's latencies of turn 2 (the
    spans' TTFT is read once the deployment is down), with the repeats each has."""
    on: dict[int, list[float]] = {}
    off: dict[int, list[float]] = {}
    for r in results:
        ha = history_of(r.conversation_id)
        if r.turn == 2 and r.ok and ha is not None:
            (on if ha[1] == "on" else off).setdefault(ha[0], []).append(r.latency_ms)
    return {h: len(on.get(h, ())) for h in _unresolved(on, off, seed=seed)}


def analyze(pts: Sequence[CrossoverPoint], rec: Mapping[str, Any] | None = None, *,
            seed: int = 0, deployment: str = "") -> CrossoverResult:
    """The measured crossover of ``pts`` and how it sits against ``rec``'s threshold (pure)."""
    arms = _arms(pts)
    est = stats.crossover(arms.on, arms.off, seed=seed)
    value, rng, be = recommended_threshold(rec)
    inside = None
    if rng is not None:
        if est.tokens is not None:
            inside = rng[0] <= est.tokens <= rng[1]
        elif est.side == "reuse_always_faster":
            inside = rng[0] <= est.lengths_tokens[0]
        elif est.side == "recompute_always_faster":
            inside = rng[1] >= est.lengths_tokens[-1]
    return CrossoverResult(tuple(pts), est, value, rng, be, inside, local_hits=arms.local_hits,
                           not_offered=arms.not_offered,
                           unresolved_tokens=tuple(unresolved(pts, seed=seed)),
                           deployment=deployment)


def statement(est: stats.CrossoverEstimate) -> str:
    """The measured crossover in words: a number only where the arms crossed."""
    lo, hi = est.lengths_tokens[0], est.lengths_tokens[-1]
    if est.side == "reuse_always_faster":
        return f"reuse faster at every swept length >= {lo} tokens (no crossover above {lo})"
    if est.side == "recompute_always_faster":
        return f"recompute faster at every swept length <= {hi} tokens (no crossover below {hi})"
    if est.tokens is None:
        return (f"no break-even shape over {lo}-{hi} tokens (reuse faster on short histories, "
                f"slower on long ones)")
    ci = (f" [{est.low_tokens:.0f}, {est.high_tokens:.0f}]" if est.low_tokens is not None
          and est.high_tokens is not None else "")
    return f"crossover {est.tokens:.0f} tokens{ci} (95% interval)"


HOST_MIN_TTL_S: Final = 12.0
"""A configuration's deployment carries the sweep only with a TTL at least this long: the router
offers a history while it is younger than the TTL less its margin (``vllm_pd.router_ttl_s``), and
a batch's turn 2 comes a few seconds after its turn 1."""


def sweep_phase(spec: CrossoverSpec, host: VerifyConfig | None = None) -> Phase:
    """The sweep as one phase of a deployment (its own, or ``host``'s): the first
    :attr:`CrossoverSpec.repeats` batches, then a batch more while lengths stay unresolved."""
    from kvtune.verify.measure import Phase

    rng = random.Random(spec.seed)
    sweep = first_batches(spec, rng)
    next_batch = [2 * spec.repeats]

    def more(done: Sequence[RequestResult]) -> list[ConversationPlan]:
        todo = {h: n for h, n in unresolved_so_far(done, seed=spec.seed).items()
                if n < spec.max_repeats}
        if not todo:
            return []
        batch, next_batch[0] = next_batch[0], next_batch[0] + 1
        return batch_plans(spec, sorted(todo), max(todo.values()), batch, rng)

    label = spec.config() if host is None else VerifyConfig(
        "crossover", host.mode, host.recompute_threshold_tokens, host.ttl_s,
        source=f"crossover sweep on the deployment of {host.name!r} (threshold "
               f"{effective_settings(host)[1]} <= {min(spec.lengths_tokens)}: every swept "
               f"history offered back is pulled)")
    return Phase("crossover", sweep, config=label, max_concurrency=1, turn_major=True, more=more)


def can_host(spec: CrossoverSpec, config: VerifyConfig, backend: Backend) -> bool:
    """Whether ``config``'s deployment can carry the sweep after its replay (saving a start):
    bidirectional, pulling every swept history (threshold at most the shortest length), a TTL
    that covers a batch, and (a local pair) the sweep's engines."""
    mode, threshold, ttl = effective_settings(config)
    if mode != "bidirectional" or threshold is None or ttl is None:
        return False
    regime = getattr(backend, "regime", None)
    return (threshold <= min(spec.lengths_tokens) and ttl >= HOST_MIN_TTL_S
            and (regime is None or regime == SWEEP_REGIME.name))


def run_crossover(spec: CrossoverSpec, backend: Backend, workdir: Path, *,
                  recommendation: Mapping[str, Any] | None = None,
                  progress: bool = True) -> tuple[CrossoverResult, ConfigResult]:
    """Run the sweep on a deployment of its own (both arms, batch after batch, turn by turn;
    repeats added for unresolved lengths) and analyse it."""
    from kvtune.verify.measure import measure_deployment

    cfg = spec.config()
    (result,) = measure_deployment(cfg, _sweep_backend(backend), [sweep_phase(spec)],
                                   workdir / f"crossover-{cfg.name}", progress=progress)
    return analyze(points(result), recommendation, seed=spec.seed,
                   deployment="a deployment of its own"), result


def _sweep_backend(backend: Backend) -> Backend:
    """A local pair backend with the sweep's engines (:data:`SWEEP_REGIME`); another backend as
    it is (a cluster's prefill must evict a batch's history by itself: the local hits say)."""
    with_regime = getattr(backend, "with_regime", None)
    return with_regime(SWEEP_REGIME) if callable(with_regime) else backend


def repeats_by_length(pts: Sequence[CrossoverPoint]) -> dict[int, int]:
    """Reuse-off turns measured per length (for the page)."""
    out: dict[int, int] = {}
    for p in pts:
        if p.reuse == "off":
            out[p.history_tokens] = out.get(p.history_tokens, 0) + 1
    return dict(sorted(out.items()))


def diff_interval_ms(pts: Sequence[CrossoverPoint], *, seed: int = 0
                     ) -> dict[int, tuple[float, float, float]]:
    """Per length: (median on - median off, its 95% interval), ms."""
    arms = _arms(pts)
    out = {}
    for h in sorted(set(arms.on) & set(arms.off)):
        d = stats.median_difference_ci(arms.on[h], arms.off[h], seed=seed)
        if d is not None:
            out[h] = d
    return out

