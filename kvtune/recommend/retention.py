"""Retention policy: vLLM's fixed ``decoder_kv_blocks_ttl`` or kvtune's renewable decode lease.

Advice on top of the TTL (it changes no value of the TTL advice, :mod:`kvtune.recommend.ttl`):
both policies are played over the traced conversations (:mod:`kvtune.sim.retention`) and compared
on reuse captured and decode block-seconds held.

The lease is chosen from the measured gaps and the recommended TTL ``T``:

- live window ``idle_s`` = the router's TTL of ``T`` (``T`` minus its margin): the lease keeps
  offering exactly the next turns the TTL would;
- ``lease_s`` = the median gap (half the next turns come before a renewal is even due), at most
  the router's margin below ``T`` and at least :data:`LEASE_MIN_S`: a conversation that neither
  comes back nor ends lapses ``lease_s`` after its last renewal, by ``T`` when ``T``'s margin is
  at least :data:`LEASE_MIN_S` (``T`` >= 84 s), so the lease then never holds more than the TTL;
- ``renew_every_s`` = ``lease_s`` / 3 (the router's default), which stays under the router's bound
  ``min(lease_s, T) - MIN_ROUTER_MARGIN_S``;
- the decode's first hold is ``T`` (the exported ``decoder_kv_blocks_ttl``).

The lease is recommended (in bidirectional mode) when it captures at least the TTL's reuse and holds
at most ``1 - LEASE_MIN_GAIN_SHARE`` of its block-seconds; it gains only where conversations end
explicitly (a fixed TTL holds ended conversations' blocks for ``T`` all the same).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtune import spans as sc
from kvtune.analysis.conversations import Conversation, ended_share
from kvtune.sim.retention import FixedTtl, Lease, PolicyResult, play, sweep_ttl
from kvtune.vllm_pd import MIN_ROUTER_MARGIN_S, router_margin_s, router_ttl_s

LEASE_MIN_S = 3 * MIN_ROUTER_MARGIN_S + 3.0
"""Shortest lease (21 s): a renewal every third of it still lands more than the router's margin
before the deadline it extends."""
RENEWALS_PER_LEASE = 3
"""``renew_every_s = lease_s / 3``, the router's default."""
LEASE_MIN_GAIN_SHARE = 0.1
"""The lease is worth its renewals only when it saves at least 10% of the block-seconds."""
CAPTURE_TOLERANCE = 1e-9
SWEEP_TTLS_S: tuple[float, ...] = (30.0, 60.0, 120.0, 240.0, 480.0, 900.0, 1800.0)
"""Fixed TTLs swept beside the recommended one (vLLM's default 480 s among them)."""
POLICY_FIXED_TTL = "fixed_ttl"
POLICY_LEASE = "lease"


@dataclass(frozen=True)
class RetentionAdvice:
    """The comparison written under ``retention`` in ``recommendation.json``."""

    policy: str
    """:data:`POLICY_LEASE` or :data:`POLICY_FIXED_TTL`."""
    lease_s: float | None
    renew_every_s: float | None
    idle_s: float | None
    ttl_s: float
    block_s: dict[str, float]
    """Decode block-seconds held per policy (``fixed_ttl``, ``lease``)."""
    captured_share: dict[str, float | None]
    """Reuse captured per policy (share of reusable history tokens; None: nothing reusable)."""
    sweep: tuple[dict, ...]
    """Fixed TTLs swept: ``{"ttl_s", "captured_share", "block_s"}`` each."""
    evidence: dict

    def as_dict(self) -> dict:
        return {"policy": self.policy, "lease_s": self.lease_s,
                "renew_every_s": self.renew_every_s, "idle_s": self.idle_s, "ttl_s": self.ttl_s,
                "block_s": dict(self.block_s), "captured_share": dict(self.captured_share),
                "sweep": [dict(s) for s in self.sweep], "evidence": dict(self.evidence)}

    @classmethod
    def from_dict(cls, d: dict) -> RetentionAdvice:
        return cls(d["policy"], d["lease_s"], d["renew_every_s"], d["idle_s"], d["ttl_s"],
                   dict(d["block_s"]), dict(d["captured_share"]),
                   tuple(dict(s) for s in d["sweep"]), dict(d["evidence"]))

    @property
    def lease_recommended(self) -> bool:
        return self.policy == POLICY_LEASE


def _share(r: PolicyResult) -> float | None:
    return None if math.isnan(r.captured_share) else r.captured_share


