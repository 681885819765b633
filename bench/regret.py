"""Regret of kvtune's advice in the simulator, measured in one run.

For each traffic profile (short/long prompts, few/many turns, low/high QPS, gaps shorter and longer
than vLLM's default TTL, and the public preset's reuse benchmark), on the public H200 preset:

1. trace the traffic as a user would have it today: vLLM's defaults (pull, threshold 64 tokens,
   TTL 480 s), spans written as OTLP-JSON lines;
2. recommend from those spans exactly as a user would (``kvtune.traces.load`` ->
   ``kvtune.recommend.recommend``);
   With the fabric probe's sweep of the preset's link beside them, as ``kvtune tune`` has it: traffic
   of one prompt size (the public preset's) cannot support a floor fit on its own;
3. sweep threshold x TTL x mode on a fresh sample of the same traffic (another seed) for the best
   TTFT p50, and play the recommended configuration and vLLM's defaults on that same sample.

Prints one row per profile: best config and its p50, the recommendation and its p50 (and its
regret against the best), the defaults' p50, and whether the recommendation is within
``WITHIN_SHARE`` of the best and not worse than the defaults. Exit status 1 if any row fails.
Then lease-versus-TTL rows (:func:`lease_rows`): agent conversations with heavy-tailed lognormal
think times (under a second to minutes), some ending early with an explicit end, played through
``kvtune.sim.retention`` under vLLM's fixed 480 s TTL, the TTL kvtune's TTL advice picks, the
cheapest swept TTL capturing as much as the lease, and the lease ``kvtune.recommend.retention``
chooses: reuse captured and decode block-seconds per policy.

Run: ``flock /tmp/kvtune-heavy.lock env PYTHONPATH=$PWD .venv/bin/python bench/regret.py``
(``--quick`` for shorter traffic; ``--lease-only`` for the lease rows alone (a second); ``--out
FILE`` also writes the tables as Markdown).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvtune.analysis.conversations import Conversation
from kvtune.analysis.workload import Workload
from kvtune.recommend import NEVER, recommend
from kvtune.recommend.retention import SWEEP_TTLS_S, choose_lease
from kvtune.recommend.ttl import recommend_ttl
from kvtune.sim.retention import FixedTtl, PolicyResult, play
from kvtune.sim import Dist, SimConfig, WorkloadSpec, presets, simulate
from kvtune.spans import Mode
from kvtune.testing import synthetic
from kvtune.traces import load
from kvtune.vllm_pd import DEFAULT_DECODER_KV_BLOCKS_TTL_S as VLLM_DEFAULT_TTL_S
from kvtune.vllm_pd import DEFAULT_KV_RECOMPUTE_THRESHOLD_TOKENS as VLLM_DEFAULT_THRESHOLD_TOKENS
from kvtune.vllm_pd import DEFAULT_MODE as VLLM_DEFAULT_MODE

WITHIN_SHARE = 0.03
"""The recommendation's p50 must lie within 3% of the sweep's best."""
THRESHOLDS: tuple[int | str, ...] = (16, 64, 256, 1024, 4096, 16384, NEVER)
TTLS_S: tuple[float, ...] = (30.0, 120.0, 480.0, 1800.0)
NEVER_TOKENS = 1 << 40
TRACE_SEED, EVAL_SEED = 1, 2
RETENTION_SHARE = 0.5
"""Share of the preset decode node's KV memory a user of that hardware would set aside for retained
conversations (``hbm_budget_gb``); kvtune's default (10 GB) is a guess for hardware it knows
nothing about."""


def preset_hbm_budget_gb() -> float:
    """``RETENTION_SHARE`` of the preset decode's KV memory, GB (tokens x bytes per token, as
    ``kv.bytes`` counts them)."""
    base = presets.public_h200_qwen3_32b()
    return RETENTION_SHARE * base.decode.kv_capacity_tokens * base.transfer.kv_bytes_per_token / 1e9


@dataclass(frozen=True)
class Profile:
    name: str
    what: str
    workload: WorkloadSpec


def _wl(**kw: object) -> WorkloadSpec:
    base = dict(qps=2.0, duration_s=900.0, prompt_tokens=Dist("lognormal", (2000.0, 0.5)),
                output_tokens=Dist("lognormal", (200.0, 0.4)), turns=Dist("uniform", (1.0, 6.0)),
                new_tokens=Dist("lognormal", (300.0, 0.5)), think_time_s=Dist("exponential", (30.0,)))
    base.update(kw)
    return WorkloadSpec(**base)  # type: ignore[arg-type]


def profiles(scale: float) -> list[Profile]:
    """The traffic profiles; ``scale`` shortens the traffic (``--quick``)."""
    d = 900.0 * scale
    out = [
        Profile("short-prompts", "~300-token prompts, 1-6 turns, 2 QPS",
                _wl(duration_s=d, prompt_tokens=Dist("lognormal", (300.0, 0.5)),
                    new_tokens=Dist("lognormal", (60.0, 0.5)))),
        Profile("long-prompts", "~16k-token prompts, 1-4 turns, 0.5 QPS",
                _wl(duration_s=d, qps=0.5, prompt_tokens=Dist("lognormal", (16000.0, 0.3)),
                    turns=Dist("uniform", (1.0, 4.0)))),
        Profile("few-turns", "single-turn, 2k prompts, 2 QPS",
                _wl(duration_s=d, turns=Dist.fixed(1))),
        Profile("many-turns", "10-turn sessions, 2k prompts, 2 QPS",
                _wl(duration_s=d, turns=Dist.fixed(10), think_time_s=Dist("exponential", (15.0,)))),
        Profile("low-qps", "0.2 QPS, 2k prompts, 1-6 turns",
                _wl(duration_s=2 * d, qps=0.2)),
        Profile("high-qps", "8 QPS, 2k prompts, 1-6 turns",
                _wl(duration_s=d / 2, qps=8.0)),
        Profile("short-gaps", "gaps 1-20 s (below the 480 s default TTL)",
                _wl(duration_s=d, think_time_s=Dist("uniform", (1.0, 20.0)))),
        Profile("long-gaps", "gaps 200-1500 s (around and beyond the 480 s default TTL)",
                _wl(duration_s=4 * d, qps=1.0, turns=Dist("uniform", (2.0, 4.0)),
                    think_time_s=Dist("uniform", (200.0, 1500.0)))),
    ]
    pub = presets.reuse_scenario(24000, reuse=True, duration_s=presets.REUSE_DURATION_S * scale)
    first = pub.workload.prompt_tokens.params[0]
    # one prompt length cannot support kvtune's prefill-cost fit (it says so and stops): spread it
    wl = replace(pub.workload, prompt_tokens=Dist("uniform", (0.8 * first, 1.2 * first)))
    out.append(Profile("public-reuse-24k", "the public preset's reuse benchmark (2 users, ~24k "
                       "contexts; first prompts spread ±20% so the prefill cost can be fitted)", wl))
    return out


def configured(base: SimConfig, wl: WorkloadSpec, mode: str, threshold: int | str, ttl_s: float,
               seed: int) -> SimConfig:
    thr = NEVER_TOKENS if threshold == NEVER else int(threshold)
    return replace(base, mode=mode, workload=wl, seed=seed, requests=None,
                   reuse=replace(base.reuse, threshold_tokens=thr, ttl_s=float(ttl_s)))


def p50(cfg: SimConfig) -> float:
    return simulate(cfg).ttft().p50_ms


def label(mode: str, threshold: int | str, ttl_s: float) -> str:
    m = str(getattr(mode, "value", mode))
    if m != Mode.BIDIRECTIONAL.value:
        return m
    return f"bidi thr {threshold} ttl {ttl_s:g}"


@dataclass(frozen=True)
class Row:
    profile: str
    best: str
    best_p50_ms: float
    rec: str
    rec_p50_ms: float
    default_p50_ms: float
    rec_range: str

    @property
    def regret(self) -> float:
        return self.rec_p50_ms / self.best_p50_ms - 1.0

    @property
    def vs_default(self) -> float:
        return self.rec_p50_ms / self.default_p50_ms - 1.0

    @property
    def ok(self) -> bool:
        return self.regret <= WITHIN_SHARE and self.rec_p50_ms <= self.default_p50_ms * (1 + 1e-9)


def probe_sweep(base: SimConfig, path: Path) -> None:
    """The fabric probe's sweep of the preset's link (its floor, bandwidth and per-descriptor cost,
    with the synthetic probe's default noise), written as OTLP-JSON lines to ``path``."""
    t = base.transfer
    truth = synthetic.FabricTruth(floor_ms=t.floor_ms, bandwidth_gbps=t.bandwidth_gbps,
                                  per_descriptor_us=t.per_descriptor_us)
    synthetic.write_otlp_json(synthetic.probe_spans(truth, seed=TRACE_SEED), path)


def run_profile(p: Profile, bar: tqdm, hbm_budget_gb: float) -> Row:
    base = presets.public_h200_qwen3_32b()
    # 1. the user's trace, under vLLM's defaults
    traced = configured(base, p.workload, VLLM_DEFAULT_MODE.value, VLLM_DEFAULT_THRESHOLD_TOKENS,
                        VLLM_DEFAULT_TTL_S, TRACE_SEED)
    with tempfile.TemporaryDirectory() as tmp:
        simulate(traced).write_spans(Path(tmp) / "serving.jsonl")
        probe_sweep(base, Path(tmp) / "probe.jsonl")
        bar.update(1)
        # 2. recommend from the spans, as a user would
        tu = recommend(load(tmp), hbm_budget_gb=hbm_budget_gb)
    bar.update(1)
    rec_mode, rec_thr, rec_ttl = str(tu.mode.value), tu.threshold.value, float(tu.ttl.value)
    # 3. sweep on a fresh sample of the same traffic
    grid: list[tuple[str, int | str, float]] = [(Mode.PUSH.value, NEVER, 0.0),
                                                (Mode.PULL.value, NEVER, 0.0)]
    grid += [(Mode.BIDIRECTIONAL.value, t, ttl) for t in THRESHOLDS if t != NEVER for ttl in TTLS_S]
    results: dict[tuple[str, int | str, float], float] = {}
    for key in grid:
        results[key] = p50(configured(base, p.workload, *key, EVAL_SEED))
        bar.update(1)
    best_key = min(results, key=lambda k: (results[k], k[0]))
    rec_p50 = p50(configured(base, p.workload, rec_mode, rec_thr, rec_ttl, EVAL_SEED))
    default_p50 = p50(configured(base, p.workload, VLLM_DEFAULT_MODE.value,
                                 VLLM_DEFAULT_THRESHOLD_TOKENS, VLLM_DEFAULT_TTL_S, EVAL_SEED))
    bar.update(2)
    rng = (f"mode {tu.mode.range[0]}..{tu.mode.range[1]}, thr {tu.threshold.range[0]}.."
           f"{tu.threshold.range[1]}, ttl {tu.ttl.range[0]}..{tu.ttl.range[1]}")
    return Row(p.name, label(*best_key), results[best_key], label(rec_mode, rec_thr, rec_ttl),
               rec_p50, default_p50, rng)


def table(rows: list[Row], profs: list[Profile]) -> str:
    what = {p.name: p.what for p in profs}
    lines = [
        "| profile | traffic | best in sweep | best p50 ms | kvtune recommends | rec. p50 ms | regret "
        "| vLLM defaults p50 ms | rec. vs defaults | ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.profile} | {what[r.profile]} | {r.best} | {r.best_p50_ms:.1f} | {r.rec} "
                     f"| {r.rec_p50_ms:.1f} | {r.regret:+.1%} | {r.default_p50_ms:.1f} "
                     f"| {r.vs_default:+.1%} | {'yes' if r.ok else 'NO'} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class LeaseProfile:
    name: str
    what: str
    n_conversations: int
    ended_share: float
    """Share of conversations that end explicitly (the rest just stop)."""
    early_end_share: float
    """Share of conversations cut short (1 to 3 turns instead of up to 12)."""
    think_median_s: float = 4.0
    think_sigma: float = 2.0
    """Lognormal think time: median 4 s, sigma 2 -> p10 0.3 s, p90 52 s, p99 420 s."""


LEASE_PROFILES: tuple[LeaseProfile, ...] = (
    LeaseProfile("agents-most-end", "90% end explicitly, 30% after 1-3 turns", 2000, 0.9, 0.3),
    LeaseProfile("agents-half-end", "50% end explicitly, 30% after 1-3 turns", 2000, 0.5, 0.3),
    LeaseProfile("agents-none-end", "no explicit ends, 30% stop after 1-3 turns", 2000, 0.0, 0.3),
)
LEASE_SEED = 3
LEASE_THRESHOLD_TOKENS = 256
"""Histories shorter than this are recomputed anyway (not reusable)."""


def agent_conversations(p: LeaseProfile, seed: int = LEASE_SEED) -> list[Conversation]:
    """Synthetic agent conversations: 2-12 turns (1-3 when cut short), ~1.5k-token first prompts,
    ~400 tokens added per turn, lognormal think times; an explicit end, when there is one, comes
    with the last turn or within a second of it."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(p.n_conversations):
        early = rng.random() < p.early_end_share
        turns = int(rng.integers(1, 4) if early else rng.integers(2, 13))
        hist = np.cumsum(rng.lognormal(np.log(1500.0), 0.4, 1)[0]
                         + rng.lognormal(np.log(400.0), 0.5, turns)).astype(int)
        gaps = rng.lognormal(np.log(p.think_median_s), p.think_sigma, turns - 1)
        end = float(rng.uniform(0.0, 1.0)) if rng.random() < p.ended_share else None
        out.append(Conversation(f"c{i}", tuple(float(g) for g in gaps),
                                tuple(int(h) for h in hist[:-1]), int(hist[-1]), end))
    return out


LEASE_CONVERSATIONS_PER_S = 0.5
"""Conversation arrival rate the TTL advice's memory budget is checked against."""


def _kvtune_ttl_s(convs: list[Conversation]) -> float:
    """The TTL kvtune's TTL advice picks for these conversations (the preset's bytes per token and
    :func:`preset_hbm_budget_gb`, conversations arriving at ``LEASE_CONVERSATIONS_PER_S``)."""
    gaps = [g for c in convs for g in c.gaps_s]
    wl = Workload(n_requests=sum(len(c.gaps_s) + 1 for c in convs), qps=float("nan"),
                  prompt_tokens_p50=float("nan"), prompt_tokens_p90=float("nan"),
                  prompt_tokens_p99=float("nan"), output_tokens_p50=float("nan"),
                  multi_turn_share=0.0, turns_per_conversation_mean=0.0, gaps_s=tuple(gaps),
                  reuse_outcomes={}, duration_s=len(convs) / LEASE_CONVERSATIONS_PER_S,
                  n_conversations=len(convs),
                  gap_tokens=tuple(t for c in convs for t in c.gap_tokens),
                  final_tokens=tuple(c.final_tokens for c in convs))
    bpt = presets.public_h200_qwen3_32b().transfer.kv_bytes_per_token
    rec, _ = recommend_ttl(wl, bytes_per_token=bpt, hbm_budget_gb=preset_hbm_budget_gb(),
                           threshold_tokens=LEASE_THRESHOLD_TOKENS)
    return float(rec.value)


@dataclass(frozen=True)
class LeaseRow:
    profile: str
    policy: str
    result: PolicyResult
    vs_ttl_block_s: float
    """Block-seconds over those of the fixed TTL the row is matched with."""
    vs_default_block_s: float
    """Block-seconds over vLLM's fixed 480 s TTL's."""


def lease_rows(p: LeaseProfile) -> list[LeaseRow]:
    """Per reference TTL (vLLM's 480 s, kvtune's TTL advice): the fixed TTL, and the lease
    ``kvtune.recommend.retention`` chooses beside it (live window: that TTL's router TTL); then
    the cheapest swept TTL capturing as much as the lease beside kvtune's TTL."""
    convs = agent_conversations(p)
    kw = {"threshold_tokens": LEASE_THRESHOLD_TOKENS}
    default = play(convs, FixedTtl(VLLM_DEFAULT_TTL_S), **kw)
    out: list[LeaseRow] = []
    ttl = _kvtune_ttl_s(convs)
    for t, what in ((VLLM_DEFAULT_TTL_S, "vLLM default"), (ttl, "kvtune's TTL advice")):
        fixed = play(convs, FixedTtl(t), **kw)
        lease = choose_lease(convs, t)
        leased = play(convs, lease, **kw)
        out.append(LeaseRow(p.name, f"fixed TTL {t:g} s ({what})", fixed, 1.0,
                            fixed.block_s / default.block_s))
        out.append(LeaseRow(p.name, f"lease {lease.lease_s:.3g} s, renew {lease.renew_every_s:.3g}"
                            f" s, live {lease.idle_s:.4g} s", leased, leased.block_s / fixed.block_s,
                            leased.block_s / default.block_s))
    swept = [(t, play(convs, FixedTtl(t), **kw)) for t in sorted(set(SWEEP_TTLS_S) | {ttl})]
    equal = [(t, r) for t, r in swept if r.captured_tokens >= leased.captured_tokens]
    if equal:
        t, r = min(equal, key=lambda x: x[1].block_s)
        out.append(LeaseRow(p.name, f"fixed TTL {t:g} s (cheapest swept TTL capturing as much as "
                            f"the lease above)", r, 1.0, r.block_s / default.block_s))
    return out


def lease_table(rows: list[LeaseRow]) -> str:
    what = {p.name: p.what for p in LEASE_PROFILES}
    lines = ["| profile | traffic | policy | reuse captured | block-s held | vs its TTL "
             "| vs 480 s TTL |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.profile} | {what[r.profile]} | {r.policy} "
                     f"| {r.result.captured_share:.1%} | {r.result.block_s:.4g} "
                     f"| {r.vs_ttl_block_s:.0%} | {r.vs_default_block_s:.0%} |")
    return "\n".join(lines)


def lease_head() -> str:
    p = LEASE_PROFILES[0]
    return (f"## Renewable lease vs fixed TTL (kvtune.sim.retention; {p.n_conversations} "
            f"conversations per profile, lognormal think times median {p.think_median_s:g} s "
            f"sigma {p.think_sigma:g}, threshold {LEASE_THRESHOLD_TOKENS} tokens, seed {LEASE_SEED})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a third of the traffic (smoke run)")
    ap.add_argument("--only", help="comma-separated profile names")
    ap.add_argument("--out", help="also write the table (Markdown) to this file")
    ap.add_argument("--hbm-budget-gb", type=float, default=None,
                    help="recommend's hbm_budget_gb (default: half the preset decode's KV memory)")
    ap.add_argument("--lease-only", action="store_true", help="only the lease-versus-TTL rows")
    args = ap.parse_args()
    lrows = [r for lp in LEASE_PROFILES for r in lease_rows(lp)]
    ltable = lease_head() + "\n\n" + lease_table(lrows)
    if args.lease_only:
        print(ltable)
        return 0
    profs = profiles(1 / 3 if args.quick else 1.0)
    if args.only:
        keep = set(args.only.split(","))
        profs = [p for p in profs if p.name in keep]
    budget = args.hbm_budget_gb if args.hbm_budget_gb is not None else preset_hbm_budget_gb()
    per = 2 + 2 + len(THRESHOLDS[:-1]) * len(TTLS_S) + 2
    t0 = time.perf_counter()
    rows: list[Row] = []
    with tqdm(total=per * len(profs), unit="run", desc="regret", file=sys.stderr) as bar:
        for p in profs:
            bar.set_postfix_str(p.name)
            rows.append(run_profile(p, bar, budget))
    wall = time.perf_counter() - t0
    out = table(rows, profs)
    head = (f"# Simulator regret (public H200 preset; sweep: modes x thresholds {list(THRESHOLDS)} "
            f"x TTLs {list(TTLS_S)} s; vLLM defaults: {VLLM_DEFAULT_MODE.value}, threshold "
            f"{VLLM_DEFAULT_THRESHOLD_TOKENS}, TTL {VLLM_DEFAULT_TTL_S:g} s; recommend(hbm_budget_gb="
            f"{budget:.0f}); trace seed {TRACE_SEED}, "
            f"evaluation seed {EVAL_SEED}; {wall:.0f} s wall)")
    print(head)
    print()
    print(out)
    for r in rows:
        print(f"  {r.profile}: ranges {r.rec_range}")
    failed = [r.profile for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} profiles within {WITHIN_SHARE:.0%} of the best "
          f"and not worse than vLLM's defaults" + (f"; failing: {', '.join(failed)}" if failed else ""))
    print()
    print(ltable)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(head + "\n\n" + out + "\n\n" + ltable + "\n", encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
