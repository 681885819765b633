"""Replay a workload under one configuration and measure it: TTFT from the router's and the
engines' spans, reuse captured from the prefill's prompt-token counters, decode KV memory from the
decode's ``/metrics``.

Requests go through a fresh kvtune router per configuration (``RouterProcess``, its spans written to
the configuration's working directory). They are sent non-streaming: vLLM 0.32 returns a
bidirectional turn's retained-block params only in a non-streamed answer, and every configuration
is measured the same way. The router's ``kv.ttft_ms`` of a non-streamed request is the prefill's
answer, before any KV reaches the decode: it leaves out the very path the modes differ on. So
where the deployment's engines write kvtune spans (the local pair), TTFT is measured to the
decode's first step (:data:`~kvtune.verify.results.TTFT_BASIS_DECODE`: the router's
``kv.request`` began -> the decode's ``kv.decode_start`` ended), and the router's value is kept
beside it; else (a cluster's own telemetry) the router's value, said so in ``ttft_basis``.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pandas as pd

from kvtune import spans as sc
from kvtune.local import client
from kvtune.local.errors import LocalPairError
from kvtune.local.metrics import (PromptTokenSources, parse_prometheus,
                                  prompt_token_sources)
from kvtune.local.workload import ConversationPlan, HttpTarget, RequestResult, run_workload
from kvtune.router.config import DEFAULT_DECODER_TTL_S, RouterConfig
from kvtune.verify import stats
from kvtune.verify.backends import Backend, Upstreams
from kvtune.verify.configs import VerifyConfig
from kvtune.verify.results import (TTFT_BASIS_DECODE, TTFT_BASIS_ROUTER, ConfigResult,
                                   MemorySample, RequestMeasurement)

KV_USAGE_METRIC: Final = "vllm:kv_cache_usage_perc"
"""vLLM's gauge of the KV cache in use, 0..1 (1 = 100 %)."""
CACHE_INFO_METRIC: Final = "vllm:cache_config_info"
SAMPLE_INTERVAL_S: Final = 0.5
"""Decode ``/metrics`` poll period while a configuration runs."""
COUNTER_SETTLE_S: Final = 2.0
"""vLLM updates its counters after a step: wait this long after the last answer before reading."""
ROUTER_SPANS_FILE: Final = "router-spans.jsonl"
MIN_DECODE_SHARE: Final = 0.9
"""Share of answered requests whose decode first step must be traced for the decode basis."""


_log = logging.getLogger(__name__)


def router_config(config: VerifyConfig, ups: Upstreams, spans_path: Path) -> RouterConfig:
    """The router for ``config``: its mode and the decode's TTL, spans to ``spans_path``."""
    return RouterConfig(prefill=ups.prefill, decode=ups.decode, mode=sc.Mode(config.mode),
                        host="127.0.0.1", port=0, state=":memory:",
                        decoder_ttl_s=config.ttl_s or DEFAULT_DECODER_TTL_S,
                        telemetry={"json_path": str(spans_path)})


def sum_sources(urls: Sequence[str]) -> PromptTokenSources | None:
    """Prompt tokens by source summed over ``urls``; None when one cannot be read."""
    total = PromptTokenSources(0, 0, 0)
    try:
        for url in urls:
            s = prompt_token_sources(url)
            total = PromptTokenSources(total.local_compute_tokens + s.local_compute_tokens,
                                       total.local_cache_hit_tokens + s.local_cache_hit_tokens,
                                       total.external_kv_transfer_tokens
                                       + s.external_kv_transfer_tokens)
    except LocalPairError as exc:
        _log.warning("verify: prompt-token counters unreadable (%s); reuse captured not measured",
                     exc)
        return None
    return total


def kv_usage_from_text(text: str) -> tuple[float | None, int | None]:
    """(mean KV usage 0..1 over the exposition's engines, total ``num_gpu_blocks``)."""
    usage, blocks = [], 0
    found_blocks = False
    for name, labels, value in parse_prometheus(text):
        if name == KV_USAGE_METRIC:
            usage.append(value)
        elif name == CACHE_INFO_METRIC and labels.get("num_gpu_blocks", "").isdigit():
            blocks += int(labels["num_gpu_blocks"])
            found_blocks = True
    return (sum(usage) / len(usage) if usage else None), (blocks if found_blocks else None)


