"""``kvtune analyze SOURCE``: parse, call :func:`kvtune.analysis.summary.analyze_source`, print."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "analyze", help="transfers table, floor/bandwidth fit, prefill cost and workload of a trace",
        description="Load spans and print the per-phase transfer summary, the floor/bandwidth fit "
                    "per fabric (with 95%% bootstrap intervals), the prefill cost and the workload.")
    p.add_argument("source", nargs="+", help="span files (.jsonl/.json, .gz), globs, directories, "
                                             "or tempo+http://HOST:PORT?...")
    p.add_argument("--transfers-csv", default=None, metavar="PATH",
                   help="also write the transfers table (one row per KV movement) as CSV")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed records (reported)")
    p.add_argument("--n-boot", type=int, default=200, help="bootstrap resamples (default 200)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtune.analysis.summary import analyze_source

    source = args.source[0] if len(args.source) == 1 else list(args.source)
    print(analyze_source(source, transfers_csv=args.transfers_csv, skip_bad=args.skip_bad,
                         n_boot=args.n_boot).format())
    return 0
