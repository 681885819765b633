"""Overhead of kvtune's instrumented connectors on vLLM's engine loop, measured in one run.

Two measurements, printed as kvtune/vLLM ratios (aim: <= 1.02):

1. ``--micro`` (no engines): the scheduler-side connector work vLLM does on every engine step and
   for every request, on vLLM's real scheduler classes in this process, kvtune's subclass against
   vLLM's own, alternating in blocks so that drift cancels. Spans go to a JSON-lines file through
   the batch processor, as in use. As inside vLLM, the hooks only record each span's values; the
   spans are built off the engine thread (:mod:`kvtune.connectors.recorder`) and exported on the
   batch processor's. Here both happen between the timed blocks (so neither thread competes for
   the interpreter inside a timed block) and their time is printed apart, per request. The
   start-up heap is frozen as vLLM's EngineCore freezes it (``--micro-gc-unfrozen``: not). The aim for the
   engine thread: kvtune's extra cost at most ``AIM_REQUEST_US`` per request and ``AIM_STEP_US``
   per step, printed as MET / NOT MET.
2. For each mode, a real CPU prefill/decode pair runs the same requests with vLLM's own NIXL
   connector and then with kvtune's subclass: TTFT and decode step time (median, p90). The two
   pairs run one after the other on the same cores (a 2-core machine cannot hold both), so on a
   shared machine this ratio mostly carries the load's drift between the runs.

    .venv/bin/python bench/connectors.py --micro
    flock "$VLLM_LOCK" .venv/bin/python bench/connectors.py --modes pull,push --requests 20
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvtune import vllm_pd
from kvtune.local.pair import LocalPair

CONNECTORS = ("vllm", "kvtune")
AIM_REQUEST_US = 20.0
"""Aim: kvtune's extra engine-thread cost per request (scheduler side), microseconds."""
AIM_STEP_US = 0.5
"""Aim: kvtune's extra engine-thread cost per engine step (scheduler side), microseconds."""
FAST_EXPORT_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "500"}


@dataclass(frozen=True)
class Sample:
    ttft_ms: float
    step_ms: float


def _prompt(i: int, length: int) -> list[int]:
    """Distinct prompts (no prefix-cache hits between requests), identical across connectors."""
    return [(7 + i * 131 + k * 17) % 1900 + 50 for k in range(length)]


def run_pair(mode: str, connector: str, workdir: Path, n: int, prompt_len: int,
             max_tokens: int) -> list[Sample]:
    spans_dir = workdir / "spans" if connector == "kvtune" else None
    samples: list[Sample] = []
    with LocalPair(mode, connector=connector, workdir=workdir / "work", spans_dir=spans_dir,
                   extra_env=FAST_EXPORT_ENV) as pair:
        for i in tqdm(range(n), desc=f"{mode}/{connector}", file=sys.stderr):
            r = pair.complete(_prompt(i, prompt_len), max_tokens, request_id=f"bench-{mode}-{i}")
            if r.ttft_ms is None:
                continue
            # First decode token seen at ttft - prefill leg (pull) or ttft (push: both legs at once).
            first_in_decode = r.ttft_ms - (r.prefill_ms or 0.0) if mode != "push" else r.ttft_ms
            samples.append(Sample(r.ttft_ms, (r.decode_ms - first_in_decode) / (max_tokens - 1)))
    return samples


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def _timed(fn: Callable[[], None], n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def micro(steps: int = 60000, requests: int = 6000, blocks: int = 30,
          gc_freeze: bool = True) -> None:
    """Per-step and per-request scheduler-side cost, kvtune vs vLLM, in this process."""
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvtune import telemetry
    from kvtune.connectors.observer import Emitter
    from kvtune.connectors.recorder import SpanRecorder
    from kvtune.connectors.scheduler import KvtunePullScheduler

    cfg = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="KvtuneNixlPullConnector", kv_connector_module_path="kvtune.connectors",
        kv_role=vllm_pd.KV_PRODUCER, engine_id="bench-p"))
    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(layer_names=["l0"], kv_cache_spec=spec)])
    out_dir = Path(tempfile.mkdtemp(prefix="kvtune-bench-micro-"))
    tel = telemetry.setup("prefill", json_path=out_dir)
    vllm_s = NixlPullConnectorScheduler(cfg, "bench-p", kcc)
    kvt_s = KvtunePullScheduler(cfg, "bench-p", kcc)
    recorder = SpanRecorder(interval_s=None)  # drained between the timed blocks, timed apart
    kvt_s._kvt_init(Emitter(kvt_s._kvt.role, kvt_s._kvt.mode, "bench-p", tracer=tel.tracer,
                            telemetry=tel, deferred=True, recorder=recorder))
    # As vLLM's EngineCore does once it is built: the start-up heap is left out of GC passes
    # (else a collection walks vLLM's and torch's whole heap, charged to whoever allocates).
    if gc_freeze:
        freeze_gc_heap()
    try:
        _micro_blocks(vllm_s, kvt_s, recorder, tel, out_dir, steps, requests, blocks)
    finally:
        gc.unfreeze()
        tel.shutdown()


