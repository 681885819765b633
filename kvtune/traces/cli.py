"""``kvtune traces summary SOURCE...``: span counts by service and name, and clock offsets.
``kvtune traces fleet TEMPO_URL``: the range's totals and ``kv.rdma`` time per size from Tempo's
metrics, no trace fetched (``--traces``: also read the traces and set the trace-based fabric fit
beside the one from Tempo's medians)."""
from __future__ import annotations

import argparse
import sys

from kvtune.traces.summary import summarize
from kvtune.traces.tempo_metrics import fleet_summary
from kvtune.traces.tempo_rdma import compare_with_traces


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
    f = sub.add_parser("fleet", help="a Tempo range's reuse/retention outcomes, kv.rdma bytes and "
                                     "kv.rdma time per size (with the fabric fit from its medians) "
                                     "from Tempo's TraceQL metrics (no trace fetched)")
    f.add_argument("source", help="tempo+http://HOST:PORT[?since=1d | ?start=&end=]")
    f.add_argument("--traces", action="store_true",
                   help="also read the range's traces and print the trace-based fabric fit "
                        "beside the one from Tempo's medians")
    f.set_defaults(func=run_fleet)


def run_fleet(args: argparse.Namespace) -> int:
    fleet = fleet_summary(args.source)
    print(fleet.summary())
    if args.traces and fleet.rdma is not None and not fleet.rdma.refused:
        print(compare_with_traces(args.source, fleet.rdma))
    for finding in fleet.findings()[1:]:
        print(f"[{finding['severity']}] {finding['code']}: {finding['message']}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    print(summarize(args.source, skip_bad=args.skip_bad).format())
    return 0
