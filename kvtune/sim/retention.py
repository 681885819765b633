"""Decode retention policies played over conversations: vLLM's fixed TTL and kvtune's renewable
lease (:mod:`kvtune.router.lease`), each giving reuse captured and decode block-seconds held.

After each turn the decode holds the turn's history (``ceil(tokens / block_tokens)`` blocks):

- **fixed TTL** ``T``: until the next turn, or ``T`` after the turn if sooner; after the last turn
  the full ``T`` (an explicit end does not shorten vLLM's deadline). The next turn reuses the
  history when it comes within the router's TTL (``T`` minus its margin,
  :func:`kvtune.vllm_pd.router_ttl_s`).
- **lease** (``lease_s`` L, ``renew_every_s`` r, ``idle_s`` I, ``first_hold_s`` D): the decode first
  holds for D (its own ``decoder_kv_blocks_ttl``); while the conversation is live (within I of
  its last turn) the router renews every r for L (a renewal never shortens the deadline), so
  without a next turn or an end the blocks lapse at ``max(D, floor(I / r) * r + L)``; an explicit
  end releases them at once. The next turn reuses the history when it comes within I (renewed
  until then; past I the router forgot the params).

Reuse counts only histories of at least ``threshold_tokens`` (shorter ones are recomputed anyway);
``captured_share`` is the reused share of those tokens. Pure functions: no clock, no I/O.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtune.analysis.conversations import Conversation
from kvtune.vllm_pd import router_ttl_s

DEFAULT_BLOCK_TOKENS = 16
"""vLLM's default KV block size (tokens per block) when the trace does not say."""


@dataclass(frozen=True)
class FixedTtl:
    """vLLM's fixed ``decoder_kv_blocks_ttl``."""

    ttl_s: float

    @property
    def name(self) -> str:
        return "fixed_ttl"


@dataclass(frozen=True)
class Lease:
    """kvtune's renewable decode lease (router ``lease_s`` / ``lease_renew_every_s`` /
    ``lease_idle_s``; ``first_hold_s``: the decode's ``decoder_kv_blocks_ttl``)."""

    lease_s: float
    renew_every_s: float
    idle_s: float
    first_hold_s: float

    @property
    def name(self) -> str:
        return "lease"

    @property
    def lapse_s(self) -> float:
        """Seconds after a turn at which unrenewed blocks go (no next turn, no end)."""
        last_renewal = math.floor(self.idle_s / self.renew_every_s) * self.renew_every_s
        return max(self.first_hold_s, last_renewal + self.lease_s)


Policy = FixedTtl | Lease


@dataclass(frozen=True)
class PolicyResult:
    """One policy played over a set of conversations."""

    policy: str
    captured_share: float
    """Reused share of the reusable history tokens (NaN when no history is reusable)."""
    block_s: float
    """Decode block-seconds held by retained history, all conversations together."""
    reusable_tokens: int
    captured_tokens: int
    n_conversations: int
    n_released_at_end: int
    """Conversations whose last hold an explicit end cut short."""

    def as_dict(self) -> dict[str, float | int | str | None]:
        return {"policy": self.policy,
                "captured_share": None if math.isnan(self.captured_share) else self.captured_share,
                "block_s": self.block_s, "reusable_tokens": self.reusable_tokens,
                "captured_tokens": self.captured_tokens, "n_conversations": self.n_conversations,
                "n_released_at_end": self.n_released_at_end}


def _blocks(tokens: int, block_tokens: int) -> int:
    return -(-max(0, int(tokens)) // block_tokens)


def _reused(policy: Policy, gap_s: float) -> bool:
    if isinstance(policy, FixedTtl):
        return gap_s <= router_ttl_s(policy.ttl_s)
    return gap_s <= policy.idle_s


def _hold_s(policy: Policy, gap_s: float) -> float:
    """Seconds the blocks are held across a gap of ``gap_s`` (math.inf: no next turn)."""
    if isinstance(policy, FixedTtl):
        return min(gap_s, policy.ttl_s)
    if gap_s <= policy.idle_s:
        return gap_s
    return min(gap_s, policy.lapse_s)


def play(conversations: Iterable[Conversation], policy: Policy, *, threshold_tokens: float = 0.0,
         block_tokens: int = DEFAULT_BLOCK_TOKENS) -> PolicyResult:
    """``policy`` over ``conversations`` (see the module doc)."""
    if not (isinstance(block_tokens, int) and block_tokens > 0):
        raise ValueError(f"play: block_tokens: expected a positive int, got {block_tokens!r}")
    block_s = 0.0
    reusable = captured = n = released = 0
    for c in conversations:
        n += 1
        for gap, tokens in zip(c.gaps_s, c.gap_tokens):
            block_s += _blocks(tokens, block_tokens) * _hold_s(policy, gap)
            if tokens >= threshold_tokens:
                reusable += tokens
                captured += tokens if _reused(policy, gap) else 0
        last = _hold_s(policy, math.inf)
        if isinstance(policy, Lease) and c.end_after_s is not None and c.end_after_s < last:
            last = c.end_after_s
            released += 1
        block_s += _blocks(c.final_tokens, block_tokens) * last
    share = captured / reusable if reusable else math.nan
    return PolicyResult(policy.name, share, block_s, reusable, captured, n, released)


def sweep_ttl(conversations: Sequence[Conversation], ttls_s: Iterable[float], *,
              threshold_tokens: float = 0.0,
              block_tokens: int = DEFAULT_BLOCK_TOKENS) -> tuple[tuple[float, PolicyResult], ...]:
    """:func:`play` with a fixed TTL for each of ``ttls_s``."""
    return tuple((float(t), play(conversations, FixedTtl(float(t)),
                                 threshold_tokens=threshold_tokens, block_tokens=block_tokens))
                 for t in ttls_s)
