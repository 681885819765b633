"""A request's time between the fitted phases, as traced: what the simulator must play besides the
fabric fit, the prefill cost and the router's hops.

The named engine spans leave gaps (issue 33 measured ~19% of TTFT without a span at the median).
Those the simulator can play are measured here per request, from the spans that exist (clocks
already corrected by ``kvtune.traces.load``), and summarised per serving mode:

- **prefill intake**: the prefill's ``kv.queue`` began (its API server stamped the leg's arrival)
  -> its ``kv.prefill`` began (scheduled). Engine-core IPC and the scheduler loop picking the
  request up. Requests whose prefill first pulled history back (a bidirectional ``pull``
  decision) are left out: their wait is the reverse transfer's.
- **decode intake**: the decode's ``kv.queue`` began -> the decode's first act on the leg: the
  forward READ's ``kv.descriptor_setup`` (pull, bidirectional) or its ``kv.registration``
  (push).
- **handover** (push): the prefill's ``kv.prefill`` ended -> its forward WRITE's ``kv.rdma``
  began, where the decode's registration came first (``kv.first_arrival``): the request
  finishing at the engine's next step, the connector handing its blocks to the sender, the
  descriptors built.
- **notify**: the forward transfer's ``kv.rdma`` ended -> the decode's ``kv.decode_start`` began:
  the KV's arrival seen by the decode engine (push: the WRITE's completion notification reaching
  it; pull: the READ's completion polled at its next loop boundary).
- **first step**: the decode's ``kv.decode_start`` (KV ready -> scheduled for its first step).

Queueing is the simulator's own (prefill FIFO, decode steps), so each intake is read from
requests whose engine was idle: no other request's ``kv.prefill`` on the same prefill, no other
request decoding (its decode ``kv.queue`` end -> its ``kv.request`` end) on the same decode. Where
fewer than :data:`MIN_IDLE_SAMPLES` were idle, every sample counts and ``idle_only`` says so.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvtune import spans as S
from kvtune.analysis.modes import spans_named

MIN_IDLE_SAMPLES = 3
"""Fewer idle-engine samples of a mode than this: its median is read from all of them."""
PATH_COLUMNS: tuple[str, ...] = (
    "trace_id", "mode", "prompt_tokens", "prefill_intake_ms", "prefill_idle", "decode_intake_ms",
    "decode_idle", "handover_ms", "notify_ms", "first_step_ms")
"""Columns of :func:`request_path`, in order (times in ms; NaN where the request has no such
step)."""


@dataclass(frozen=True)
class PathCosts:
    """One serving mode's medians of :func:`request_path` (None: no request had that step)."""

    mode: str
    prefill_intake_ms: float | None
    decode_intake_ms: float | None
    handover_ms: float | None
    notify_ms: float | None
    first_step_ms: float | None
    n_prefill_intakes: int
    n_decode_intakes: int
    n_handovers: int
    n_notifies: int
    idle_only: bool
    """Both intakes read from idle-engine requests only (else: from every request)."""

    def as_dict(self) -> dict[str, float | int | bool | str | None]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def _first(frame: pd.DataFrame, col: str = "start_ns") -> pd.Series:
    return frame.groupby("trace_id")[col].min() if len(frame) else pd.Series(dtype="int64")


def _forward(frame: pd.DataFrame) -> pd.DataFrame:
    if S.DIRECTION not in frame.columns:
        return frame
    return frame[(frame[S.DIRECTION].astype("object") != S.Direction.REVERSE.value).to_numpy(dtype=bool)]


def _engine(frame: pd.DataFrame) -> pd.Series:
    """Per trace, the engine the spans came from (``kv.engine_id``, else the service)."""
    if S.ENGINE_ID in frame.columns:
        eng = frame[S.ENGINE_ID].astype("object").where(frame[S.ENGINE_ID].notna(), frame["service"])
    else:
        eng = frame["service"]
    return frame.assign(_eng=eng).groupby("trace_id")["_eng"].first()


def _idle(start: pd.Series, end: pd.Series, engine: pd.Series, busy: pd.DataFrame) -> pd.Series:
    """Per trace: no other trace's ``busy`` interval (``trace_id, engine, start_ns, end_ns``)
    overlaps ``[start, end]`` on the same engine."""
    out = pd.Series(True, index=start.index)
    if busy.empty:
        return out
    by_engine = {e: g for e, g in busy.groupby("engine")}
    for tid in start.index:
        g = by_engine.get(engine.get(tid))
        if g is None or pd.isna(start[tid]) or pd.isna(end[tid]):
            continue
        hit = (g["trace_id"] != tid) & (g["start_ns"] < end[tid]) & (g["end_ns"] > start[tid])
        out[tid] = not bool(hit.any())
    return out


