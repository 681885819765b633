"""Traffic for the simulator: synthetic conversations, replay of a request table, and the bridge
from a measured ``kvtune.analysis.Workload`` summary to a :class:`WorkloadSpec`."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from kvtune.analysis.workload import TracedRequest, Workload
from kvtune.errors import SimError
from kvtune.sim.config import Dist, WorkloadSpec

REPLAY_REQUIRED: tuple[str, ...] = ("arrival_s", "prompt_tokens", "output_tokens")
REPLAY_OPTIONAL: tuple[str, ...] = ("conversation_id", "turn")

NEW_TOKENS_SHARE = 0.05
"""From a Workload summary (which has no per-turn growth): a later turn adds this share of the
median prompt as new tokens (at least ``MIN_NEW_TOKENS``)."""
MIN_NEW_TOKENS = 16
DEFAULT_THINK_TIME_S = 10.0
"""Mean think time when a Workload summary has no inter-turn gaps."""
GEOMETRIC_SAMPLE = 4096  # size of the empirical sample standing for a geometric turns distribution
MIN_SPEC_DURATION_S = 30.0


@dataclass(frozen=True)
class Arrival:
    """One request for the engine to play: turn ``turn`` of conversation ``conversation``, arriving
    at ``arrival_ms`` (simulated ms from 0) with ``history_tokens`` of its prompt carried over from
    the previous turn."""

    conversation: int
    turn: int
    prompt_tokens: int
    output_tokens: int
    history_tokens: int
    arrival_ms: float


class _Conversation:
    """A synthetic conversation's plan: its turns' outputs, added tokens and think times."""

    __slots__ = ("cid", "turns", "outputs", "new_tokens", "gaps", "next_turn", "prompt")

    def __init__(self, cid: int, turns: int, first_prompt: int, outputs: np.ndarray,
                 new_tokens: np.ndarray, gaps: np.ndarray) -> None:
        self.cid, self.turns, self.prompt = cid, turns, first_prompt
        self.outputs, self.new_tokens, self.gaps = outputs, new_tokens, gaps
        self.next_turn = 1


class Traffic:
    """The arrivals of one run, apart from the engine that plays them: :meth:`start` gives the
    requests known up front, :meth:`after` the one a finished request leads to (the next turn of
    its conversation, or, closed loop, its user's next conversation). Synthetic traffic
    (:class:`WorkloadSpec`) or a replayed request table (``SimConfig.requests``)."""

    def __init__(self, spec: WorkloadSpec, *, seed: int = 0, requests: pd.DataFrame | None = None
                 ) -> None:
        self.spec = spec
        self.seed = seed
        self.replay = requests_frame(requests) if requests is not None else None
        self._convs: dict[int, _Conversation] = {}
        self._user_rng: np.random.Generator | None = None  # closed-loop workloads
        # closed loop, round robin: each user's conversations waiting for their next turn
        self._queues: dict[int, deque[tuple[int, int, int, int, int]]] = {}
        self._user_of: dict[int, int] = {}
        self.horizon_ms = 0.0
        """Arrivals stop here (ms), known once :meth:`start` ran."""

    def start(self) -> list[Arrival]:
        """The arrivals known before the run (every request of a replay; every conversation's first
        turn otherwise), in the order the engine should create them."""
        if self.replay is not None:
            return self._replay(self.replay)
        return self._synthetic(self.spec, self.seed)

    def _new_conversation(self, w: WorkloadSpec, rng: np.random.Generator, start_ms: float
                          ) -> Arrival:
        k = max(1, int(np.rint(w.turns.sample(rng, 1)[0])))
        first = int(np.clip(np.rint(w.prompt_tokens.sample(rng, 1)[0]), 1, w.max_prompt_tokens))
        outputs = np.maximum(1, np.rint(w.output_tokens.sample(rng, k))).astype(np.int64)
        new = np.maximum(1, np.rint(w.new_tokens.sample(rng, k))).astype(np.int64)
        conv = _Conversation(len(self._convs), k, first, outputs, new, w.think_time_s.sample(rng, k))
        self._convs[conv.cid] = conv
        return Arrival(conv.cid, 1, conv.prompt, int(conv.outputs[0]), 0, start_ms)

    def _synthetic(self, w: WorkloadSpec, seed: int) -> list[Arrival]:
        rng = np.random.default_rng(seed)
        self.horizon_ms = w.duration_s * 1e3
        if w.users > 0:  # closed loop: each user starts a new conversation when the last one ended
            self._user_rng = rng
            starts = rng.uniform(0.0, max(w.think_time_s.mean(), 1e-3), w.users)
            if w.conversations_per_user <= 1:
                return [self._new_conversation(w, rng, float(start) * 1e3) for start in starts]
            out = []
            for user, start in enumerate(starts):  # the first turn now, the others queued
                firsts = [self._new_conversation(w, rng, float(start) * 1e3)
                          for _ in range(int(w.conversations_per_user))]
                for a in firsts:
                    self._user_of[a.conversation] = user
                self._queues[user] = deque(_pending(a) for a in firsts[1:])
                out.append(firsts[0])
            return out
        mean_turns = max(1.0, w.turns.mean())
        rate = w.qps / mean_turns  # conversations per second
        n_est = int(rate * w.duration_s * 1.3 + 10 * math.sqrt(rate * w.duration_s + 1) + 10)
        starts = np.cumsum(rng.exponential(1.0 / rate, n_est))
        while starts[-1] < w.duration_s:  # rare: extend
            starts = np.concatenate([starts, starts[-1] + np.cumsum(rng.exponential(1.0 / rate, n_est))])
        starts = starts[starts < w.duration_s]
        n = len(starts)
        turns = np.maximum(1, np.rint(w.turns.sample(rng, n))).astype(np.int64)
        first = np.clip(np.rint(w.prompt_tokens.sample(rng, n)), 1, w.max_prompt_tokens).astype(np.int64)
        total = int(turns.sum())
        outputs = np.maximum(1, np.rint(w.output_tokens.sample(rng, total))).astype(np.int64)
        new = np.maximum(1, np.rint(w.new_tokens.sample(rng, total))).astype(np.int64)
        gaps = w.think_time_s.sample(rng, total)
        out: list[Arrival] = []
        off = 0
        for cid in range(n):
            k = int(turns[cid])
            conv = _Conversation(cid, k, int(first[cid]), outputs[off:off + k], new[off:off + k],
                                 gaps[off:off + k])
            off += k
            self._convs[cid] = conv
            out.append(Arrival(cid, 1, conv.prompt, int(conv.outputs[0]), 0, float(starts[cid]) * 1e3))
        return out

    def after(self, conversation: int, turn: int, prompt_tokens: int, output_tokens: int,
              done_ms: float) -> Arrival | None:
        """What follows a finished request (its conversation's next turn, a closed-loop user's next
        conversation), or None."""
        conv = self._convs.get(conversation)
        if conv is None or self.replay is not None:
            return None
        k = conv.next_turn
        w = self.spec
        history = prompt_tokens + output_tokens
        prompt = history + int(conv.new_tokens[k]) if k < conv.turns else 0
        ended = k >= conv.turns or prompt > w.max_prompt_tokens
        gap_ms = float(conv.gaps[k - 1 if ended else k]) * 1e3
        user = self._user_of.get(conv.cid)
        if user is not None:  # round robin: queue this conversation's next turn, send the front one
            queue = self._queues[user]
            if not ended:
                conv.next_turn = k + 1
                queue.append((conv.cid, k + 1, prompt, int(conv.outputs[k]), history))
            else:
                conv.turns = k
                if done_ms + gap_ms < w.duration_s * 1e3:
                    a = self._new_conversation(w, self._user_rng, 0.0)
                    self._user_of[a.conversation] = user
                    queue.append(_pending(a))
            if not queue:
                return None
            cid, turn, p, out, hist = queue.popleft()
            return Arrival(cid, turn, p, out, hist, done_ms + gap_ms)
        if ended:
            conv.turns = k
            if self._user_rng is not None:  # closed loop: this user's next conversation
                start = done_ms + gap_ms
                if start < w.duration_s * 1e3:
                    return self._new_conversation(w, self._user_rng, start)
            return None
        conv.next_turn = k + 1
        return Arrival(conv.cid, k + 1, prompt, int(conv.outputs[k]), history, done_ms + gap_ms)

    def _replay(self, df: pd.DataFrame) -> list[Arrival]:
        has_conv = "conversation_id" in df.columns
        df = df.sort_values("arrival_s", kind="stable")
        t0 = float(df["arrival_s"].min()) if len(df) else 0.0
        conv_ids: dict[Any, int] = {}
        last: dict[int, int] = {}  # conv -> previous prompt + output
        turns: dict[int, int] = {}
        cols = [df["arrival_s"].to_numpy(float), df["prompt_tokens"].to_numpy(np.int64),
                df["output_tokens"].to_numpy(np.int64)]
        conv_col = df["conversation_id"].to_numpy(object) if has_conv else [None] * len(df)
        out: list[Arrival] = []
        for arr, prompt, o, cid in zip(*cols, conv_col):
            if cid is None or (isinstance(cid, float) and math.isnan(cid)) or cid is pd.NA:
                c = len(conv_ids) + len(turns) + 10**9  # a conversation of its own
                history = 0
            else:
                c = conv_ids.setdefault(cid, len(conv_ids))
                prev = last.get(c, 0)
                history = prev if 0 < prev <= prompt else 0
                last[c] = int(prompt + o)
            turns[c] = turns.get(c, 0) + 1
            out.append(Arrival(c, turns[c], int(prompt), int(o), int(history), (arr - t0) * 1e3))
        self.horizon_ms = (float(df["arrival_s"].max()) - t0) * 1e3 if len(df) else 0.0
        return out


def _pending(a: Arrival) -> tuple[int, int, int, int, int]:
    """A queued turn: ``(conversation, turn, prompt, output, history)`` (its time comes when sent)."""
    return (a.conversation, a.turn, a.prompt_tokens, a.output_tokens, a.history_tokens)


def requests_from_spans(spans: pd.DataFrame) -> pd.DataFrame:
    """A replay table from a spans DataFrame (``kvtune.traces.load``): one row per ``kv.request``
    span with a prompt length (arrival = span start, relative to the first)."""
    from kvtune import spans as S
    missing = [c for c in ("name", "start_ns", S.PROMPT_TOKENS) if c not in spans.columns]
    if missing:
        raise SimError(f"spans: missing column(s) {missing}; expected a kvtune.traces.load frame")
    req = spans[(spans["name"].astype("object") == S.SpanName.REQUEST.value).to_numpy(dtype=bool)]
    req = req[req[S.PROMPT_TOKENS].notna().to_numpy(dtype=bool)]
    if req.empty:
        raise SimError(f"spans: no {S.SpanName.REQUEST.value} span with {S.PROMPT_TOKENS}; "
                       "expected router spans to replay")
    start = req["start_ns"].to_numpy(np.int64)
    out = pd.DataFrame({
        "arrival_s": (start - start.min()) / 1e9,
        "prompt_tokens": req[S.PROMPT_TOKENS].astype("Int64").to_numpy(np.int64, na_value=1),
        "output_tokens": (req[S.OUTPUT_TOKENS].astype("Int64").fillna(1).to_numpy(np.int64)
                          if S.OUTPUT_TOKENS in req.columns else np.ones(len(req), np.int64)),
    })
    if S.CONVERSATION_ID in req.columns:
        conv = req[S.CONVERSATION_ID].astype("object").to_numpy()
        out["conversation_id"] = [None if (c is None or c is pd.NA or c == "") else c for c in conv]
    return out.sort_values("arrival_s", kind="stable").reset_index(drop=True)


def load_replay(path: str) -> pd.DataFrame:
    """A replay table from a CSV (``arrival_s, prompt_tokens, output_tokens[, conversation_id]``)
    or from span files (anything ``kvtune.traces.load`` reads: ``.jsonl``, a directory, ...)."""
    if str(path).lower().endswith(".csv"):
        try:
            return requests_frame(pd.read_csv(path))
        except OSError as exc:
            raise SimError(f"{path}: cannot read the replay CSV: {exc}") from exc
    from kvtune.traces import load
    return requests_frame(requests_from_spans(load(path)))


def requests_frame(requests: Any) -> pd.DataFrame:
    """Validate a replay table: ``arrival_s`` (s), ``prompt_tokens``, ``output_tokens`` and
    optionally ``conversation_id`` and ``turn``. Also takes a ``SimResult.requests`` frame."""
    if not isinstance(requests, pd.DataFrame):
        raise SimError(f"requests: expected a pandas DataFrame with columns {REPLAY_REQUIRED}, "
                       f"got {type(requests).__name__}")
    missing = [c for c in REPLAY_REQUIRED if c not in requests.columns]
    if missing:
        raise SimError(f"requests: missing column(s) {missing}; expected {REPLAY_REQUIRED} "
                       f"(+ optional {REPLAY_OPTIONAL})")
    df = requests[[c for c in REPLAY_REQUIRED + REPLAY_OPTIONAL if c in requests.columns]].copy()
    for c in REPLAY_REQUIRED:
        vals = pd.to_numeric(df[c], errors="coerce")
        if vals.isna().any() or (vals < 0).any():
            raise SimError(f"requests.{c}: expected non-negative numbers, "
                           f"got {int(vals.isna().sum())} missing/invalid and {int((vals < 0).sum())} negative")
        df[c] = vals.astype(float)
    df["prompt_tokens"] = df["prompt_tokens"].clip(lower=1).round().astype(np.int64)
    df["output_tokens"] = df["output_tokens"].clip(lower=1).round().astype(np.int64)
    return df


def spec_from_workload(workload: Workload, *, duration_s: float | None = None) -> WorkloadSpec:
    """A :class:`WorkloadSpec` from a measured summary (``kvtune.analysis.Workload``; fields read:
    ``qps, prompt_tokens_p50, prompt_tokens_p90, output_tokens_p50,
    turns_per_conversation_mean, turns_per_conversation, gaps_s, duration_s, requests``; missing
    optional ones take
    defaults).

    First-turn prompts and the tokens later turns add are drawn from ``workload.requests``
    (``kvtune.analysis.TracedRequest``) when present. Otherwise: first-turn prompts are
    log-normal through p50 and p90 and a later turn adds ``NEW_TOKENS_SHARE`` of the median
    prompt. Outputs are fixed at p50; turns per conversation are drawn from the traced
    conversations (``turns_per_conversation``; without it, geometric with the measured mean);
    think times are drawn from the measured gaps.
    """
    def num(name: str, default: float | None = None) -> float:
        v = getattr(workload, name, default)
        try:
            v = float(v)
        except (TypeError, ValueError):
            v = math.nan
        if not math.isfinite(v):
            if default is None:
                raise SimError(f"workload.{name}: expected a number, got {getattr(workload, name, None)!r}")
            return float(default)
        return v

    qps = num("qps")
    p50 = max(1.0, num("prompt_tokens_p50"))
    p90 = max(p50, num("prompt_tokens_p90", p50))
    sigma = math.log(p90 / p50) / 1.2816 if p90 > p50 else 0.0
    prompt = Dist("lognormal", (p50, sigma)) if sigma > 0 else Dist.fixed(p50)
    out = Dist.fixed(max(1.0, num("output_tokens_p50", 128)))
    mean_turns = max(1.0, num("turns_per_conversation_mean", 1.0))
    measured_turns = tuple(float(t) for t in (getattr(workload, "turns_per_conversation", None)
                                              or ()) if t >= 1)
    if measured_turns:  # as traced: a geometric law would split fixed-length sessions
        turns = (Dist("empirical", measured_turns) if len(set(measured_turns)) > 1
                 else Dist.fixed(measured_turns[0]))
    elif mean_turns > 1.0:
        g = np.random.default_rng(0).geometric(1.0 / mean_turns, GEOMETRIC_SAMPLE)
        turns = Dist("empirical", tuple(float(x) for x in g))
    else:
        turns = Dist.fixed(1)
    gaps = tuple(float(g) for g in (getattr(workload, "gaps_s", None) or ()) if g is not None
                 and math.isfinite(float(g)) and float(g) >= 0)
    think = Dist("empirical", gaps) if gaps else Dist("exponential", (DEFAULT_THINK_TIME_S,))
    new = Dist.fixed(max(MIN_NEW_TOKENS, round(p50 * NEW_TOKENS_SHARE)))
    # per-request shapes when the summary has them: first-turn prompts and the
    # tokens later turns add, as measured
    reqs: list[TracedRequest] = [r for r in (getattr(workload, "requests", None) or ())
                                 if r.prompt_tokens > 0]
    firsts = tuple(float(r.prompt_tokens) for r in reqs if not r.history_tokens)
    added = tuple(float(max(1, r.prompt_tokens - r.history_tokens)) for r in reqs
                  if r.history_tokens > 0)
    if firsts:
        prompt = Dist("empirical", firsts)
    if added:
        new = Dist("empirical", added)
    dur = duration_s if duration_s is not None else max(MIN_SPEC_DURATION_S, num("duration_s", 60.0))
    return WorkloadSpec(qps=qps, duration_s=dur, prompt_tokens=prompt, output_tokens=out, turns=turns,
                        new_tokens=new, think_time_s=think)
