"""The ``kvtune`` command: subcommands are registered by each package's ``cli.register``.

A package whose import fails (a missing optional dependency) still gets a subcommand that says what
is missing instead of breaking the whole CLI.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from kvtune.errors import KvtuneError

# (subcommand, module with register(subparsers)) — each module adds its own parser(s).
COMMAND_MODULES: tuple[tuple[str, str], ...] = (
    ("probe", "kvtune.probe.cli"),
    ("analyze", "kvtune.analysis.cli"),
    ("recommend", "kvtune.recommend.cli"),
    ("tune", "kvtune.tune.cli"),
    ("lab", "kvtune.tune.lab_cli"),
    ("router", "kvtune.router.cli"),
    ("sim", "kvtune.sim.cli"),
    ("dashboards", "kvtune.dashboards.cli"),
    ("traces", "kvtune.traces.cli"),
    ("local", "kvtune.local.cli"),
    ("verify", "kvtune.verify.cli"),
    ("doctor", "kvtune.connectors.compat"),
)


def build_parser(modules: Sequence[tuple[str, str]] = COMMAND_MODULES) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtune", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in modules:
        try:
            mod = importlib.import_module(module)
            mod.register(sub)
        except ImportError as exc:  # optional part missing: keep the rest of the CLI usable
            p = sub.add_parser(name, help=f"(unavailable: {exc})")
            p.set_defaults(func=_unavailable(name, exc))
    return parser


def _unavailable(name: str, exc: Exception):
    def run(args: argparse.Namespace) -> int:
        print(f"kvtune {name}: unavailable here: {exc}", file=sys.stderr)
        return 2
    return run


def main(argv: Sequence[str] | None = None,
         modules: Sequence[tuple[str, str]] = COMMAND_MODULES) -> int:
    parser = build_parser(modules)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KvtuneError as exc:
        print(f"kvtune {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