def request_path(spans: pd.DataFrame) -> pd.DataFrame:
    """One row per router-traced request (:data:`PATH_COLUMNS`; see the module doc)."""
    need = {"name", "trace_id", "start_ns", "end_ns", S.ROLE}
    if spans.empty or not need <= set(spans.columns):
        return pd.DataFrame(columns=list(PATH_COLUMNS))
    req = spans_named(spans, S.SpanName.REQUEST.value).drop_duplicates("trace_id").set_index("trace_id")
    if req.empty:
        return pd.DataFrame(columns=list(PATH_COLUMNS))
    p_role, d_role = S.Role.PREFILL.value, S.Role.DECODE.value
    pq = spans_named(spans, S.SpanName.QUEUE.value, p_role)
    dq = spans_named(spans, S.SpanName.QUEUE.value, d_role)
    pre = _forward(spans_named(spans, S.SpanName.PREFILL.value))
    setup = _forward(spans_named(spans, S.SpanName.DESCRIPTOR_SETUP.value, d_role))
    reg = spans_named(spans, S.SpanName.REGISTRATION.value, d_role)
    rdma_p = _forward(spans_named(spans, S.SpanName.RDMA.value, p_role))
    rdma_d = _forward(spans_named(spans, S.SpanName.RDMA.value, d_role))
    rdv = spans_named(spans, S.SpanName.RENDEZVOUS.value, p_role)
    ds = spans_named(spans, S.SpanName.DECODE_START.value, d_role)
    dec = spans_named(spans, S.SpanName.REUSE_DECISION.value, p_role)

    idx = req.index
    mode = (req[S.MODE].astype("object") if S.MODE in req.columns
            else pd.Series(None, index=idx, dtype="object"))
    prompt = (pd.to_numeric(req[S.PROMPT_TOKENS], errors="coerce") if S.PROMPT_TOKENS in req.columns
              else pd.Series(np.nan, index=idx))
    pq0, pf0, pf1 = _first(pq).reindex(idx), _first(pre).reindex(idx), _first(pre, "end_ns").reindex(idx)
    pulled = pd.Series(False, index=idx)
    if len(dec) and S.REUSE_OUTCOME in dec.columns:
        out = dec[S.REUSE_OUTCOME].astype("object") == S.ReuseOutcome.PULL.value
        pulled = pulled | pd.Series(True, index=dec[out.to_numpy(dtype=bool)]["trace_id"].unique()
                                    ).reindex(idx, fill_value=False)
    p_int = (pf0 - pq0).astype(float) / 1e6
    p_int = p_int.where((p_int >= 0) & ~pulled)
    busy_p = (pd.DataFrame({"trace_id": pre["trace_id"], "engine": _engine(pre).reindex(pre["trace_id"]).to_numpy(),
                            "start_ns": pre["start_ns"], "end_ns": pre["end_ns"]})
              if len(pre) else pd.DataFrame(columns=["trace_id", "engine", "start_ns", "end_ns"]))
    p_idle = _idle(pq0, pf0, _engine(pq).reindex(idx), busy_p)

    dq0, dq1 = _first(dq).reindex(idx), _first(dq, "end_ns").reindex(idx)
    act = pd.concat([_first(setup).reindex(idx), _first(reg).reindex(idx)], axis=1).min(axis=1)
    d_int = (act - dq0).astype(float) / 1e6
    d_int = d_int.where(d_int >= 0)
    d_eng = _engine(dq).reindex(idx)
    decoding = pd.DataFrame({"trace_id": idx, "engine": d_eng.to_numpy(), "start_ns": dq1.to_numpy(),
                             "end_ns": req["end_ns"].to_numpy()}).dropna()
    d_idle = _idle(dq0, act, d_eng, decoding)

    push = (mode == S.Mode.PUSH.value).to_numpy(dtype=bool)
    r0, r1 = _first(rdma_p).reindex(idx), _first(rdma_p, "end_ns").reindex(idx)
    reg_first = pd.Series(False, index=idx)
    if len(rdv) and S.FIRST_ARRIVAL in rdv.columns:
        first = rdv.groupby("trace_id")[S.FIRST_ARRIVAL].first().astype("object")
        reg_first = (first == S.FirstArrival.REGISTRATION.value).reindex(idx, fill_value=False)
    hand = ((r0 - pf1).astype(float) / 1e6).where(push & reg_first.to_numpy(dtype=bool))
    # the forward transfer's end: the prefill's WRITE (push), the decode's READ (pull legs)
    fwd_end = r1.where(push, _first(rdma_d, "end_ns").reindex(idx))
    ds0, ds1 = _first(ds).reindex(idx), _first(ds, "end_ns").reindex(idx)
    notify = (ds0 - fwd_end).astype(float) / 1e6
    step = (ds1 - ds0).astype(float) / 1e6
    out = pd.DataFrame({
        "trace_id": idx, "mode": mode.to_numpy(), "prompt_tokens": prompt.to_numpy(dtype=float),
        "prefill_intake_ms": p_int.to_numpy(dtype=float), "prefill_idle": p_idle.to_numpy(dtype=bool),
        "decode_intake_ms": d_int.to_numpy(dtype=float), "decode_idle": d_idle.to_numpy(dtype=bool),
        "handover_ms": hand.where(hand >= 0).to_numpy(dtype=float),
        "notify_ms": notify.where(notify >= 0).to_numpy(dtype=float),
        "first_step_ms": step.where(step >= 0).to_numpy(dtype=float),
    }, columns=list(PATH_COLUMNS))
    return out.reset_index(drop=True)


