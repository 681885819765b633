"""The lab's regimes: where the local pair's prefill stands against the conversations it serves.

- **fleet** (``kvtune tune``'s embedded default): a conversation's next turn reaches a prefill that
  lacks its history, as in a fleet where the turn lands on another prefill or on one whose prefix
  cache evicted it under load. Here: the prefill's KV cache (prefix caching on, as users run it)
  holds :attr:`LabRegime.prefill_kv_blocks` blocks, a fraction of the histories of the
  conversations in flight, and the conversations take turns one request at a time (every
  conversation's turn 1, then every turn 2, ...), so between two turns of one conversation the
  others' prompts pass through the prefill and evict it. Recomputing a 2.7k-token agent history
  then costs the prefill far more than pulling it back from the decode over the shaped link: the
  regime in which ``kv_recompute_threshold`` and bidirectional reuse change TTFT.
- **warm** (the lab before): one prefill whose cache (256 blocks) holds every history of the
  traffic, conversations two at a time with think-time gaps. The prefill's own prefix cache
  serves the later turns, every mode ties, and kvtune should recommend vLLM's defaults.

A regime fixes the engines' KV cache sizes and the shape of the traffic kvtune drives through the
pair (``kvtune tune``) and replays (``kvtune verify``); :func:`regime` takes a name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvtune.errors import ConfigError

BLOCK_TOKENS: Final = 128
"""KV block size of vLLM's CPU backend (tokens)."""
RESERVED_BLOCKS: Final = 1
"""Blocks of ``--num-gpu-blocks-override`` vLLM keeps for itself (its null block): a cache of N
blocks serves requests of at most (N - 1) x 128 tokens."""


