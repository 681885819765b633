"""``python -m kvtune.probe ...`` is ``kvtune probe ...``."""
from __future__ import annotations

import sys

from kvtune.cli import main

if __name__ == "__main__":
    sys.exit(main(["probe", *sys.argv[1:]]))