def _median(values: pd.Series, idle: pd.Series) -> tuple[float | None, int, bool]:
    ok = values.notna()
    quiet = ok & idle
    use, idle_only = (quiet, True) if int(quiet.sum()) >= MIN_IDLE_SAMPLES else (ok, False)
    n = int(use.sum())
    return (float(values[use].median()) if n else None), n, idle_only or n == 0


def path_costs(spans: pd.DataFrame) -> dict[str, PathCosts]:
    """:class:`PathCosts` per serving mode of ``spans`` (``kvtune.traces.load``'s frame)."""
    table = request_path(spans)
    out: dict[str, PathCosts] = {}
    for mode, g in table.dropna(subset=["mode"]).groupby("mode"):
        if str(mode) == S.Mode.PROBE.value:
            continue
        p, n_p, p_idle = _median(g["prefill_intake_ms"], g["prefill_idle"])
        d, n_d, d_idle = _median(g["decode_intake_ms"], g["decode_idle"])
        hand, notify = g["handover_ms"].dropna(), g["notify_ms"].dropna()
        step = g["first_step_ms"].dropna()
        out[str(mode)] = PathCosts(
            str(mode), p, d, float(hand.median()) if len(hand) else None,
            float(notify.median()) if len(notify) else None,
            float(step.median()) if len(step) else None, n_p, n_d, int(len(hand)),
            int(len(notify)), p_idle and d_idle)
    return out


def without_reverse_wait(spans: pd.DataFrame) -> pd.DataFrame:
    """``spans`` with each prefill's ``kv.prefill`` shortened by the reverse transfer inside it.

    A bidirectional prefill that pulls history back is scheduled before the history arrives: its
    ``kv.prefill`` span holds the reverse READ (``kv.descriptor_setup`` -> ``kv.rdma`` end, same
    conversation and turn, on the prefill). The prefill cost is compute; the simulator plays the
    reverse transfer itself. Spans without such an overlap are returned as they are."""
    need = {"name", "start_ns", "end_ns", "duration_ms", S.ROLE, S.DIRECTION, S.CONVERSATION_ID,
            S.TURN}
    if spans.empty or not need <= set(spans.columns):
        return spans
    p_role = S.Role.PREFILL.value
    rev = spans[((spans[S.DIRECTION].astype("object") == S.Direction.REVERSE.value)
                 & (spans[S.ROLE].astype("object") == p_role)
                 & spans["name"].isin([S.SpanName.DESCRIPTOR_SETUP.value, S.SpanName.RDMA.value])
                 ).to_numpy(dtype=bool)]
    if rev.empty:
        return spans
    key = [S.CONVERSATION_ID, S.TURN]
    window = rev.groupby(key).agg(r0=("start_ns", "min"), r1=("end_ns", "max")).reset_index()
    is_pre = ((spans["name"] == S.SpanName.PREFILL.value)
              & (spans[S.ROLE].astype("object") == p_role)).to_numpy(dtype=bool)
    pre = spans[is_pre][key + ["start_ns", "end_ns"]].reset_index()
    joined = pre.merge(window, on=key, how="inner")
    inside = joined[(joined["r0"] >= joined["start_ns"]) & (joined["r1"] <= joined["end_ns"])]
    if inside.empty:
        return spans
    out = spans.copy()
    wait = (inside["r1"] - inside["r0"]).to_numpy(dtype="int64")
    rows = inside["index"].to_numpy()
    out.loc[rows, "start_ns"] = out.loc[rows, "start_ns"].to_numpy(dtype="int64") + wait
    out.loc[rows, "duration_ms"] = (out.loc[rows, "end_ns"] - out.loc[rows, "start_ns"]).astype(float) / 1e6
    return out
