"""The router's share of a request's time, as traced: one HTTP hop between the router and an
instance, and the router's own intake work.

- **hop**: half the median *handoff* of the legs whose decode began after the prefill ended (pull,
  and bidirectional's forward leg): the prefill's answer -> the decode's scheduler saw the decode
  leg, i.e. the answer's way back to the router and the decode leg's way out (two hops, the
  router's work between them included).
- **router intake**: the router's ``kv.request`` began -> the prefill's scheduler saw the prefill
  leg, minus one hop.

On the local pair both are milliseconds (two API servers and the router on two cores); a
simulator preset built for a datacenter LAN assumes a fraction of one. The mode comparison
replays these as measured (``kvtune.sim``'s ``overheads.hop_ms`` and ``overheads.router_ms``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvtune import spans as S
from kvtune.analysis.modes import spans_named
from kvtune.analysis.stalls import handoffs_ms


@dataclass(frozen=True)
class RouterHops:
    hop_ms: float | None
    """One router <-> instance hop (None: no pull leg traced)."""
    router_ms: float | None
    """The router's intake before the prefill leg (None: no ``kv.request`` span, or no hop)."""
    n_handoffs: int
    n_intakes: int

    def as_dict(self) -> dict[str, float | int | None]:
        return {"hop_ms": self.hop_ms, "router_ms": self.router_ms,
                "n_handoffs": self.n_handoffs, "n_intakes": self.n_intakes}


def intakes_ms(spans: pd.DataFrame) -> pd.Series:
    """Per trace with a router's ``kv.request`` and the prefill's ``kv.queue``: the request began
    -> the prefill's scheduler saw its leg, ms."""
    if not len(spans) or not {"name", "trace_id", S.ROLE} <= set(spans.columns):
        return pd.Series(dtype=float)
    req = spans_named(spans, S.SpanName.REQUEST.value)
    que = spans_named(spans, S.SpanName.QUEUE.value, S.Role.PREFILL.value)
    if req.empty or que.empty:
        return pd.Series(dtype=float)
    gap = (que.groupby("trace_id")["start_ns"].min()
           - req.groupby("trace_id")["start_ns"].min()).dropna().astype(float) / 1e6
    return gap[gap >= 0]


def router_hops(spans: pd.DataFrame) -> RouterHops:
    """:class:`RouterHops` of ``spans`` (``kvtune.traces.load``'s frame)."""
    hand = handoffs_ms(spans)
    hop = float(np.median(hand)) / 2.0 if len(hand) else None
    intake = intakes_ms(spans)
    router = (max(0.0, float(np.median(intake)) - hop) if hop is not None and len(intake)
              else None)
    return RouterHops(hop, router, int(len(hand)), int(len(intake)))
