"""``python -m kvtune.router``: the ``kvtune router`` command on its own."""
from __future__ import annotations

import argparse
import logging
import sys

from kvtune.errors import KvtuneError
from kvtune.router import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtune.router", description=cli.__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    cli.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return cli.run(args)
    except KvtuneError as exc:
        print(f"kvtune router: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
