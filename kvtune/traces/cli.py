"""``kvtune traces summary SOURCE...``: span counts by service and name, and clock offsets."""
from __future__ import annotations

import argparse

from kvtune.traces.summary import summarize


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("traces", help="read span files or Tempo")
    sub = parser.add_subparsers(dest="traces_command", metavar="ACTION")
    sub.required = True
    p = sub.add_parser("summary", help="span counts by service and name; clock offsets")
    p.add_argument("source", nargs="+",
                   help="span files (.jsonl/.json, .gz), globs, directories, or "
                        "tempo+http://HOST:PORT?q=<TraceQL>[&since=1h | &start=&end=][&limit=]")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed records (reported)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(summarize(args.source, skip_bad=args.skip_bad).format())
    return 0
