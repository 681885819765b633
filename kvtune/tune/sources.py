"""The embedded default trace source of `kvtune tune`: spans kvtune makes on this machine, for real.

1. The fabric probe: two NIXL agents in two processes sweep KV-shaped transfers (local geometry).
2. The local vLLM prefill/decode pair on a tiny local model, bidirectional mode with kvtune's
   instrumented connectors, driven through the kvtune router (a subprocess) by a multi-turn,
   agent-like workload (conversations with growing history) in one of the lab's regimes
   (:mod:`kvtune.local.regime`: ``fleet``, the default, where later turns reach a prefill that
   lacks their history, or ``warm``, where its prefix cache keeps them all); then the same
   traffic in push and in pull, each on a fresh pair (:data:`SEGMENT_MODES`), whose requests'
   measured TTFT stands for each mode in the mode comparison.
3. When vLLM cannot run here (not installed, or the pair fails), the simulator stands in, calibrated
   with the probe's fit, and the source's kind says so (``probe+sim``).
"""
from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtune.local.fabric import FabricSpec, ShapedLink
from kvtune.local.regime import DEFAULT_REGIME, LabRegime
from kvtune.local.regime import regime as lab_regime

log = logging.getLogger(__name__)

PROBE_TOKENS = (16, 64, 256, 1024, 4096)
"""Probe sweep on the tiny model's geometry (tokens per rank): a few sizes, quick on 2 cores."""
PROBE_ITERS = 10
REQUEST_TIMEOUT_S = 240.0
RECOMPUTE_THRESHOLD = 1
"""The pair pulls any history back (threshold 1), so reverse transfers of every size are traced."""
SEGMENT_MODES = ("push", "pull")
"""After the bidirectional run, the same traffic (another seed) in each of these modes on a fresh
pair: each mode's own requests' TTFT then stands for it in the mode comparison
(``kvtune.analysis.modes``). On this host the modes differ in ways a model of two machines does
not see: push's legs run at once on the same two cores (the prefill's compute took about twice as
long in push as in pull, on the same prompts), and a bidirectional pair was measured 10-20%
slower than a pull pair even where nothing was pulled back. 12 requests a segment gave a p50
off by half in one run (push's TTFT here is bimodal); 24 do not."""
MIN_TOKEN_ID = 50
MAX_TOKEN_ID = 1950
"""Prompt token ids are drawn from [MIN, MAX) (plain tokens of the tiny model's vocabulary)."""


@dataclass(frozen=True)
class _PrefillGuess:
    per_token_ms: float
    per_token_prefix_us: float
    base_ms: float


@dataclass(frozen=True)
class _FitGuess:
    floor_ms: float
    bandwidth_gbps: float
    per_descriptor_us: float | None = None


@dataclass(frozen=True)
class DefaultSpans:
    spans_dir: Path
    kind: str
    """``vllm-pair`` (probe + real pair) or ``probe+sim`` (probe + simulator stand-in)."""
    description: str
    fabric: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    """The model the spans were made with (the tiny model's directory: what `vllm serve` took)."""
    regime: str | None = None
    """The lab regime the pair ran in (``kvtune.local.regime``); None: no pair ran."""


def make_default_spans(spans_dir: str | Path, *, seed: int = 0, use_vllm: bool = True,
                       probe_tokens: Sequence[int] = PROBE_TOKENS,
                       regime: LabRegime | str = DEFAULT_REGIME,
                       conversations: int | None = None,
                       fabric: FabricSpec = FabricSpec()) -> DefaultSpans:
    """Make the default spans in ``spans_dir`` (see module doc) and say where they came from.
    ``regime``: the lab regime (``kvtune.local.regime``: the engines' caches and the traffic's
    shape; ``conversations`` overrides its count). ``fabric``: loopback (default) or a shaped link
    (``kvtune.local.fabric``) that the probe and the pair both run across."""
    lab = lab_regime(regime)
    out = Path(spans_dir)
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        link = (stack.enter_context(ShapedLink(fabric.rate_mbit))
                if fabric.rate_mbit is not None else None)
        return _make(out, seed=seed, use_vllm=use_vllm, probe_tokens=probe_tokens, regime=lab,
                     conversations=conversations or lab.conversations, link=link,
                     fabric=fabric.name)


