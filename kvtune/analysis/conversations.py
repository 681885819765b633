"""Each conversation's turns as retention sees them: the gaps between its turns, the history held
across each, and whether and when it ended.

The turns and gaps are :func:`kvtune.analysis.workload.conversation_turns` (the rows
``workload()``'s ``gaps_s`` / ``gap_tokens`` / ``final_tokens`` come from). An explicit end is a
router ``kv.request`` with ``kv.conversation.end`` true (the end header on a turn: it ends when that
turn does) or a decode ``kv.retention`` span with outcome ``ended`` (the router released the
blocks); the earliest such signal counts, measured from the conversation's last turn's end.
A conversation without one ended, as far as the trace shows, with its last turn.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from kvtune import spans as sc
from kvtune.analysis.workload import conversation_turns


@dataclass(frozen=True)
class Conversation:
    """One conversation's retention-relevant shape. ``gaps_s[i]`` is the gap after turn ``i + 1``
    and ``gap_tokens[i]`` the history (prompt + output) held across it; ``final_tokens`` the history
    left after the last turn."""

    conversation_id: str
    gaps_s: tuple[float, ...]
    gap_tokens: tuple[int, ...]
    final_tokens: int
    end_after_s: float | None = None
    """Seconds from the last turn's end to the explicit end (0: the last turn said so); None: no
    explicit end was seen (the last turn seen is the last)."""

    @property
    def ended(self) -> bool:
        return self.end_after_s is not None


def _ends_ns(spans: pd.DataFrame) -> dict[str, int]:
    """Conversation id -> earliest explicit-end time (ns) in ``spans``."""
    if sc.CONVERSATION_ID not in spans.columns:
        return {}
    name = spans["name"].astype("object")
    marks = pd.Series(False, index=spans.index)
    if sc.CONVERSATION_END in spans.columns:
        marks |= (name == sc.SpanName.REQUEST.value) & \
            spans[sc.CONVERSATION_END].astype("boolean").fillna(False).astype(bool)
    if sc.RETENTION_OUTCOME in spans.columns:
        marks |= (name == sc.SpanName.RETENTION.value) & \
            (spans[sc.RETENTION_OUTCOME].astype("object") == sc.RetentionOutcome.ENDED.value)
    hit = spans[marks.to_numpy(dtype=bool) & spans[sc.CONVERSATION_ID].notna().to_numpy(dtype=bool)]
    if hit.empty:
        return {}
    return {str(k): int(v) for k, v in
            hit.groupby(hit[sc.CONVERSATION_ID].astype(str))["end_ns"].min().items()}


def conversations(spans: pd.DataFrame) -> tuple[Conversation, ...]:
    """Every named conversation in ``spans`` (a ``kvtune.traces.load`` frame), in id order.
    Raises :class:`kvtune.errors.AnalysisError` when no request can be found."""
    turns = conversation_turns(spans)
    ends = _ends_ns(spans)
    out: list[Conversation] = []
    for cid, g in turns.groupby(turns["conversation"].astype(str), sort=True):
        later = g["later"].to_numpy(dtype=bool)
        last_end = int(g["end_ns"].max())
        end_ns = ends.get(str(cid))
        end_after = None if end_ns is None else max(0.0, (end_ns - last_end) / 1e9)
        out.append(Conversation(
            str(cid), tuple(float(x) for x in g["gap_s"][later]),
            tuple(int(x) for x in g["prev_hist_tokens"][later]),
            int(g["hist_tokens"].iloc[-1]), end_after))
    return tuple(out)


def ended_share(convs: tuple[Conversation, ...] | list[Conversation]) -> float:
    """Share of ``convs`` that ended explicitly (NaN when there are none)."""
    return sum(c.ended for c in convs) / len(convs) if convs else math.nan
