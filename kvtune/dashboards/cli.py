"""``kvtune dashboards export --out DIR [--datasource-uid UID]`` and
``kvtune dashboards check SOURCE... [--mode MODE] [--strict]``."""
from __future__ import annotations

import argparse
import sys

from kvtune.dashboards.check import check_source
from kvtune.dashboards.export import export_dashboards


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("dashboards", help="Grafana dashboards for kvtune's spans in Tempo")
    sub = p.add_subparsers(dest="dashboards_command", metavar="ACTION")
    sub.required = True
    e = sub.add_parser("export", help="write the dashboards' JSON for a manual Grafana import")
    e.add_argument("--out", required=True, help="directory to write the dashboards to")
    e.add_argument("--datasource-uid", default=None,
                   help="uid of the Tempo datasource the DS_TEMPO variable starts on "
                        "(default: Grafana's default Tempo datasource)")
    e.set_defaults(func=run)
    c = sub.add_parser("check", help="run every panel's TraceQL over spans files (no Grafana needed) "
                                     "and print the rows each panel would show")
    c.add_argument("source", nargs="+", help="span files, directories or globs (kvtune.traces.load)")
    c.add_argument("--mode", action="append", default=None,
                   help="restrict to a transfer mode, as the dashboard's mode variable (repeatable)")
    c.add_argument("--strict", action="store_true", help="exit 1 when a phase panel would be empty")
    c.set_defaults(func=run_check)


def run(args: argparse.Namespace) -> int:
    for path in export_dashboards(args.out, datasource_uid=args.datasource_uid):
        print(path)
    return 0


def run_check(args: argparse.Namespace) -> int:
    result = check_source(args.source, mode=args.mode)
    print(result.table())
    if result.empty_phases:
        print(f"phases with no data: {', '.join(result.empty_phases)}", file=sys.stderr)
        return 1 if args.strict else 0
    return 0