def _micro_blocks(vllm_s: Any, kvt_s: Any, recorder: Any, tel: Any, out_dir: Path, steps: int,
                  requests: int, blocks: int) -> None:
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request, RequestStatus

    empty_out, empty_conn = SchedulerOutput.make_empty(), KVConnectorOutput()

    def step(s: Any) -> Callable[[], None]:
        def run() -> None:
            s.build_connector_meta(empty_out)
            s.update_connector_output(empty_conn)
        return run

    counter = [0]

    def lifecycle(s: Any) -> Callable[[], None]:
        def run() -> None:
            counter[0] += 1
            req = Request(f"cmpl-bench{counter[0]}-0-0a1b2c3d", list(range(256)),
                          SamplingParams(max_tokens=1, extra_args={
                              vllm_pd.KV_TRANSFER_PARAMS: vllm_pd.prefill_leg_params()}),
                          None)
            s.get_num_new_matched_tokens(req, 0)
            s.update_state_after_alloc(req, None, 0)
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            s.request_finished(req, ([1, 2],))
            s.build_connector_meta(empty_out)
        return run

    results: dict[str, dict[str, list[float]]] = {"step": {"vllm": [], "kvtune": []},
                                                 "request": {"vllm": [], "kvtune": []}}
    build_ns: list[float] = []
    export_ns: list[float] = []
    n_req = max(1, requests // blocks)
    warm = min(20, n_req)
    kvt_requests = built = 0
    for _ in range(blocks):
        for name, s in (("vllm", vllm_s), ("kvtune", kvt_s)):
            # untimed warm-up: the previous block (or the drain) left the caches to the other
            _timed(step(s), warm)
            results["step"][name].append(_timed(step(s), max(1, steps // blocks)))
            _timed(lifecycle(s), warm)
            results["request"][name].append(_timed(lifecycle(s), n_req))
            if name == "kvtune":
                kvt_requests += warm + n_req
                t0 = time.perf_counter_ns()
                n = recorder.drain()
                t1 = time.perf_counter_ns()
                tel.force_flush()  # the exporter's thread must not run inside a timed block
                t2 = time.perf_counter_ns()
                build_ns.append((t1 - t0) / (warm + n_req))
                export_ns.append((t2 - t1) / (warm + n_req))
                built += n
    tel.force_flush()
    import vllm

    print(f"\nmicro (vLLM {vllm.__version__}, scheduler side, in-process, {blocks} alternating "
          f"blocks, start-up heap {'frozen' if gc.get_freeze_count() else 'NOT frozen'}; "
          f"spans -> {out_dir})")
    extra_us: dict[str, float] = {}
    for what, per in results.items():
        v, k = statistics.median(per["vllm"]), statistics.median(per["kvtune"])
        extra_us[what] = (k - v) / 1000
        print(f"per {what:<8} vllm {v / 1000:8.2f} us   kvtune {k / 1000:8.2f} us   "
              f"extra {extra_us[what]:7.2f} us   ratio {k / v:.3f}")
    print(f"off the engine thread, per request: building spans "
          f"{statistics.median(build_ns) / 1000:.2f} us, exporting them (JSON lines) "
          f"{statistics.median(export_ns) / 1000:.2f} us ({built / kvt_requests:.0f} span(s) "
          f"each; failures {recorder.failures}, dropped {recorder.dropped + tel.dropped_spans})")
    met = extra_us["request"] <= AIM_REQUEST_US and extra_us["step"] <= AIM_STEP_US
    print(f"aim: extra <= {AIM_REQUEST_US:g} us/request, <= {AIM_STEP_US:g} us/step: "
          f"{'MET' if met else 'NOT MET'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro", action="store_true",
                    help="only the in-process scheduler-side measurement (no engines)")
    ap.add_argument("--micro-steps", type=int, default=60000, help="--micro: steps timed")
    ap.add_argument("--micro-requests", type=int, default=6000, help="--micro: requests timed")
    ap.add_argument("--micro-blocks", type=int, default=30,
                    help="--micro: alternating blocks (medians are over these)")
    ap.add_argument("--micro-gc-unfrozen", action="store_true",
                    help="--micro: leave the start-up heap to the GC (vLLM's EngineCore freezes it)")
    ap.add_argument("--modes", default="pull", help="comma-separated: pull, push")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    if args.micro:
        micro(args.micro_steps, args.micro_requests, args.micro_blocks,
              gc_freeze=not args.micro_gc_unfrozen)
        return 0
    root = Path(args.workdir or tempfile.mkdtemp(prefix="kvtune-bench-connectors-"))
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        results = {c: run_pair(mode, c, root / mode / c, args.requests, args.prompt_tokens,
                               args.max_tokens) for c in CONNECTORS}
        print(f"\nmode={mode} requests={args.requests} prompt_tokens={args.prompt_tokens} "
              f"max_tokens={args.max_tokens}")
        print(f"{'connector':<8} {'ttft p50 ms':>12} {'ttft p90 ms':>12} {'step p50 ms':>12} "
              f"{'step p90 ms':>12}")
        med: dict[str, tuple[float, float]] = {}
        for c, s in results.items():
            ttft = [x.ttft_ms for x in s]
            step = [x.step_ms for x in s]
            med[c] = (statistics.median(ttft), statistics.median(step))
            print(f"{c:<8} {med[c][0]:>12.2f} {_p(ttft, 90):>12.2f} {med[c][1]:>12.2f} "
                  f"{_p(step, 90):>12.2f}")
        print(f"ratio kvtune/vllm: ttft p50 {med['kvtune'][0] / med['vllm'][0]:.3f}, "
              f"decode step p50 {med['kvtune'][1] / med['vllm'][1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