def _make(out: Path, *, seed: int, use_vllm: bool, probe_tokens: Sequence[int],
          regime: LabRegime, conversations: int, link: ShapedLink | None,
          fabric: str) -> DefaultSpans:
    probe = _probe(out / "probe", fabric, probe_tokens, seed, link)
    details: dict[str, Any] = {"probe_floor_ms": getattr(probe, "floor_ms", None),
                               "regime": regime.name}
    on = f" over {fabric}" if link is not None else ""
    if use_vllm:
        try:
            stats = _pair(out, seed=seed, regime=regime, conversations=conversations, link=link)
            details.update(stats)
            segments = []
            for k, mode in enumerate(SEGMENT_MODES, start=1):
                try:
                    sst = _pair(out, seed=seed + k, regime=regime, conversations=conversations,
                                link=link, mode=mode)
                    details[f"{mode}_segment"] = {key: sst[key] for key in (
                        "requests_ok", "requests_failed", "conversations")}
                    segments.append(f"{sst['requests_ok']} in {mode}")
                except Exception as exc:  # the advice stands without it (the mode simulated)
                    log.warning("the %s segment failed (%s: %s); %s is simulated", mode,
                                type(exc).__name__, exc, mode)
                    details[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"
            push = f", then the same traffic again: {', '.join(segments)}" if segments else ""
            return DefaultSpans(out, "vllm-pair",
                                f"probe (NIXL, 2 processes) + local vLLM pair (bidirectional, kvtune "
                                f"connectors){on} through the kvtune router, lab regime "
                                f"{regime.name}: {stats['requests_ok']} requests in "
                                f"{stats['conversations']} conversations{push}", fabric,
                                details, tiny_model_dir(), regime.name)
        except Exception as exc:  # any failure of the pair falls back to the sim
            log.warning("the local vLLM pair could not produce spans (%s: %s); the simulator "
                        "stands in", type(exc).__name__, exc)
            details["pair_error"] = f"{type(exc).__name__}: {exc}"
    n = _sim(out / "sim", probe, seed, regime)
    details["sim_spans"] = n
    return DefaultSpans(out, "probe+sim",
                        "probe (NIXL, 2 processes) + simulator calibrated with the probe's fit "
                        "(stand-in for the vLLM pair)", fabric, details, tiny_model_dir())


def tiny_model_dir() -> str:
    """Where the local tiny model lives (the name `vllm serve` takes for it)."""
    from kvtune.local.pair import default_model_dir

    return str(default_model_dir())


def tiny_geometry() -> Any:
    """KV geometry of the local tiny model (made here if missing)."""
    from kvtune.geometry import from_hf_config
    from kvtune.local.pair import default_model_dir
    from kvtune.local.tiny_model import make_tiny_model

    return from_hf_config(make_tiny_model(default_model_dir()) / "config.json", 1)


def _probe(spans_dir: Path, fabric: str, tokens: Sequence[int], seed: int,
           link: ShapedLink | None = None) -> Any:
    from kvtune.probe.sweep import ProbeConfig, run_and_write

    cfg = ProbeConfig(geometry=tiny_geometry(), tokens=tuple(tokens), iters=PROBE_ITERS, warmup=2,
                      fabric=fabric, spans_dir=spans_dir, seed=seed, progress=True,
                      **(link.probe_settings() if link is not None else {}))
    return run_and_write(cfg)  # initiator spans too, not only the target's


def _sim(spans_dir: Path, probe: Any, seed: int, regime: LabRegime) -> int:
    from dataclasses import replace

    from kvtune.sim import Dist, ReuseSettings, WorkloadSpec, from_fit, simulate

    spans_dir.mkdir(parents=True, exist_ok=True)
    geo = tiny_geometry()
    # The tiny model's prefill on one CPU core, roughly: a stand-in, said so in the source's kind.
    prefill = _PrefillGuess(per_token_ms=0.05, per_token_prefix_us=0.5, base_ms=5.0)
    fit: Any = probe
    if getattr(probe, "floor_ms", None) is None or getattr(probe, "bandwidth_gbps", None) is None:
        # The probe's fit failed (too noisy a machine): its fastest point stands in for the floor.
        pts = [p for p in probe.points if p.p50_ms and p.gbps_p50]
        fit = _FitGuess(floor_ms=min(p.p50_ms for p in pts),
                        bandwidth_gbps=max(p.gbps_p50 for p in pts))
    cfg = from_fit(fit, prefill, mode="bidirectional", seed=seed, fabric="local-ucx",
                   model="kvtune-tiny (simulated)")
    cfg = replace(cfg, transfer=replace(cfg.transfer, kv_bytes_per_token=geo.bytes_per_token,
                                        block_tokens=geo.block_size_tokens,
                                        descriptors_per_block=2 * geo.layers),
                  reuse=ReuseSettings(ttl_s=30.0, threshold_tokens=RECOMPUTE_THRESHOLD),
                  workload=WorkloadSpec(qps=0.5, duration_s=120.0,
                                        prompt_tokens=Dist("uniform", (64.0, 768.0)),
                                        output_tokens=Dist.fixed(regime.max_tokens),
                                        turns=Dist.fixed(regime.turns),
                                        new_tokens=Dist.fixed(regime.new_tokens_per_turn),
                                        think_time_s=Dist("uniform", (0.5, 3.0))))
    result = simulate(cfg, progress=True)
    return result.write_spans(spans_dir / "sim.jsonl")


def _pair(out: Path, *, seed: int, regime: LabRegime, conversations: int,
          link: ShapedLink | None = None, mode: str = "bidirectional") -> dict[str, Any]:
    """Run the regime's workload on a fresh pair in ``mode``; spans under ``out/pair`` and
    ``out/router`` (``out/pair-MODE``, ``out/router-MODE`` for a mode other than bidirectional)."""
    from kvtune import spans as S
    from kvtune.local.pair import SPAN_EXPORT_DELAY_MS, LocalPair
    from kvtune.router import InstanceConfig, RouterConfig, RouterProcess

    tag = "" if mode == S.Mode.BIDIRECTIONAL.value else f"-{mode}"
    workdir = out.parent / f"pair-work{tag}"
    threshold = RECOMPUTE_THRESHOLD if mode == S.Mode.BIDIRECTIONAL.value else None
    with LocalPair(mode, connector="kvtune", workdir=workdir / "pair",
                   spans_dir=out / f"pair{tag}", recompute_threshold=threshold,
                   fabric=link, regime=regime) as pair:
        cfg = RouterConfig(prefill=(InstanceConfig(pair.prefill_url,
                                                   engine_id=pair.prefill_engine_id,
                                                   kv_port=pair.prefill_side_channel_port),),
                           decode=(InstanceConfig(pair.decode_url),),
                           mode=S.Mode(mode), state=f"sqlite:{workdir}/router-state.db",
                           port=0, prefill_timeout_s=REQUEST_TIMEOUT_S,
                           decode_timeout_s=REQUEST_TIMEOUT_S,
                           telemetry={"json_path": str(out / f"router{tag}")})
        with RouterProcess(cfg, workdir=workdir / "router") as router:
            stats = drive(router.url, workload_plans(regime, conversations, seed=seed), regime)
        time.sleep(2 * SPAN_EXPORT_DELAY_MS / 1000)  # the last requests' spans, before the stop
        return stats


def workload_plans(regime: LabRegime | str = DEFAULT_REGIME, n_conversations: int | None = None,
                   *, seed: int = 0) -> list[Any]:
    """The embedded default's traffic in ``regime`` as replayable plans
    (``kvtune.local.workload``), for ``kvtune verify --workload tune``: conversations cycling
    through the regime's first-prompt lengths, its turns of ``new_tokens_per_turn`` new tokens
    and ``max_tokens`` output, its think-time gaps; driven as :func:`drive` drives them (tune's
    own traffic and ``kvtune verify --workload tune`` are one flow)."""
    from kvtune.errors import ConfigError
    from kvtune.local.workload import ConversationPlan, TurnPlan

    lab = lab_regime(regime)
    n = lab.conversations if n_conversations is None else n_conversations
    if n < 1:
        raise ConfigError(f"workload_plans: n_conversations expected >= 1, got {n}")
    rng = random.Random(f"tune-workload-{seed}")

    def tokens(k: int) -> tuple[int, ...]:
        return tuple(rng.randrange(MIN_TOKEN_ID, MAX_TOKEN_ID) for _ in range(k))

    plans = []
    for i in range(n):
        first = lab.first_prompt_tokens[i % len(lab.first_prompt_tokens)]
        conv = tuple(TurnPlan(turn=k,
                              user_tokens=tokens(first if k == 1 else lab.new_tokens_per_turn),
                              max_tokens=lab.max_tokens,
                              think_time_s=0.0 if k == 1 else rng.uniform(*lab.think_time_s))
                     for k in range(1, lab.turns + 1))
        plans.append(ConversationPlan(conversation_id=f"tune-{seed}-{first}-{i:03d}", start_s=0.0,
                                      system_tokens=(), turns=conv))
    return plans


def drive(url: str, plans: Sequence[Any], regime: LabRegime | str = DEFAULT_REGIME
          ) -> dict[str, Any]:
    """Send ``plans`` through the router at ``url`` as ``regime`` drives its traffic (its
    conversations in flight, or turn by turn; non-streamed, as ``kvtune verify`` replays them)
    and count the outcome."""
    from kvtune.errors import KvtuneError
    from kvtune.local.workload import HttpTarget, run_workload

    lab = lab_regime(regime)
    results = run_workload(plans, HttpTarget(url, stream=False, timeout_s=REQUEST_TIMEOUT_S),
                           max_concurrency=lab.parallel_conversations,
                           turn_major=lab.turn_major)
    ok = [r for r in results if r.ok]
    stats: dict[str, Any] = {
        "requests_ok": len(ok), "requests_failed": len(results) - len(ok),
        "conversations": len(plans),
        "errors": [f"{r.conversation_id} turn {r.turn}: {r.error}" for r in results if not r.ok],
        "latencies_s": [r.latency_ms / 1000.0 for r in results]}
    if not ok:
        raise KvtuneError(f"workload: no request succeeded ({stats['errors'][:3]})")
    return stats
