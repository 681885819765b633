"""The workload's shape: prompt and output lengths, arrival rate, conversations, turns, the gaps
between turns and what happened to retained history.

Requests come from the router's ``kv.request`` spans; without them, one request per
(conversation, turn) — or per base request id — is assembled from whatever spans carry those ids
(its start is the first span's start, its end the last span's end, its prompt length from
``kv.prefill``), leaving out retention spans and reverse transfers, which belong between turns.
An inter-turn gap is the next turn's start minus the previous turn's end.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvtune import spans as sc
from kvtune.errors import AnalysisError


@dataclass(frozen=True)
class TracedRequest:
    """One traced request with a known prompt length."""

    prompt_tokens: int
    history_tokens: int
    """Tokens of history carried from the previous turn (its prompt + output, at most this
    prompt); 0 for a first turn."""
    gap_s: float
    """Since the previous turn's end, seconds; NaN for a first turn."""


@dataclass(frozen=True)
class Workload:
    """What the traffic looked like. Token percentiles are NaN when unknown.

    ``multi_turn_share``: share of requests that are a later turn (>= 2) of a conversation, i.e.
    could reuse retained history. ``gaps_s[i]`` is an inter-turn gap and ``gap_tokens[i]`` the
    tokens of history (previous prompt + output) held across it; ``final_tokens`` the history left
    after each conversation's last turn (retained until the TTL runs out). A request without a
    conversation id counts as a one-turn conversation in ``n_conversations``.
    """

    n_requests: int
    qps: float
    prompt_tokens_p50: float
    prompt_tokens_p90: float
    prompt_tokens_p99: float
    output_tokens_p50: float
    multi_turn_share: float
    turns_per_conversation_mean: float
    gaps_s: tuple[float, ...]
    reuse_outcomes: dict[str, int]
    duration_s: float
    n_conversations: int = 0
    gap_tokens: tuple[int, ...] = ()
    final_tokens: tuple[int, ...] = ()
    prompt_tokens: tuple[int, ...] = field(default=(), repr=False)
    requests: tuple[TracedRequest, ...] = field(default=(), repr=False)
    """Per request with a known prompt length (first turns: history 0, gap NaN)."""
    turns_per_conversation: tuple[int, ...] = field(default=(), repr=False)
    """Turns of each conversation (1 for a request without a conversation id)."""
    source: str = ""
    sampled_share: float = 1.0
    """Share of the source's conversations these requests are (a reduced read keeps whole
    conversations, ``kvtune.traces.reduce``); ``qps`` and ``duration_s`` are scaled by it, so that
    sums over the gaps per second of ``duration_s`` (retained memory) and the request rate are
    the whole source's."""

    def as_dict(self) -> dict:
        return {
            "n_requests": self.n_requests, "qps": self.qps,
            "prompt_tokens_p50": self.prompt_tokens_p50, "prompt_tokens_p90": self.prompt_tokens_p90,
            "prompt_tokens_p99": self.prompt_tokens_p99, "output_tokens_p50": self.output_tokens_p50,
            "multi_turn_share": self.multi_turn_share,
            "turns_per_conversation_mean": self.turns_per_conversation_mean,
            "n_gaps": len(self.gaps_s),
            "gap_s_p50": float(np.median(self.gaps_s)) if self.gaps_s else None,
            "gap_s_p90": float(np.quantile(self.gaps_s, 0.9)) if self.gaps_s else None,
            "reuse_outcomes": dict(self.reuse_outcomes), "duration_s": self.duration_s,
            "n_conversations": self.n_conversations, "source": self.source,
            "sampled_share": self.sampled_share,
        }