def choose_lease(convs: Sequence[Conversation], ttl_s: float) -> Lease:
    """The lease for these conversations beside a fixed TTL of ``ttl_s`` (see the module doc).
    ``ttl_s`` must leave room for one renewal: at least :data:`LEASE_MIN_S`."""
    gaps = np.asarray([g for c in convs for g in c.gaps_s], dtype=float)
    median = float(np.median(gaps)) if len(gaps) else LEASE_MIN_S
    lease = max(min(median, router_margin_s(ttl_s)), LEASE_MIN_S)
    return Lease(lease_s=lease, renew_every_s=lease / RENEWALS_PER_LEASE,
                 idle_s=router_ttl_s(ttl_s), first_hold_s=float(ttl_s))


def compare(convs: Sequence[Conversation], *, ttl_s: float, mode: str, threshold_tokens: float,
            block_tokens: int, sweep_ttls_s: Sequence[float] = SWEEP_TTLS_S) -> RetentionAdvice:
    """Fixed TTL ``ttl_s`` (the TTL advice's) against the lease chosen from ``convs``'s gaps.
    Raises ValueError when there is nothing to compare (no conversation, or a TTL too short to
    renew under)."""
    if not convs:
        raise ValueError("no conversation in the trace")
    if ttl_s < LEASE_MIN_S:
        raise ValueError(f"the TTL ({ttl_s:g} s) is shorter than the shortest lease "
                         f"({LEASE_MIN_S:g} s): nothing to renew")
    kw = {"threshold_tokens": threshold_tokens, "block_tokens": block_tokens}
    fixed = play(convs, FixedTtl(ttl_s), **kw)
    lease = choose_lease(convs, ttl_s)
    leased = play(convs, lease, **kw)
    swept = sweep_ttl(convs, sorted(set(sweep_ttls_s) | {float(ttl_s)}), **kw)
    captures = fixed.captured_tokens <= leased.captured_tokens + CAPTURE_TOLERANCE
    saves = leased.block_s <= (1 - LEASE_MIN_GAIN_SHARE) * fixed.block_s
    bidi = mode == sc.Mode.BIDIRECTIONAL.value
    policy = POLICY_LEASE if (bidi and captures and saves) else POLICY_FIXED_TTL
    gaps = [g for c in convs for g in c.gaps_s]
    if not bidi:
        why = f"{mode} mode retains nothing for a next turn: no lease to hold"
    elif not captures:
        why = "the lease would capture less reuse than the fixed TTL"
    elif leased.block_s > fixed.block_s:
        why = (f"the lease would hold more block-seconds: without an explicit end its blocks "
               f"lapse {lease.lapse_s:.3g} s after a turn, past the TTL's {ttl_s:g} s")
    elif not saves:
        why = (f"the lease saves under {LEASE_MIN_GAIN_SHARE:.0%} of the block-seconds (few "
               f"conversations end explicitly)")
    else:
        why = (f"the lease captures the fixed TTL's reuse with "
               f"{leased.block_s / fixed.block_s:.0%} of its block-seconds (ended conversations "
               f"release at once)" if fixed.block_s > 0 else "the lease holds nothing")
    return RetentionAdvice(
        policy=policy,
        lease_s=lease.lease_s if policy == POLICY_LEASE else None,
        renew_every_s=lease.renew_every_s if policy == POLICY_LEASE else None,
        idle_s=lease.idle_s if policy == POLICY_LEASE else None,
        ttl_s=float(ttl_s),
        block_s={POLICY_FIXED_TTL: fixed.block_s, POLICY_LEASE: leased.block_s},
        captured_share={POLICY_FIXED_TTL: _share(fixed), POLICY_LEASE: _share(leased)},
        sweep=tuple({"ttl_s": t, "captured_share": _share(r), "block_s": r.block_s}
                    for t, r in swept),
        evidence={"why": why, "n_conversations": len(convs),
                  "ended_share": ended_share(list(convs)),
                  "n_gaps": len(gaps), "gap_s_p50": float(np.median(gaps)) if gaps else None,
                  "lease_modelled": {"lease_s": lease.lease_s,
                                     "renew_every_s": lease.renew_every_s,
                                     "idle_s": lease.idle_s, "first_hold_s": lease.first_hold_s},
                  "threshold_tokens": threshold_tokens if math.isfinite(threshold_tokens)
                  else None, "block_tokens": block_tokens,
                  "model": "kvtune.sim.retention (fixed TTL vs renewable lease over the traced "
                           "conversations)"})
