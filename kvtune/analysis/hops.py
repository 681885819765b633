"""The router's share of a request's time, as traced: one HTTP hop between the router and an
instance, and the router's own intake work.

- **hop**: half the median *handoff* of the legs whose decode began after the prefill ended (pull,
  and bidirectional's forward leg): the prefill's answer -> the decode's scheduler saw the decode
  leg, i.e. the answer's way back to the router and the decode leg's way out (two hops, the
  router's work between them included).
- **router intake**: the router's ``kv.request`` began -> the prefill's scheduler saw the prefill
  leg, minus one hop.

Both grow with the prompt where the legs carry it (request bodies, the API servers' tokenisation
and validation): each is fitted as a line in the prompt's kilotokens (robust, slopes >= 0) when
the traced prompts span at least :data:`MIN_SPAN_KILOTOKENS`, else as its median. The hop and
the router's work are the intercepts; the router intake's slope is one API server's intake per
kilotoken (both legs pay it), what the handoff's slope has beyond that is the answer's way back.

On the local pair both are milliseconds (two API servers and the router on two cores); a
simulator preset built for a datacenter LAN assumes a fraction of one. The mode comparison
replays these as measured (``kvtune.sim``'s ``overheads.hop_ms``, ``overheads.router_ms``,
``overheads.tokenize_per_kilotoken_ms`` and ``overheads.handoff_per_kilotoken_ms``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvtune import spans as S
from kvtune.analysis.fit import nonneg_irls
from kvtune.analysis.modes import spans_named
from kvtune.analysis.stalls import handoffs_ms

MIN_SPAN_KILOTOKENS = 0.5
"""Traced prompts must span this many kilotokens for a per-kilotoken slope to be fitted."""
MIN_LINE_POINTS = 4


@dataclass(frozen=True)
class RouterHops:
    hop_ms: float | None
    """One router <-> instance hop (None: no pull leg traced)."""
    router_ms: float | None
    """The router's intake before the prefill leg (None: no ``kv.request`` span, or no hop)."""
    n_handoffs: int
    n_intakes: int
    tokenize_per_kilotoken_ms: float = 0.0
    """One API server's intake of a leg per 1000 prompt tokens (the router intake's slope)."""
    handoff_per_kilotoken_ms: float = 0.0
    """Pull: what the prefill's answer -> the decode leg's arrival adds per 1000 prompt tokens
    beyond the decode's API server's intake (the handoff's slope less the one above)."""

    def as_dict(self) -> dict[str, float | int | None]:
        return {"hop_ms": self.hop_ms, "router_ms": self.router_ms,
                "n_handoffs": self.n_handoffs, "n_intakes": self.n_intakes,
                "tokenize_per_kilotoken_ms": self.tokenize_per_kilotoken_ms,
                "handoff_per_kilotoken_ms": self.handoff_per_kilotoken_ms}


def prompt_kilotokens(spans: pd.DataFrame) -> pd.Series:
    """Per trace with a router's ``kv.request``: its prompt, in thousands of tokens."""
    req = spans_named(spans, S.SpanName.REQUEST.value) if len(spans) else spans
    if req.empty or S.PROMPT_TOKENS not in req.columns:
        return pd.Series(dtype=float)
    kt = pd.to_numeric(req[S.PROMPT_TOKENS], errors="coerce").astype(float) / 1e3
    return pd.Series(kt.to_numpy(), index=req["trace_id"].to_numpy()).groupby(level=0).first().dropna()


def per_kilotoken_line(ms: pd.Series, kilotokens: pd.Series) -> tuple[float, float]:
    """(intercept ms, slope ms per kilotoken) of ``ms`` against the prompt (both per trace): a robust
    line with non-negative terms when the prompts span :data:`MIN_SPAN_KILOTOKENS`, else
    (median, 0)."""
    both = pd.concat([ms.rename("ms"), kilotokens.rename("kt")], axis=1, join="inner").dropna()
    if len(both) >= MIN_LINE_POINTS and float(both["kt"].max() - both["kt"].min()) >= MIN_SPAN_KILOTOKENS:
        x = np.column_stack([np.ones(len(both)), both["kt"].to_numpy(float)])
        beta, _ = nonneg_irls(x, both["ms"].to_numpy(float), nonneg=(0, 1))
        return float(beta[0]), float(beta[1])
    return float(np.median(ms)), 0.0


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
    intake = intakes_ms(spans)
    kt = prompt_kilotokens(spans)
    if not len(hand):
        return RouterHops(None, None, 0, int(len(intake)))
    hand_ms, hand_slope = per_kilotoken_line(hand, kt)
    hop = hand_ms / 2.0
    if not len(intake):
        return RouterHops(hop, None, int(len(hand)), 0)
    intake_ms, tokenize = per_kilotoken_line(intake, kt)
    return RouterHops(hop, max(0.0, intake_ms - hop), int(len(hand)), int(len(intake)),
                      tokenize, max(0.0, hand_slope - tokenize))