def _q(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else math.nan


def _int_col(df: pd.DataFrame, name: str) -> pd.Series:
    if name in df.columns:
        return df[name].astype("Float64")
    return pd.Series(pd.NA, index=df.index, dtype="Float64")


def _str_col(df: pd.DataFrame, name: str) -> pd.Series:
    if name in df.columns:
        return df[name].astype("object")
    return pd.Series(None, index=df.index, dtype="object")


def _requests(spans: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """One row per request: conversation, turn, start_ns, end_ns, prompt, output."""
    name = spans["name"].astype("object")
    req = spans[(name == sc.SpanName.REQUEST.value).to_numpy(dtype=bool)]
    if not req.empty:
        out = pd.DataFrame({
            "conversation": _str_col(req, sc.CONVERSATION_ID), "turn": _int_col(req, sc.TURN),
            "start_ns": req["start_ns"].astype("int64"), "end_ns": req["end_ns"].astype("int64"),
            "prompt": _int_col(req, sc.PROMPT_TOKENS), "output": _int_col(req, sc.OUTPUT_TOKENS),
            "base": _str_col(req, sc.BASE_REQUEST_ID),
        })
        return out.reset_index(drop=True), sc.SpanName.REQUEST.value
    conv, base = _str_col(spans, sc.CONVERSATION_ID), _str_col(spans, sc.BASE_REQUEST_ID)
    turn = _int_col(spans, sc.TURN)
    keyed = spans.assign(_conv=conv, _turn=turn, _base=base)
    # Not part of one request's own time: retention spans (one turn's end -> the next turn's
    # start), and reverse transfers (the next turn pulling this turn's history back: they carry
    # the previous turn's request id).
    reverse = (_str_col(spans, sc.DIRECTION) == sc.Direction.REVERSE.value) | \
        _str_col(spans, sc.TRANSFER_ID).astype(str).str.endswith(":" + sc.Direction.REVERSE.value)
    probe = _str_col(spans, sc.MODE) == sc.Mode.PROBE.value  # probe transfers are not requests
    keep = ((conv.notna() | base.notna()) & (name != sc.SpanName.RETENTION.value) & ~reverse
            & ~probe)
    keyed = keyed[keep.to_numpy(dtype=bool)]
    if keyed.empty:
        raise AnalysisError(
            f"workload: no requests: need {sc.SpanName.REQUEST.value} router spans, or spans "
            f"carrying {sc.CONVERSATION_ID} or {sc.BASE_REQUEST_ID}; got {len(spans)} span(s)")
    by_turn = keyed["_conv"].notna() & keyed["_turn"].notna()
    keyed = keyed.assign(_key=keyed["_base"].astype(str).where(
        ~by_turn, keyed["_conv"].astype(str) + "#" + keyed["_turn"].astype(str)))
    pre = keyed[(keyed["name"].astype("object") == sc.SpanName.PREFILL.value).to_numpy(dtype=bool)]
    prompt = pre.groupby("_key")[sc.PROMPT_TOKENS].max() if sc.PROMPT_TOKENS in pre else None
    g = keyed.groupby("_key", sort=False)
    out = pd.DataFrame({
        "conversation": g["_conv"].first(), "turn": g["_turn"].first(),
        "start_ns": g["start_ns"].min().astype("int64"), "end_ns": g["end_ns"].max().astype("int64"),
    })
    out["prompt"] = (prompt.reindex(out.index).astype("Float64") if prompt is not None
                     else pd.Series(pd.NA, index=out.index, dtype="Float64"))
    out["output"] = pd.Series(pd.NA, index=out.index, dtype="Float64")
    out["base"] = out.index.astype(object)
    return out.reset_index(drop=True), "conversation ids"


def _conversation_turns(req: pd.DataFrame) -> pd.DataFrame:
    """The requests of ``req`` that name a conversation, in turn order, with ``hist_tokens`` (prompt +
    output tokens), ``prev_hist_tokens`` (the previous turn's), ``gap_s`` (since the previous turn's end,
    >= 0; NaN for a first turn) and ``later`` (not a first turn)."""
    conv = req[req["conversation"].notna().to_numpy(dtype=bool)].copy()
    conv["_t"] = conv["turn"].astype("Float64").fillna(-1.0).astype(float)
    conv = conv.sort_values(["conversation", "_t", "start_ns"], kind="stable")
    conv["hist_tokens"] = (conv["prompt"].astype("Float64").fillna(0.0)
                     + conv["output"].astype("Float64").fillna(0.0)).astype(float)
    g = conv.groupby("conversation", sort=False)
    prev_end = g["end_ns"].shift(1)
    conv["prev_hist_tokens"] = g["hist_tokens"].shift(1)
    conv["later"] = prev_end.notna().to_numpy(dtype=bool)
    conv["gap_s"] = ((conv["start_ns"].astype(float) - prev_end.astype(float)) / 1e9).clip(lower=0.0)
    return conv


def conversation_turns(spans: pd.DataFrame) -> pd.DataFrame:
    """One row per turn of a named conversation, in turn order (the rows :func:`workload` reads
    its gaps from): ``conversation``, ``turn``, ``start_ns``, ``end_ns``, ``prompt``, ``output``,
    ``hist_tokens``, ``prev_hist_tokens``, ``gap_s``, ``later``. Raises :class:`AnalysisError` as
    :func:`workload` does."""
    if "name" not in spans.columns:
        raise AnalysisError("conversation_turns: spans frame has no 'name' column; expected the "
                            "shape of kvtune.traces.load")
    return _conversation_turns(_requests(spans)[0])


def workload(spans: pd.DataFrame) -> Workload:
    """Summarise the traffic in ``spans`` (see module doc). Raises :class:`AnalysisError` when no
    request can be found."""
    if "name" not in spans.columns:
        raise AnalysisError("workload: spans frame has no 'name' column; expected the shape of "
                            "kvtune.traces.load")
    req, source = _requests(spans)
    n = len(req)
    sample = spans.attrs.get("sample")
    share = float(getattr(sample, "share", 1.0) or 1.0)
    starts = req["start_ns"].to_numpy(dtype=np.int64)
    # a sample of the conversations spans the whole time at a fraction of the rate: as many
    # requests in share x the time is the source's rate
    duration_s = float(starts.max() - starts.min()) / 1e9 * share if n else 0.0
    end_s = float(req["end_ns"].max() - starts.min()) / 1e9 * share if n else 0.0
    qps = n / duration_s if duration_s > 0 else math.nan
    prompts = req["prompt"].dropna().to_numpy(dtype=float)
    outputs = req["output"].dropna().to_numpy(dtype=float)

    conv = _conversation_turns(req)
    g = conv.groupby("conversation", sort=False)
    prev_hist, gap_s = conv["prev_hist_tokens"], conv["gap_s"]
    later = conv["later"].to_numpy(dtype=bool)
    gaps = gap_s[later].tolist()
    gap_tokens = prev_hist[later].astype(int).tolist()
    final_tokens = g["hist_tokens"].last().astype(int).tolist()
    turns = g.size().tolist()
    n_later = int(later.sum())
    per_request: list[TracedRequest] = []
    prompt = conv["prompt"].astype("Float64")
    for p, h, gs, lt in zip(prompt, prev_hist, gap_s, later):
        if pd.isna(p):
            continue
        per_request.append(TracedRequest(int(p), min(int(h), int(p)), float(gs)) if lt
                           else TracedRequest(int(p), 0, math.nan))
    for p in req.loc[req["conversation"].isna().to_numpy(dtype=bool), "prompt"].dropna():
        per_request.append(TracedRequest(int(p), 0, math.nan))
    n_single = int(req["conversation"].isna().sum())
    turns.extend([1] * n_single)

    outcomes: dict[str, int] = {}
    name = spans["name"].astype("object")
    # History reuse is the prefill's decision; a decode's own "pull the prompt" decision is not one.
    not_decode = _str_col(spans, sc.ROLE) != sc.Role.DECODE.value
    dec = spans[((name == sc.SpanName.REUSE_DECISION.value) & not_decode).to_numpy(dtype=bool)]
    if not dec.empty and sc.REUSE_OUTCOME in dec.columns:
        outcomes = {str(k): int(v) for k, v in dec[sc.REUSE_OUTCOME].dropna().astype(str)
                    .value_counts().sort_index().items()}
    return Workload(
        n_requests=n, qps=qps, prompt_tokens_p50=_q(prompts, 0.5),
        prompt_tokens_p90=_q(prompts, 0.9), prompt_tokens_p99=_q(prompts, 0.99),
        output_tokens_p50=_q(outputs, 0.5), multi_turn_share=n_later / n if n else 0.0,
        turns_per_conversation_mean=float(np.mean(turns)) if turns else 0.0,
        gaps_s=tuple(gaps), reuse_outcomes=outcomes, duration_s=end_s,
        n_conversations=len(turns), gap_tokens=tuple(gap_tokens), final_tokens=tuple(final_tokens),
        prompt_tokens=tuple(int(p) for p in prompts), requests=tuple(per_request),
        turns_per_conversation=tuple(int(t) for t in turns), source=source, sampled_share=share)
