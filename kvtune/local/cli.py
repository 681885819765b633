"""``kvtune local``: the tiny model and a real vLLM pair on this machine (CPU).

``kvtune local model --dir DIR`` builds the tiny model; ``kvtune local run --mode MODE --workdir
DIR`` starts a prefill/decode pair, drives a multi-turn workload through it and prints a summary.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from kvtune.vllm_pd import CONNECTOR_FAMILIES, MODES


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("local", help="tiny model and a real vLLM P/D pair on this machine")
    sub = p.add_subparsers(dest="local_command", metavar="ACTION")
    sub.required = True

    m = sub.add_parser("model", help="build (or re-use) the tiny random-weight model")
    m.add_argument("--dir", required=True, help="output directory")
    m.add_argument("--arch", default="qwen3", choices=("qwen3", "llama"))
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=run_model)

    r = sub.add_parser("run", help="start a P/D pair, drive a multi-turn workload, stop")
    r.add_argument("--mode", required=True, choices=MODES)
    r.add_argument("--connector", default="kvtune", choices=CONNECTOR_FAMILIES)
    r.add_argument("--workdir", required=True, help="server logs and caches go here")
    r.add_argument("--spans-dir", help="kvtune connectors write OTLP-JSON span lines here")
    r.add_argument("--results", help="write per-request results as JSON lines here")
    r.add_argument("--conversations", type=int, default=6)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies arrival and think-time waits (0: no waits)")
    r.add_argument("--ttl-s", type=float, help="decoder_kv_blocks_ttl (bidirectional)")
    r.add_argument("--recompute-threshold", type=int, help="kv_recompute_threshold (bidirectional)")
    r.set_defaults(func=run)


def run_model(args: argparse.Namespace) -> int:
    from kvtune.local.tiny_model import make_tiny_model
    print(make_tiny_model(args.dir, arch=args.arch, seed=args.seed))
    return 0


def run(args: argparse.Namespace) -> int:
    from kvtune.local.session import run_local_session
    from kvtune.local.workload import WorkloadConfig
    summary, _ = run_local_session(
        args.mode, workdir=args.workdir, connector=args.connector, spans_dir=args.spans_dir,
        config=WorkloadConfig(n_conversations=args.conversations, seed=args.seed),
        time_scale=args.time_scale, ttl_s=args.ttl_s, recompute_threshold=args.recompute_threshold,
        results_path=args.results)
    print(json.dumps(asdict(summary), indent=2))
    return 0 if summary.n_failed == 0 else 1
