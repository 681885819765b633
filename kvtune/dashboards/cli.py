"""``kvtune dashboards export --out DIR [--datasource-uid UID]``."""
from __future__ import annotations

import argparse

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


def run(args: argparse.Namespace) -> int:
    for path in export_dashboards(args.out, datasource_uid=args.datasource_uid):
        print(path)
    return 0
