"""``kvtune recommend SOURCE --out DIR``: parse, call
:func:`kvtune.recommend.pipeline.recommend_source`, print the three values."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "recommend", help="recommend threshold, TTL and mode from a trace; write vLLM/router files",
        description="Fit the fabric's floor and bandwidth, the prefill cost and the workload from "
                    "a trace, recommend kv_recompute_threshold, decoder_kv_blocks_ttl and the "
                    "transfer mode, and write the kv-transfer configs, vllm serve args, router.yaml, "
                    "recommendation.json and REPORT.md into --out (atomically).")
    p.add_argument("source", nargs="+", help="span files (.jsonl/.json, .gz), globs, directories, "
                                             "or tempo+http://HOST:PORT?...")
    p.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    p.add_argument("--model", default=None,
                   help="model name or path for the serve args (default: the spans' kv.model; "
                        "else the placeholder MODEL, which REPORT.md asks you to replace)")
    p.add_argument("--geometry", default=None, metavar="HF_CONFIG_JSON",
                   help="Hugging Face config.json of the model (KV bytes per token); default: "
                        "kv.bytes / kv.tokens of the traced transfers")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (with --geometry)")
    p.add_argument("--hbm-budget-gb", type=float, default=None,
                   help="decode HBM per rank for retained conversations, GB (default 10)")
    p.add_argument("--no-early-decode", action="store_true",
                   help="the decode cannot be chosen before the prefill (rules out push)")
    p.add_argument("--fabric", default=None, help="fabric whose transfers the floor is fitted on")
    p.add_argument("--prefill-instances", type=int, default=1)
    p.add_argument("--connector", choices=("kvtune", "vllm"), default="kvtune",
                   help="kvtune's instrumented connectors (default) or vLLM's own NIXL connectors")
    p.add_argument("--prefill-url", default=None, help="prefill URL for router.yaml "
                                                       "(default a PREFILL_HOST placeholder)")
    p.add_argument("--decode-url", default=None, help="decode URL for router.yaml "
                                                      "(default a DECODE_HOST placeholder)")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed records (reported)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtune.recommend.pipeline import recommend_source
    from kvtune.recommend.tuning import DEFAULT_HBM_BUDGET_GB

    geometry = None
    if args.geometry:
        from kvtune.geometry import from_hf_config

        geometry = from_hf_config(args.geometry, tp_size=args.tp_size)
    source = args.source[0] if len(args.source) == 1 else list(args.source)
    export_options = {"connector": args.connector}
    if args.prefill_url:
        export_options["prefill_url"] = args.prefill_url
    if args.decode_url:
        export_options["decode_url"] = args.decode_url
    tuning, out = recommend_source(
        source, args.out, model=args.model, geometry=geometry,
        hbm_budget_gb=args.hbm_budget_gb if args.hbm_budget_gb is not None else DEFAULT_HBM_BUDGET_GB,
        early_decode_ok=not args.no_early_decode, fabric=args.fabric,
        prefill_instances=args.prefill_instances, skip_bad=args.skip_bad, overwrite=args.force,
        export_options=export_options)
    for r in (tuning.threshold, tuning.ttl):
        print(f"{r.name:24s} {r.value} {r.unit}  (range {r.range[0]} .. {r.range[1]})")
    print(f"{'mode':24s} {tuning.mode.value}  (runner-up {tuning.mode.range[1]})")
    for f in tuning.findings:
        print(f"[{f.severity}] {f.code}: {f.message}")
    print(f"written: {out}")
    return 0
