"""The simulator's inputs: hardware cost models, topology, reuse settings and the traffic to play.

Everything is a frozen dataclass with the unit in each field name. A :class:`SimConfig` is built by
hand, from a preset (:mod:`kvtune.sim.presets`) or from a measured fit
(:func:`kvtune.sim.calibrate.from_fit`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

import pandas as pd

from kvtune.errors import SimError
from kvtune.spans import PD_MODES, Mode


def sim_mode(value: Mode | str, what: str = "mode") -> Mode:
    """``value`` as one of :data:`kvtune.spans.PD_MODES` (a ``Mode`` or its string value);
    :class:`SimError` naming ``what`` otherwise."""
    try:
        mode = Mode(value)
    except ValueError:
        mode = None
    if mode not in PD_MODES:
        raise SimError(f"{what}: expected one of {[m.value for m in PD_MODES]}, got {value!r}")
    return mode

DIST_KINDS: tuple[str, ...] = ("fixed", "lognormal", "uniform", "exponential", "empirical")


@dataclass(frozen=True)
class Dist:
    """A distribution of non-negative numbers (token counts, seconds).

    ``fixed``: ``(value,)``; ``lognormal``: ``(median, sigma)``; ``uniform``: ``(lo, hi)``;
    ``exponential``: ``(mean,)``; ``empirical``: the sample values (drawn with replacement).
    """

    kind: str
    params: tuple[float, ...]

    def __post_init__(self) -> None:
        want = {"fixed": 1, "lognormal": 2, "uniform": 2, "exponential": 1}
        if self.kind not in DIST_KINDS:
            raise SimError(f"Dist.kind: expected one of {DIST_KINDS}, got {self.kind!r}")
        n = want.get(self.kind)
        if (n is not None and len(self.params) != n) or (self.kind == "empirical" and not self.params):
            raise SimError(f"Dist {self.kind!r}: expected {n or 'at least 1'} parameter(s), "
                           f"got {self.params!r}")
        if any(not math.isfinite(p) or p < 0 for p in self.params):
            raise SimError(f"Dist {self.kind!r}: expected finite non-negative parameters, got {self.params!r}")

    @classmethod
    def fixed(cls, value: float) -> Dist:
        return cls("fixed", (float(value),))

    @classmethod
    def parse(cls, text: str | float | int | Dist) -> Dist:
        """``"16000"`` (fixed), ``"lognormal:2000,0.6"``, ``"uniform:1,9"``, ``"exponential:30"``,
        ``"empirical:1,5,30"``."""
        if isinstance(text, Dist):
            return text
        if isinstance(text, (int, float)):
            return cls.fixed(text)
        kind, _, rest = str(text).partition(":")
        try:
            if not rest:
                return cls.fixed(float(kind))
            return cls(kind.strip(), tuple(float(x) for x in rest.split(",") if x.strip()))
        except ValueError as exc:
            raise SimError(f"distribution {text!r}: expected a number or KIND:P1,P2 "
                           f"with KIND in {DIST_KINDS}") from exc

    def mean(self) -> float:
        k, p = self.kind, self.params
        if k in ("fixed", "exponential"):
            return p[0]
        if k == "lognormal":
            return p[0] * math.exp(p[1] ** 2 / 2)
        if k == "uniform":
            return (p[0] + p[1]) / 2
        return float(np.mean(p))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        k, p = self.kind, self.params
        if k == "fixed":
            return np.full(n, p[0], dtype=float)
        if k == "lognormal":
            return p[0] * np.exp(p[1] * rng.standard_normal(n))
        if k == "uniform":
            return rng.uniform(p[0], p[1], n)
        if k == "exponential":
            return rng.exponential(p[0], n) if p[0] > 0 else np.zeros(n)
        return rng.choice(np.asarray(p, dtype=float), n)


@dataclass(frozen=True)
class PrefillModel:
    """Prefill compute time of ``R`` new tokens after a prefix of ``L`` tokens, one instance:
    ``base_ms + R*per_token_ms + (R*L + R^2/2)/1000 * per_token_prefix_us/1000`` (the same form as
    ``kvtune.analysis.PrefillCost``; the ``R^2/2`` is causal attention within the new tokens).
    Each instance serves its queue first-in first-out, ``parallel_requests`` at a time."""

    base_ms: float
    per_token_ms: float
    per_token_prefix_us: float = 0.0
    parallel_requests: int = 1
    """Prompts one instance computes together at the single-request speed: an engine whose one
    prompt leaves the GPUs under-used (a latency-calibrated ``per_token_ms``) gains throughput by
    batching prompts. 1 = strictly one at a time."""
    loop_per_descriptor_us: float = 0.0
    """Engine-loop work per descriptor when this prefill posts a reverse READ (bidirectional: the
    history pulled back from a decode), on top of the fabric's ``TransferModel.per_descriptor_us``:
    the same vLLM worker code builds the READ descriptors inline as a pull decode's
    (``DecodeModel.loop_per_descriptor_us``), one slot of the prefill waits for it."""

    def compute_ms(self, new_tokens: float, prefix_tokens: float = 0.0) -> float:
        attn = (new_tokens * prefix_tokens + new_tokens * new_tokens / 2.0) / 1000.0
        return self.base_ms + new_tokens * self.per_token_ms + attn * self.per_token_prefix_us / 1e3


@dataclass(frozen=True)
class DecodeModel:
    """Time of one decode step of one instance: ``step_base_ms + batch*step_per_seq_ms +
    context_tokens/1000 * step_per_kilotoken_us/1000`` (context = all tokens in the batch)."""

    step_base_ms: float
    step_per_seq_ms: float = 0.0
    step_per_kilotoken_us: float = 0.0
    kv_capacity_tokens: int = 1 << 40
    """KV tokens one decode instance holds (running requests and retained histories)."""
    loop_per_descriptor_us: float = 0.0
    """Engine-loop work per descriptor when this decode posts READs inline (pull, and the forward
    leg of bidirectional), on top of the fabric's ``TransferModel.per_descriptor_us``: vLLM's
    per-request descriptor-id computation and READ bookkeeping on the engine thread. Running
    decodes wait for all of it. The push sender thread and the prefill's reverse pulls don't pay it."""

    def step_ms(self, batch: int, context_tokens: float) -> float:
        return (self.step_base_ms + batch * self.step_per_seq_ms
                + context_tokens * self.step_per_kilotoken_us / 1e6)


@dataclass(frozen=True)
class TransferModel:
    """One KV movement: ``descriptor_setup = descriptors*per_descriptor_us`` then
    ``rdma = floor_ms + bytes*8/bandwidth`` (bandwidth in 1e9 bit/s; the initiator's link is a FIFO:
    concurrent transfers queue for its bandwidth). Bytes are per rank, as ``kv.bytes`` is."""

    floor_ms: float
    bandwidth_gbps: float
    per_descriptor_us: float = 0.0
    kv_bytes_per_token: int = 262144
    block_tokens: int = 16
    descriptors_per_block: int = 128
    """Per-block layout: K and V per layer (2 x layers) descriptors for each block."""
    notify_ms: float = 0.05
    """The transfer's end -> the decode engine acting on the arrived KV: push, the WRITE's
    completion notification reaching the decode; pull, the READ's completion polled at the
    decode's loop (the target's notification takes as long)."""

    def blocks(self, tokens: int) -> int:
        return -(-int(tokens) // self.block_tokens)

    def bytes(self, tokens: int) -> int:
        return self.blocks(tokens) * self.block_tokens * self.kv_bytes_per_token

    def descriptors(self, tokens: int) -> int:
        return self.blocks(tokens) * self.descriptors_per_block

    def setup_ms(self, tokens: int) -> float:
        return self.descriptors(tokens) * self.per_descriptor_us / 1e3

    def wire_ms(self, tokens: int) -> float:
        """Link occupancy (bytes / bandwidth), without the floor."""
        return self.bytes(tokens) * 8.0 / (self.bandwidth_gbps * 1e9) * 1e3


@dataclass(frozen=True)
class Overheads:
    """Fixed latencies outside prefill, decode and the fabric."""

    router_ms: float = 1.0
    """Router work per request (parse, pick instances)."""
    hop_ms: float = 1.0
    """One HTTP hop router <-> instance (either way)."""
    registration_base_ms: float = 1.0
    """Push: decode allocates destination blocks and sends them to the prefill: fixed part."""
    registration_per_block_us: float = 1.0
    tokenize_per_kilotoken_ms: float = 0.0
    """Each engine's API server receiving a leg: chat template, tokenisation and request
    validation of the whole prompt, per 1000 prompt tokens, before the engine stamps its
    arrival. Both legs carry the whole prompt, so both pay it."""
    handoff_per_kilotoken_ms: float = 0.0
    """Pull: what the prefill's answer -> the decode leg's arrival at its API server adds per 1000
    prompt tokens on top of the two hops (the prefill finishing a longer request, the router
    relaying a longer body)."""
    prefill_intake_ms: float = 0.0
    """The prefill's intake on an idle engine: its API server stamped the request's arrival ->
    the scheduler scheduled it (engine-core IPC, the scheduler loop picking it up). Queueing
    behind other prompts comes on top (the prefill's FIFO)."""
    decode_intake_ms: float = 0.0
    """The decode's intake on an idle engine: its API server stamped the decode leg's arrival ->
    the engine acted on it (pull: the scheduler saw it and its worker began the READ's
    descriptors; push: it allocated and registered the destination blocks)."""
    handover_ms: float = 0.0
    """Push: the prefill finished computing -> its sender began the WRITE (the request finishes
    at the engine's next step, then the connector hands its blocks over). Pull's answer leaves
    the prefill the same way: that time is inside its two hops."""

    def tokenize_ms(self, prompt_tokens: float) -> float:
        """One API server's :attr:`tokenize_per_kilotoken_ms` for a prompt, ms."""
        return prompt_tokens * self.tokenize_per_kilotoken_ms / 1e3


OVERHEAD_DELAYS: tuple[str, ...] = ("tokenize_per_kilotoken_ms", "handoff_per_kilotoken_ms",
                                    "prefill_intake_ms", "decode_intake_ms", "handover_ms")
"""The :class:`Overheads` fields that delay a request on its way (checked finite and >= 0)."""


@dataclass(frozen=True)
class ReuseSettings:
    """Bidirectional reuse and prefix caching."""

    ttl_s: float = 60.0
    """``decoder_kv_blocks_ttl``: how long a decode retains a finished conversation's KV."""
    threshold_tokens: int = 1024
    """``kv_recompute_threshold``: pull retained history of at least this many tokens, else recompute."""
    prefix_caching: bool = False
    """Prefix caching on the prefill: a conversation's history still in its cache is a local hit."""
    prefill_cache_tokens: int = 0
    """Prefix cache capacity of one prefill instance, tokens (LRU over conversations); 0: the
    decode's ``kv_capacity_tokens`` (same hardware)."""
    decode_prefix_caching: bool | None = None
    """Prefix caching on the decode (its cache holds each finished request's prompt and output:
    the next turn's forward transfer moves only the whole blocks it lacks); ``None``: as
    ``prefix_caching``. vLLM enables it per engine: the published benchmark ran the prefill
    without and the decode with it."""
    decode_local_prefix: bool = False
    """The decode uses the retained blocks it holds as a local prefix, so the forward transfer moves
    only the tokens it lacks; ``False``: the forward transfer moves the whole prompt's KV again."""


@dataclass(frozen=True)
class WorkloadSpec:
    """Synthetic traffic: conversations start as a Poisson process so that requests arrive at about
    ``qps``; each conversation has ``turns`` turns; turn ``k+1`` is sent ``think_time_s`` after turn
    ``k`` finished, with prompt = previous prompt + previous output + ``new_tokens``."""

    qps: float = 1.0
    duration_s: float = 60.0
    prompt_tokens: Dist = field(default_factory=lambda: Dist.fixed(1024))
    """First-turn prompt length."""
    output_tokens: Dist = field(default_factory=lambda: Dist.fixed(128))
    turns: Dist = field(default_factory=lambda: Dist.fixed(1))
    """Turns per conversation (rounded, at least 1)."""
    new_tokens: Dist = field(default_factory=lambda: Dist.fixed(256))
    """Tokens a later turn adds to the history (the user's new message)."""
    think_time_s: Dist = field(default_factory=lambda: Dist("exponential", (10.0,)))
    max_prompt_tokens: int = 131072
    """Context limit: a conversation ends when its next prompt would exceed it."""
    users: int = 0
    """Closed loop instead of Poisson: this many users, each starting a new conversation
    ``think_time_s`` after their previous one ended, until ``duration_s`` (``qps`` is then unused)."""
    conversations_per_user: int = 1
    """Closed loop: each user keeps this many conversations going and sends their turns round robin
    (one request at a time, the next ``think_time_s`` after the last one finished): a
    conversation's next turn waits for the user's other conversations' turns, as a benchmark client
    with several active conversations sends them."""

    def __post_init__(self) -> None:
        if not (self.qps > 0 and math.isfinite(self.qps)):
            raise SimError(f"WorkloadSpec.qps: expected a positive number, got {self.qps!r}")
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise SimError(f"WorkloadSpec.duration_s: expected a positive number, got {self.duration_s!r}")
        if int(self.conversations_per_user) < 1:
            raise SimError("WorkloadSpec.conversations_per_user: expected >= 1, got "
                           f"{self.conversations_per_user!r}")


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment and its traffic."""

    mode: Mode
    """Also accepts the mode's string value (``"push"``), stored as the :class:`Mode`."""
    prefill: PrefillModel
    decode: DecodeModel
    transfer: TransferModel
    overheads: Overheads = field(default_factory=Overheads)
    reuse: ReuseSettings = field(default_factory=ReuseSettings)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    requests: pd.DataFrame | None = field(default=None, compare=False)
    """Replay instead of ``workload``: a DataFrame with ``arrival_s, prompt_tokens, output_tokens``
    and optionally ``conversation_id, turn`` (see :func:`kvtune.sim.workload.requests_frame`)."""
    prefill_instances: int = 1
    decode_instances: int = 1
    reverse_transfer: TransferModel | None = None
    """Cost model of decode -> prefill history pulls; ``None``: same as ``transfer``."""
    seed: int = 0
    fabric: str = "sim"
    model: str = ""
    name: str = ""
    start_unix_ns: int = 1_767_225_600_000_000_000
    """Wall-clock time of simulated t=0 in the emitted spans (2026-01-01T00:00Z)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", sim_mode(self.mode, "SimConfig.mode"))
        for name in ("prefill_instances", "decode_instances"):
            if int(getattr(self, name)) < 1:
                raise SimError(f"SimConfig.{name}: expected >= 1, got {getattr(self, name)!r}")
        if self.transfer.bandwidth_gbps <= 0:
            raise SimError(f"TransferModel.bandwidth_gbps: expected > 0, got {self.transfer.bandwidth_gbps!r}")
        for name, value in (("DecodeModel.loop_per_descriptor_us", self.decode.loop_per_descriptor_us),
                            ("PrefillModel.loop_per_descriptor_us", self.prefill.loop_per_descriptor_us),
                            *((f"Overheads.{f}", getattr(self.overheads, f)) for f in OVERHEAD_DELAYS)):
            if not (value >= 0 and math.isfinite(value)):
                raise SimError(f"{name}: expected a finite number >= 0, got {value!r}")

    @property
    def topology(self) -> str:
        """``xPyD``."""
        return f"{self.prefill_instances}P{self.decode_instances}D"

    def with_(self, **changes: Any) -> SimConfig:
        """A copy with fields replaced; ``workload``/``reuse``/... accept a dict of field changes."""
        out: dict[str, Any] = {}
        for key, value in changes.items():
            cur = getattr(self, key)
            if isinstance(value, dict) and hasattr(cur, "__dataclass_fields__"):
                value = replace(cur, **value)
            out[key] = value
        return replace(self, **out)
