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
from kvtune.analysis.attribution import named_shares, phase_shares, request_attribution


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
    shares = phase_shares(df)
    print("\nmedian share of TTFT per phase (requests where it appears) and total share:")
    tot = shares.groupby(["mode", "phase"])["ms"].sum()
    for mode, g in shares.groupby("mode"):
        all_ms = tot.loc[mode].sum()
        med = g.groupby("phase")["share"].median().sort_values(ascending=False)
        print(f"  {mode}: " + ", ".join(f"{p} {v:.1%} ({tot.loc[(mode, p)] / all_ms:.1%})"
                                        for p, v in med.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