class MemorySampler:
    """Polls the decodes' ``/metrics`` on a thread: KV usage over time."""

    def __init__(self, urls: Sequence[str], interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.urls, self.interval_s = list(urls), interval_s
        self.samples: list[MemorySample] = []
        self.blocks_total: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtune-verify-memory", daemon=True)
        self._t0 = 0.0

    def __enter__(self) -> MemorySampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            values, blocks = [], 0
            for url in self.urls:
                try:
                    status, text = client.get(url, "/metrics", timeout_s=5.0)
                except (client.HttpError, OSError):
                    continue
                if status != 200:
                    continue
                u, b = kv_usage_from_text(text)
                if u is not None:
                    values.append(u)
                if b is not None:
                    blocks += b
            if values:
                self.samples.append(MemorySample(round(time.monotonic() - self._t0, 3),
                                                 100.0 * sum(values) / len(values)))
            if blocks:
                self.blocks_total = blocks
            self._stop.wait(self.interval_s)


def ttft_from_router_spans(path: Path) -> dict[str, float]:
    """``kv.ttft_ms`` of the router's ``kv.request`` spans by the client's request id."""
    return {rid: v[0] for rid, v in router_request_facts(path).items() if v[0] is not None}


def router_request_facts(path: Path) -> dict[str, tuple[float | None, int | None]]:
    """(``kv.ttft_ms``, ``kv.reuse.remote_tokens``) of the router's ``kv.request`` spans by the
    client's request id."""
    if not path.exists():
        return {}
    from kvtune.traces import load

    df = load(str(path), correct_clocks=False, progress=False)
    if df.empty:
        return {}
    req = df[df["name"] == sc.SpanName.REQUEST.value]
    out = {}
    for attrs in req["attrs"]:  # every attribute is in ``attrs``, typed columns only for some
        attrs = attrs if isinstance(attrs, dict) else {}
        rid, ttft = attrs.get(sc.CLIENT_REQUEST_ID), attrs.get(sc.TTFT_MS)
        offered = attrs.get(sc.REUSE_REMOTE_TOKENS)
        if isinstance(rid, str):
            out[rid] = (float(ttft) if isinstance(ttft, (int, float)) and ttft == ttft else None,
                        int(offered) if isinstance(offered, (int, float))
                        and not isinstance(offered, bool) else None)
    return out


@dataclass(frozen=True)
class EngineFacts:
    """What the engines' spans say of each client request (by its id)."""

    first_step_ms: dict[str, float]
    """TTFT to the decode's first step (``kvtune.analysis.modes.first_step_ttft``: the router's
    ``kv.request`` began -> the decode's ``kv.decode_start`` ended), ms."""
    prefill_cached_tokens: dict[str, int]
    """``kv.cached_tokens`` of the request's ``kv.prefill`` span: prompt tokens the prefill did
    not compute (its own prefix cache's hits plus any history pulled back)."""


def engine_facts(router_spans: Path, engine_spans: Path | None) -> EngineFacts:
    """The engines' facts per client request; empty when either side's spans are missing."""
    if engine_spans is None or not router_spans.exists() or not engine_spans.is_dir() \
            or not any(engine_spans.glob("*.jsonl")):
        return EngineFacts({}, {})
    from kvtune.analysis.modes import first_step_ttft, spans_named
    from kvtune.traces import load

    df = load([str(router_spans), str(engine_spans)], correct_clocks=False, progress=False)
    t = first_step_ttft(df)
    first = {rid: float(v) for rid, v in zip(t["client_request_id"], t["ttft_ms"])
             if isinstance(rid, str)}
    cached: dict[str, int] = {}
    if not df.empty and sc.CACHED_TOKENS in df.columns and sc.ROLE in df.columns:
        by_trace = dict(zip(t["trace_id"], t["client_request_id"]))
        req = spans_named(df, sc.SpanName.REQUEST.value)
        for tid, attrs in zip(req["trace_id"], req["attrs"]):
            rid = attrs.get(sc.CLIENT_REQUEST_ID) if isinstance(attrs, dict) else None
            if isinstance(rid, str):
                by_trace.setdefault(tid, rid)
        pre = spans_named(df, sc.SpanName.PREFILL.value, sc.Role.PREFILL.value)
        for tid, c in zip(pre["trace_id"], pre[sc.CACHED_TOKENS]):
            rid = by_trace.get(tid)
            if isinstance(rid, str) and pd.notna(c):
                cached[rid] = int(c)
    return EngineFacts(first, cached)


def decode_first_step_ms(router_spans: Path, engine_spans: Path | None) -> dict[str, float]:
    """Per client request id: TTFT to the decode's first step, ms (:class:`EngineFacts`)."""
    return engine_facts(router_spans, engine_spans).first_step_ms


def measurements(results: Sequence[RequestResult],
                 facts: Mapping[str, tuple[float | None, int | None]],
                 first_step: Mapping[str, float] | None = None, *, start: int = 0,
                 prefill_cached: Mapping[str, int] | None = None
                 ) -> tuple[tuple[RequestMeasurement, ...], str]:
    """Per request: the client's view, with its TTFT and the history the router offered back
    (``facts``: :func:`router_request_facts`); and the TTFT basis. TTFT is measured to the
    decode's first step (``first_step``: :func:`decode_first_step_ms`) when at least
    :data:`MIN_DECODE_SHARE` of the answered requests have it (the others: no TTFT), else it is
    the router's (else the client's) for every request."""
    first_step = first_step or {}
    ok = [r for r in results if r.ok]
    missing = sum(r.request_id not in first_step for r in ok)
    decode = bool(ok) and missing <= (1.0 - MIN_DECODE_SHARE) * len(ok)
    if first_step and missing:
        _log.warning("verify: %d of %d answered requests have no decode first step in the "
                     "engines' spans; %s", missing, len(ok),
                     "they are left out of the TTFT statistics" if decode else
                     "TTFT is the router's for this configuration")
    out = []
    for r in results:
        ttft, offered = facts.get(r.request_id, (None, None))
        router = (ttft if ttft is not None else r.ttft_ms) if r.ok else None
        out.append(RequestMeasurement(
            conversation_id=r.conversation_id, turn=r.turn, prompt_tokens=r.prompt_tokens,
            ttft_ms=(first_step.get(r.request_id) if decode and r.ok else router),
            latency_ms=r.latency_ms, ok=r.ok, error=r.error, offered_tokens=offered,
            router_ttft_ms=router if decode else None, start=start,
            prefill_cached_tokens=(prefill_cached or {}).get(r.request_id)))
    return tuple(out), TTFT_BASIS_DECODE if decode else TTFT_BASIS_ROUTER


def summarize(config: VerifyConfig, requests: tuple[RequestMeasurement, ...], *,
              reused_tokens: int | None, memory: Sequence[MemorySample],
              blocks_total: int | None, wall_s: float, seed: int = 0,
              ttft_basis: str = TTFT_BASIS_ROUTER, starts: int = 1) -> ConfigResult:
    """The per-configuration statistics of measured requests (pure)."""
    ttfts = [r.ttft_ms for r in requests if r.ok and r.ttft_ms is not None]
    enough = len(ttfts) >= stats.MIN_SAMPLES
    later = sum(r.prompt_tokens for r in requests if r.turn > 1 and r.ok)
    share = (min(1.0, reused_tokens / later) if reused_tokens is not None and later > 0
             else None)
    usage = [m.decode_kv_usage_pct for m in memory]
    return ConfigResult(
        config=config, requests=requests,
        ttft_p50=stats.quantile_ci(ttfts, 0.5, seed=seed, what=f"{config.name} TTFT")
        if enough else None,
        ttft_p99=stats.quantile_ci(ttfts, 0.99, seed=seed, what=f"{config.name} TTFT")
        if enough else None,
        turn2plus_prompt_tokens=later, reused_tokens=reused_tokens, reuse_captured_share=share,
        memory=tuple(memory), decode_kv_usage_mean_pct=sum(usage) / len(usage) if usage else None,
        decode_kv_usage_max_pct=max(usage) if usage else None, decode_kv_blocks_total=blocks_total,
        wall_s=wall_s, ttft_basis=ttft_basis, starts=starts)


def combine(parts: Sequence[ConfigResult], *, seed: int = 0) -> ConfigResult:
    """One configuration measured over several starts of its deployment, as one result: the
    requests of every start (each tagged with its start), the prefill's pulled tokens and the
    memory samples added up (samples on one clock, start after start). Where one start fell back
    to the router's TTFT, every start's request is read on that basis."""
    if not parts:
        raise ValueError("combine: expected at least one start's result")
    if len(parts) == 1:
        return parts[0]
    basis = (TTFT_BASIS_DECODE if all(p.ttft_basis == TTFT_BASIS_DECODE for p in parts)
             else TTFT_BASIS_ROUTER)
    requests, memory, t_off = [], [], 0.0
    for p in parts:
        for r in p.requests:
            if basis != p.ttft_basis:
                r = dataclasses.replace(r, ttft_ms=r.router_ttft_ms, router_ttft_ms=None)
            requests.append(r)
        memory += [dataclasses.replace(m, t_s=round(m.t_s + t_off, 3)) for m in p.memory]
        t_off += p.wall_s
    reused = (None if any(p.reused_tokens is None for p in parts)
              else sum(p.reused_tokens for p in parts if p.reused_tokens is not None))
    blocks = [p.decode_kv_blocks_total for p in parts if p.decode_kv_blocks_total is not None]
    return summarize(parts[0].config, tuple(requests), reused_tokens=reused, memory=memory,
                     blocks_total=max(blocks) if blocks else None,
                     wall_s=sum(p.wall_s for p in parts), seed=seed, ttft_basis=basis,
                     starts=len(parts))


More = Callable[[Sequence[RequestResult]], Sequence[ConversationPlan]]
"""Given a phase's results so far, further conversations for it (none: the phase is done)."""


@dataclass(frozen=True)
class Phase:
    """One workload run on a deployment, through a router of its own (its spans in their own
    file), measured on its own."""

    name: str
    plans: Sequence[ConversationPlan]
    config: VerifyConfig | None = None
    """What the result is labelled (None: the deployment's configuration)."""
    time_scale: float = 1.0
    max_concurrency: int | None = None
    turn_major: bool = False
    more: More | None = None


def measure_config(config: VerifyConfig, backend: Backend, plans: Sequence[ConversationPlan],
                   workdir: Path, *, time_scale: float = 1.0, max_concurrency: int | None = None,
                   turn_major: bool = False, progress: bool = True, start: int = 0,
                   more: More | None = None) -> ConfigResult:
    """Deploy ``config``, replay ``plans`` through a router for it, measure, tear down; the
    requests are tagged as served by the deployment's ``start``-th start. ``more`` (given the
    results so far) names further conversations for the same deployment, until it names none."""
    phase = Phase("replay", plans, time_scale=time_scale, max_concurrency=max_concurrency,
                  turn_major=turn_major, more=more)
    return measure_deployment(config, backend, [phase], workdir, progress=progress,
                              start=start)[0]


def measure_deployment(config: VerifyConfig, backend: Backend, phases: Sequence[Phase],
                       workdir: Path, *, progress: bool = True,
                       start: int = 0) -> list[ConfigResult]:
    """Deploy ``config`` once and run each phase on it in turn (a fresh router each, its spans
    in ``workdir``: the first phase's in :data:`ROUTER_SPANS_FILE`, the others' in
    ``NAME-router-spans.jsonl``); one result per phase, tagged with the deployment's start."""
    from kvtune.router.process import RouterProcess

    workdir.mkdir(parents=True, exist_ok=True)
    paths = [workdir / (ROUTER_SPANS_FILE if i == 0 else f"{ph.name}-{ROUTER_SPANS_FILE}")
             for i, ph in enumerate(phases)]
    for p in paths:
        p.unlink(missing_ok=True)
    runs = []
    with backend.deploy(config, workdir) as ups:
        prefill_urls = [i.url for i in ups.prefill]
        for ph, spans_path in zip(phases, paths):
            t0 = time.monotonic()
            before = sum_sources(prefill_urls)
            with RouterProcess(router_config(config, ups, spans_path),
                               workdir=workdir / ("router" if spans_path == paths[0]
                                                  else f"router-{ph.name}")) as router, \
                    MemorySampler([i.url for i in ups.decode]) as sampler:
                target = HttpTarget(router.url, stream=False)
                kw = {"time_scale": ph.time_scale, "max_concurrency": ph.max_concurrency,
                      "turn_major": ph.turn_major, "progress": progress}
                results = run_workload(ph.plans, target, **kw)
                while ph.more is not None and (extra := ph.more(results)):
                    results += run_workload(extra, target, **kw)
                time.sleep(COUNTER_SETTLE_S)  # also the pair's span exports (every 0.5 s)
            after = sum_sources(prefill_urls) if before is not None else None
            reused = ((after - before).external_kv_transfer_tokens
                      if after is not None and before is not None else None)
            runs.append((ph, spans_path, results, reused, sampler, time.monotonic() - t0))
    out = []
    for ph, spans_path, results, reused, sampler, wall in runs:
        eng = engine_facts(spans_path, ups.spans_dir)
        requests, basis = measurements(results, router_request_facts(spans_path),
                                       eng.first_step_ms, start=start,
                                       prefill_cached=eng.prefill_cached_tokens)
        out.append(summarize(ph.config or config, requests, reused_tokens=reused,
                             memory=sampler.samples, blocks_total=sampler.blocks_total,
                             wall_s=wall, ttft_basis=basis))
    return out
