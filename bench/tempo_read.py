"""The Tempo reader's own cost per trace: paged reads of the recorded stand-in on 127.0.0.1.

Serves ``tests/fixtures/traces/tempo_real`` (94 traces, 821 spans, as Tempo 2.10.8 answered) with
``tests/tempo_standin.py`` and reads the last hour ``--repeat`` times in one-minute pages, with and
without a cursor: traces and spans read per second. The server answers from memory, so this is the
client's floor (one HTTP GET per trace, the decode, the spool's write and fsync per page), not a
real Tempo's trace lookup, which a fleet's read adds on top.

    .venv/bin/python bench/tempo_read.py [--repeat 20]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tempo_standin import Recording, serve

from kvtune import traces


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    rec = Recording.load()
    with serve(rec) as (host, _):
        for label in ("no cursor", "cursor"):
            n_traces = n_spans = 0
            t0 = time.perf_counter()
            for _ in range(args.repeat):
                with tempfile.TemporaryDirectory() as tmp:
                    cursor = f"&cursor={tmp}/c.json" if label == "cursor" else ""
                    df = traces.load(f"tempo+http://{host}?q=%7B%7D&since=1h&page=1m{cursor}",
                                     correct_clocks=False, progress=False)
                (read,) = df.attrs["tempo_reads"]
                n_traces += read.traces_fetched
                n_spans += read.spans_read
            dt = time.perf_counter() - t0
            print(f"{label:10s}: {args.repeat} reads of 60 pages, {n_traces} traces, {n_spans} spans "
                  f"in {dt:.2f} s: {n_traces / dt:,.0f} traces/s, {n_spans / dt:,.0f} spans/s, "
                  f"{dt / n_traces * 1e3:.2f} ms a trace")


if __name__ == "__main__":
    main()
