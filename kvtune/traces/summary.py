"""A short account of a trace source: span counts by service and name, hosts, clock offsets."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from kvtune.traces.clocks import ClockOffsets, estimate_offsets
from kvtune.traces.loader import SourceArg, load


@dataclass(frozen=True)
class TraceSummary:
    """Counts of spans per (service, name), per host, the clock offsets and what was skipped."""

    span_count: int
    trace_count: int
    counts: tuple[tuple[str, str, int], ...]
    """(service, span name, spans), by service then descending count."""
    hosts: tuple[tuple[str, int], ...]
    clock: ClockOffsets | None
    skipped: tuple[tuple[str, int | None, str], ...]
    sources: tuple[str, ...]

    def format(self) -> str:
        lines = [f"{self.span_count} spans in {self.trace_count} traces from "
                 f"{len(self.sources)} source(s)"]
        if self.counts:
            width = max(len(s) for s, _, _ in self.counts)
            lines.append("")
            lines.append(f"{'service':<{width}}  {'span':<24} {'count':>9}")
            for service, name, count in self.counts:
                lines.append(f"{service:<{width}}  {name:<24} {count:>9}")
        if self.hosts:
            lines.append("")
            lines.append("host clock offsets (ns subtracted; reference "
                         f"{self.clock.reference_host if self.clock else '-'}, "
                         f"{self.clock.n_constraints if self.clock else 0} causal pairs):")
            offsets = self.clock.offsets_ns if self.clock else {}
            for host, n in self.hosts:
                lines.append(f"  {host or '(no host.name)'}: {n} spans, offset "
                             f"{offsets.get(host, 0)} ns")
            if self.clock:
                for (a, b), (lo, hi) in sorted(self.clock.bounds_ns.items()):
                    lines.append(f"  bound: {lo if lo is not None else '-inf'} <= "
                                 f"offset({b}) - offset({a}) <= {hi if hi is not None else 'inf'} ns")
                if not self.clock.consistent:
                    lines.append("  warning: the causal bounds contradict each other")
        if self.skipped:
            lines.append("")
            lines.append(f"skipped {len(self.skipped)} bad record(s); first: "
                         f"{self.skipped[0][0]}:{self.skipped[0][1]}: {self.skipped[0][2]}")
        return "\n".join(lines)


def summarize_frame(df: pd.DataFrame) -> TraceSummary:
    """The summary of an already loaded spans DataFrame (clock offsets re-estimated on it)."""
    counts = (df.groupby(["service", "name"], sort=False).size().reset_index(name="n")
              .sort_values(["service", "n", "name"], ascending=[True, False, True]))
    hosts = df["host"].value_counts()
    return TraceSummary(
        span_count=len(df), trace_count=int(df["trace_id"].nunique()),
        counts=tuple((str(r.service), str(r.name), int(r.n)) for r in counts.itertuples()),
        hosts=tuple((str(h), int(n)) for h, n in hosts.items()),
        clock=estimate_offsets(df) if len(df) else None,
        skipped=tuple(df.attrs.get("skipped", ())), sources=tuple(df.attrs.get("sources", ())))


def summarize(source: SourceArg, *, skip_bad: bool = False) -> TraceSummary:
    """Loads ``source`` without clock correction and summarizes it (offsets estimated on raw times)."""
    return summarize_frame(load(source, skip_bad=skip_bad, correct_clocks=False))
