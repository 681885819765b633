"""Overhead of the fabric probe, measured in one run: median transfer latency at the smallest size
with kvtune's spans on, with them off, and for a bare NIXL loop that uses no kvtune code at all.

One target runs in a child process, writing its ``kv.notify`` spans to a JSON-lines file (it makes
them when the initiator pauses, never while transfers are timed); one initiator session moves the
same blocks for all three variants (separate targets would differ in what sits in the CPU caches,
which at this size shows up as a 15% difference between two identical variants). Rounds interleave
the variants in a shuffled order so that load from other work on a shared host falls on all alike:

- ``spans off``: ``InitiatorSession.transfer``, no initiator spans;
- ``spans on``: the same, then ``kv.descriptor_setup``/``kv.rdma`` for each transfer exported through
  ``kvtune.telemetry`` (batch processor, JSON-lines file) and flushed, as ``run_probe`` does;
- ``bare NIXL``: ``make_prepped_xfer`` -> ``transfer`` -> busy ``check_xfer_state`` -> release on
  the same prepared descriptor lists, timed with ``time.perf_counter_ns``.

Latency is descriptor setup + post -> completion (what the probe fits), and post -> completion
alone. Prints medians and the ratios (aims: spans on / off <= 1.05, kvtune / bare <= 1.10).

    .venv/bin/python bench/probe.py --model qwen3-32b --tokens 16 --rounds 20 --per-round 50
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from kvtune import telemetry
from kvtune.geometry import PRESETS, preset
from kvtune.probe import tracing
from kvtune.probe.initiator import InitiatorSession
from kvtune.probe.target import spawn_local_target

VARIANTS = ("spans off", "spans on", "bare NIXL")


def bare_transfer(session: InitiatorSession, point, op: str) -> tuple[float, float]:
    """One transfer with NIXL's API only; (setup+rdma ms, rdma ms)."""
    agent = session.agent
    t0 = time.perf_counter_ns()
    handle = agent.make_prepped_xfer(op, point.local_dlist, point.local_idx,
                                     point.remote_dlist, point.remote_idx)
    t1 = time.perf_counter_ns()
    state = agent.transfer(handle, b"bare")
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    t2 = time.perf_counter_ns()
    if state != "DONE":
        raise RuntimeError(f"bare NIXL transfer ended in {state}")
    handle.release()
    return (t2 - t0) / 1e6, (t2 - t1) / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-32b", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int, default=16, help="the sweep's smallest size")
    ap.add_argument("--layout", default="per_block", choices=("per_block", "merged"))
    ap.add_argument("--op", default="READ", choices=("READ", "WRITE"))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=50, help="transfers per variant per round")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    g = preset(args.model)
    blocks = g.blocks(args.tokens)
    tmp = Path(tempfile.mkdtemp(prefix="kvtune-bench-probe-"))
    tel = telemetry.setup("probe", json_path=tmp / "initiator.jsonl")  # batch processor, as in use
    target = spawn_local_target(spans_path=tmp / "target.jsonl", fabric="bench")
    rng = random.Random(args.seed)
    samples = {v: ([], []) for v in VARIANTS}
    try:
        with InitiatorSession((target.host, target.port), g, blocks, tracer=tel.tracer,
                              fabric="bench") as sess:
            point = sess.prepare(args.tokens, args.layout)
            for _ in range(20):  # warm up both paths
                sess.transfer(args.op, point, iteration=0, warmup=True, run_id="bench-warm")
                bare_transfer(sess, point, args.op)
            bar = tqdm(total=args.rounds * len(VARIANTS) * args.per_round, unit="xfer", file=sys.stderr)
            for rnd in range(args.rounds):
                order = list(VARIANTS)
                rng.shuffle(order)
                for variant in order:
                    crit, rdma = samples[variant]
                    if variant == "bare NIXL":
                        for _ in range(args.per_round):
                            c, r = bare_transfer(sess, point, args.op)
                            crit.append(c)
                            rdma.append(r)
                    else:
                        recs = [sess.transfer(args.op, point, iteration=i, warmup=False,
                                              run_id=f"bench{rnd}") for i in range(args.per_round)]
                        if variant == "spans on":  # as run_probe does after each block
                            tracing.emit_transfers(tel.tracer, sess.info, recs)
                            tracing.flush_quietly(tel.force_flush)
                        crit += [r.critical_ms for r in recs]
                        rdma += [r.rdma_ms for r in recs]
                    bar.update(args.per_round)
            bar.close()
            sess.release(point)
    finally:
        tel.shutdown()
        target.stop()

    med = {v: (statistics.median(c), statistics.median(r)) for v, (c, r) in samples.items()}
    print(f"probe overhead: {args.model}, {args.tokens} tokens = {g.transfer_bytes(args.tokens)} B, "
          f"{g.descriptor_count(args.tokens, args.layout)} descriptors ({args.layout}), {args.op}, "
          f"{args.rounds} rounds x {args.per_round} per variant")
    print(f"{'variant':<10} {'setup+rdma p50 ms':>18} {'rdma p50 ms':>12} {'n':>6}")
    for v in VARIANTS:
        print(f"{v:<10} {med[v][0]:>18.4f} {med[v][1]:>12.4f} {len(samples[v][0]):>6}")
    for label, (a, b) in (("spans on / spans off", ("spans on", "spans off")),
                          ("kvtune (spans on) / bare NIXL", ("spans on", "bare NIXL")),
                          ("kvtune (spans off) / bare NIXL", ("spans off", "bare NIXL"))):
        print(f"{label:<32} setup+rdma {med[a][0] / med[b][0]:.3f}   rdma {med[a][1] / med[b][1]:.3f}")
    print(f"spans written to {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