@dataclass(frozen=True)
class LabRegime:
    """One regime of the lab: engines' KV caches and the traffic's shape."""

    name: str
    why: str
    """One sentence for the report: what the regime reproduces."""
    prefill_kv_blocks: int
    """The prefill's ``--num-gpu-blocks-override``."""
    decode_kv_blocks: int
    """The decode's ``--num-gpu-blocks-override`` (it retains every live history in
    bidirectional mode)."""
    max_model_len: int
    """Both engines' ``--max-model-len`` (vLLM requires the KV cache to hold one such request)."""
    first_prompt_tokens: tuple[int, ...]
    """First-turn prompt lengths, cycled over the conversations."""
    conversations: int
    """Conversations of ``kvtune tune``'s own traffic per run."""
    verify_conversations: int
    """Conversations ``kvtune verify --tune-dir`` replays per configuration start."""
    turns: int
    new_tokens_per_turn: int
    max_tokens: int
    think_time_s: tuple[float, float]
    """Uniform gap before each later turn (seconds); unused when :attr:`turn_major`."""
    parallel_conversations: int
    """Conversations in flight at a time (``max_concurrency`` of the driver)."""
    turn_major: bool
    """Send one request at a time, every conversation's turn k before any turn k+1 (the
    conversations' own order), instead of each conversation on its own clock."""

    def __post_init__(self) -> None:
        for role, blocks in (("prefill", self.prefill_kv_blocks),
                             ("decode", self.decode_kv_blocks)):
            if (blocks - RESERVED_BLOCKS) * BLOCK_TOKENS < self.max_model_len:
                raise ConfigError(f"regime {self.name}: ({role}_kv_blocks - {RESERVED_BLOCKS}) x "
                                  f"{BLOCK_TOKENS} tokens expected >= max_model_len "
                                  f"{self.max_model_len} (vLLM refuses to start otherwise)")
        longest = max(self.first_prompt_tokens) + (self.turns - 1) * (
            self.new_tokens_per_turn + self.max_tokens) + self.max_tokens
        if longest > self.max_model_len:
            raise ConfigError(f"regime {self.name}: the longest conversation reaches {longest} "
                              f"tokens, over max_model_len {self.max_model_len}")

    @property
    def longest_history_tokens(self) -> int:
        """History of the longest conversation's last turn (prompt and outputs before it)."""
        return (max(self.first_prompt_tokens)
                + (self.turns - 1) * (self.new_tokens_per_turn + self.max_tokens)
                - self.new_tokens_per_turn)

    def working_set_blocks(self, conversations: int | None = None) -> int:
        """KV blocks the histories of ``conversations`` (default :attr:`conversations`) hold at
        their last turn: what a prefill would need to keep them all."""
        n = self.conversations if conversations is None else conversations
        grow = (self.turns - 1) * (self.new_tokens_per_turn + self.max_tokens)
        return sum(-(-(self.first_prompt_tokens[i % len(self.first_prompt_tokens)] + grow)
                     // BLOCK_TOKENS) for i in range(n))


def log_spaced(lo: int, hi: int, n: int) -> tuple[int, ...]:
    """``n`` integers from ``lo`` to ``hi``, evenly spaced in log, interleaved so that short and
    long ones alternate (each run of the list covers the range: a prefix of the conversations has
    the same spread as all of them)."""
    vals = [round(lo * (hi / lo) ** (i / (n - 1))) for i in range(n)] if n > 1 else [hi]
    order = sorted(range(n), key=lambda i: (int(f"{i:08b}"[::-1], 2), i)) if n > 1 else [0]
    return tuple(vals[i] for i in order)


FLEET_CONVERSATIONS: Final = 32
"""Conversations of the fleet regime's traffic, in ``kvtune tune`` and per verification start.
Why not 16 (until 2026-12-05): a configuration's p50 over one start's 64 requests carried a
sampling error of about 6.5% (the paired change's bootstrap within one start of examples/fleet as
recorded then),
which left the verification's smallest detectable effect at 8-13% after three starts and a mode's
prediction from tune's one 64-request segment up to 12% off its measurement; 128 requests a
start cost about 7 s more per start."""
FLEET_FIRST_PROMPT_TOKENS: Final = (512, 2560)
"""Shortest and longest first prompts of the fleet regime (tokens), agent-like histories. Why not
shorter: on this 2-core machine a prefill recomputes a history of under 500 tokens in about the
time a pull of it takes over the 1 Gbit/s link (later turns 24 ms either way, measured with first
prompts from 64 tokens: half of the traffic then sat where the modes tie), while a 2000-token
history costs 137 ms recomputed against 45 ms pulled back. The longest must leave room for the
conversation's growth within ``max_model_len``."""
FLEET: Final = LabRegime(
    name="fleet",
    why=("later turns reach a prefill that lacks the history (its prefix cache, 25 blocks, holds "
         "a fraction of the conversations in flight, which take turns), as when a fleet's router "
         "sends a turn to another prefill or one that evicted it under load"),
    prefill_kv_blocks=25, decode_kv_blocks=1024, max_model_len=3072,
    first_prompt_tokens=log_spaced(*FLEET_FIRST_PROMPT_TOKENS, FLEET_CONVERSATIONS),
    conversations=FLEET_CONVERSATIONS, verify_conversations=FLEET_CONVERSATIONS,
    turns=4, new_tokens_per_turn=48, max_tokens=8, think_time_s=(0.0, 0.0),
    parallel_conversations=1, turn_major=True)
"""32 conversations whose first prompts spread evenly in log from 512 to 2560 tokens (the same
sizes in ``kvtune tune`` and ``kvtune verify``, other token ids: the two see the same TTFT
distribution, so a measured p50 predicts the other's), taking turns one request at a time. Their
histories hold about 15x the prefill's 25 blocks (379); the decode (1024 blocks) keeps every
one."""
WARM: Final = LabRegime(
    name="warm",
    why=("one prefill whose prefix cache (256 blocks) keeps every conversation's history: later "
         "turns find it there, so there is little for bidirectional reuse to save"),
    prefill_kv_blocks=256, decode_kv_blocks=256, max_model_len=4096,
    first_prompt_tokens=(64, 512, 2560), conversations=6, verify_conversations=12, turns=4,
    new_tokens_per_turn=48, max_tokens=8, think_time_s=(0.5, 3.0), parallel_conversations=2,
    turn_major=False)
REGIMES: Final = {r.name: r for r in (FLEET, WARM)}
DEFAULT_REGIME: Final = FLEET
"""What ``kvtune tune`` measures without ``--traces`` (and ``make tune``)."""


def regime(name: str | LabRegime) -> LabRegime:
    """The regime called ``name`` (a :class:`LabRegime` is returned as it is)."""
    if isinstance(name, LabRegime):
        return name
    try:
        return REGIMES[name]
    except KeyError:
        raise ConfigError(f"lab regime: expected one of {sorted(REGIMES)}, got {name!r}") from None
