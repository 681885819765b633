"""The named share of TTFT (median, p10) per serving mode, from a directory of spans.

    python bench/attribution.py examples/verify-shaped/tune/spans

TTFT is the router's ``kv.request`` began -> the decode's first ``kv.decode_start`` ended; each
instant is given to one span (``kvtune.analysis.attribution``). Works on traces with and without
the router's phase spans (``kv.route``, ``kv.prefill_leg``, ``kv.handoff``, ``kv.decode_leg``):
without them, the legs' hops and the API servers' intake are unnamed.
"""
from __future__ import annotations

import argparse
import sys

from kvtune import spans as S
from kvtune import traces
from kvtune.analysis.attribution import (named_shares, phase_shares, request_attribution,
                                         share_summary, summed_span_shares)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spans", help="OTLP-JSON span file, directory or glob")
    args = ap.parse_args(argv)
    df = traces.load(args.spans)
    table = request_attribution(df)
    if table.empty:
        print("no request with a router kv.request and a decode kv.decode_start", file=sys.stderr)
        return 1
    router = {p.value for p in S.ROUTER_PHASES} & set(df["name"].astype("object"))
    print(f"{len(df)} spans, {len(table)} requests; router phase spans: "
          f"{', '.join(sorted(router)) or 'none'}")
    print(f"{'mode':<14} {'n':>4} {'named p50':>10} {'named p10':>10} {'unnamed p50 ms':>15} "
          f"{'TTFT p50 ms':>12}  largest unnamed gap (most time)")
    for mode, s in sorted(named_shares(table).items()):
        print(f"{mode:<14} {s.n_requests:>4} {s.named_share_p50:>10.1%} {s.named_share_p10:>10.1%} "
              f"{s.unnamed_ms_p50:>15.2f} {s.ttft_ms_p50:>12.2f}  {s.gap_after} -> {s.gap_before}")
    summary = share_summary(phase_shares(df))
    panel = summed_span_shares(df).set_index(["mode", "phase"])["share"]
    print("\nshare of TTFT per phase: median over the requests where it appears (each instant "
          "given to one span),\nits share of the summed TTFT, and the Grafana panel's share "
          "(whole span durations summed: nested spans counted in full)")
    print(f"{'mode':<14} {'phase':<20} {'n':>4} {'median':>8} {'total':>8} {'panel':>8}")
    for row in summary.itertuples(index=False):
        p = panel.get((row.mode, row.phase))
        print(f"{row.mode:<14} {row.phase:<20} {row.n_requests:>4} {row.share_p50:>8.1%} "
              f"{row.share_total:>8.1%} {'-' if p is None else f'{p:.1%}':>8}")
    for (mode, phase), p in panel.items():
        if not ((summary["mode"] == mode) & (summary["phase"] == phase)).any():
            print(f"{mode:<14} {phase:<20} {0:>4} {'-':>8} {'-':>8} {p:>8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
