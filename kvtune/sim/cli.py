"""``kvtune sim``: simulate a deployment's traffic in one mode and write spans + request table."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtune.vllm_pd import MODES


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim", help="what-if simulation of push / pull / bidirectional",
                              description=__doc__)
    p.add_argument("--preset", default="public-h200-qwen3-32b", help="deployment preset")
    p.add_argument("--mode", choices=MODES, default="push")
    p.add_argument("--qps", type=float, help="requests per second (Poisson)")
    p.add_argument("--users", type=int, help="closed loop: concurrent users instead of --qps")
    p.add_argument("--duration-s", type=float, help="arrivals for this long (simulated seconds)")
    p.add_argument("--prompt-tokens", help="first-turn prompt length: N or KIND:P1,P2")
    p.add_argument("--output-tokens", help="output length: N or KIND:P1,P2")
    p.add_argument("--turns", help="turns per conversation: N or KIND:P1,P2")
    p.add_argument("--new-tokens", help="tokens a later turn adds: N or KIND:P1,P2")
    p.add_argument("--think-time-s", help="gap between turns: N or KIND:P1,P2")
    p.add_argument("--prefill-instances", type=int)
    p.add_argument("--decode-instances", type=int)
    p.add_argument("--ttl-s", type=float, help="decoder KV retention TTL (bidirectional)")
    p.add_argument("--threshold-tokens", type=int, help="kv_recompute_threshold (bidirectional)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--replay", help="requests to replay: a CSV (arrival_s, prompt_tokens, output_tokens"
                                    " [, conversation_id]) or span files (kv.request spans)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-spans", action="store_true", help="skip writing spans.jsonl")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtune.sim.outdir import SUMMARY_FILE, simulate_to_dir
    from kvtune.sim.presets import configure
    from kvtune.sim.workload import load_replay
    requests = load_replay(args.replay) if args.replay else None
    config = configure(
        args.preset, mode=args.mode, qps=args.qps, users=args.users, duration_s=args.duration_s,
        prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, turns=args.turns,
        new_tokens=args.new_tokens, think_time_s=args.think_time_s,
        prefill_instances=args.prefill_instances, decode_instances=args.decode_instances,
        ttl_s=args.ttl_s, threshold_tokens=args.threshold_tokens, prefix_caching=args.prefix_caching,
        requests=requests, seed=args.seed)
    simulate_to_dir(config, args.out, spans=not args.no_spans, progress=True)
    json.dump(json.loads((Path(args.out) / SUMMARY_FILE).read_text(encoding="utf-8")), sys.stdout,
              indent=2)
    sys.stdout.write("\n")
    return 0
