"""Regenerate the committed dashboards (dashboards/*.json) from kvtune.dashboards.generator.

    .venv/bin/python scripts/make_dashboards.py          # write
    .venv/bin/python scripts/make_dashboards.py --check  # exit 1 if the committed JSON is stale
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtune.dashboards.generator import dashboards, render

DASHBOARDS_DIR = Path(__file__).resolve().parent.parent / "dashboards"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for name, dashboard in dashboards().items():
        path = DASHBOARDS_DIR / name
        text = render(dashboard)
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if args.check and stale:
        print("stale: " + ", ".join(str(p) for p in stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
