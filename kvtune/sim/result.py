"""What a simulation returns: the per-request table, TTFT statistics and the spans."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvtune.sim.config import SimConfig
from kvtune.sim.engine import Simulation
from kvtune.sim.otlp import readable_spans, write_otlp_jsonl
from kvtune.sim.timeline import Retention, Timeline, conversation_id, request_id
from kvtune.spans import Mode

REQUEST_COLUMNS: tuple[str, ...] = (
    "request_id", "conversation_id", "turn", "mode", "prompt_tokens", "output_tokens",
    "history_tokens", "cached_tokens", "computed_tokens", "forward_tokens", "reverse_tokens",
    "reuse_outcome", "prefill_instance", "decode_instance",
    "arrival_s", "prefill_start_s", "prefill_end_s", "first_token_s", "done_s",
    "queue_ms", "reverse_ms", "prefill_ms", "transfer_ms", "decode_wait_ms", "ttft_ms", "e2e_ms",
    "tpot_ms",
)
"""Columns of ``SimResult.requests``, in order. Times in seconds of simulated time from 0;
durations in ms. ``transfer_ms``: forward descriptor setup start -> RDMA done; ``decode_wait_ms``:
KV ready on the decode -> scheduled; ``reuse_outcome`` is "" outside bidirectional mode."""


@dataclass(frozen=True)
class TtftEstimate:
    """TTFT of one simulated mode."""

    mode: Mode
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    n_requests: int
    reuse_share: float = 0.0
    """Share of requests whose history came back from a decode (bidirectional pulls)."""


@dataclass(frozen=True, eq=False)
class SimResult:
    """One simulation's output. ``requests``: one row per request (:data:`REQUEST_COLUMNS`)."""

    config: SimConfig
    requests: pd.DataFrame
    wall_s: float
    events: int
    decode_steps: int
    decode_stall_ms: float
    """Total time the decode engine loops spent building descriptors inline (pull)."""
    timeline: Timeline = field(repr=False, default=Timeline((), ()))
    """What happened to each request and retained history (the spans are built from it)."""

    def ttft(self, *, min_turn: int = 1, warmup_s: float = 0.0) -> TtftEstimate:
        """TTFT percentiles over finished requests (turn >= ``min_turn``) that arrived at or after
        ``warmup_s`` (leave out the warm-up from an empty system to measure the steady state)."""
        df = self.requests
        df = df[(df["turn"] >= min_turn) & df["ttft_ms"].notna() & (df["arrival_s"] >= warmup_s)]
        v = df["ttft_ms"].to_numpy(float)
        pulls = (df["reuse_outcome"] == "pull").sum() if len(df) else 0
        if len(v) == 0:
            return TtftEstimate(self.config.mode, math.nan, math.nan, math.nan, math.nan, 0, 0.0)
        p50, p90, p99 = np.percentile(v, [50, 90, 99])
        return TtftEstimate(self.config.mode, float(p50), float(p90), float(p99), float(v.mean()),
                            int(len(v)), float(pulls) / len(v))

    @property
    def retentions(self) -> list[Retention]:
        return list(self.timeline.retentions)

    def spans(self) -> list:
        """The run's spans as OpenTelemetry SDK ``ReadableSpan`` objects (in memory)."""
        return readable_spans(self.config, self.timeline)

    def write_spans(self, path: str | os.PathLike[str], *, progress: bool = False) -> int:
        """Write the spans as OTLP-JSON lines (the Collector file exporter's format) to ``path``;
        returns the number of spans written."""
        return write_otlp_jsonl(self.config, self.timeline, Path(path), progress=progress)

    def summary(self) -> dict[str, Any]:
        """Plain-JSON summary of the run."""
        est = self.ttft()
        return {
            "mode": self.config.mode.value, "topology": self.config.topology, "name": self.config.name,
            "requests": int(len(self.requests)), "finished": est.n_requests,
            "ttft_p50_ms": est.p50_ms, "ttft_p90_ms": est.p90_ms, "ttft_p99_ms": est.p99_ms,
            "ttft_mean_ms": est.mean_ms, "reuse_share": est.reuse_share,
            "events": self.events, "wall_s": self.wall_s,
        }


def build_result(sim: Simulation, wall_s: float) -> SimResult:
    timeline = sim.timeline
    return SimResult(sim.cfg, requests_table(sim.cfg, timeline), wall_s, sim.events,
                     sum(d.steps for d in sim.decodes), sum(d.stall_ms for d in sim.decodes),
                     timeline)


def requests_table(config: SimConfig, timeline: Timeline) -> pd.DataFrame:
    """The per-request table (:data:`REQUEST_COLUMNS`) of a run's timeline."""
    reqs = timeline.requests
    n = len(reqs)

    def arr(name: str) -> np.ndarray:
        return np.fromiter((getattr(r, name) for r in reqs), dtype=float, count=n)

    def iarr(name: str) -> np.ndarray:
        return np.fromiter((getattr(r, name) for r in reqs), dtype=np.int64, count=n)

    arrival = arr("arrival")
    ps, pe = arr("prefill_start"), arr("prefill_end")
    first, done = arr("first_token"), arr("done")
    hop = config.overheads.hop_ms
    setup_start, rdma_end = arr("setup_start"), arr("rdma_end")
    rev_start, rev_end = arr("rev_setup_start"), arr("rev_rdma_end")
    kv_ready, dstart = arr("kv_ready"), arr("decode_start")
    output = iarr("output")
    ttft = first + hop - arrival
    e2e = done - arrival
    last = arr("last_token")
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(output > 1, (last - first) / np.maximum(output - 1, 1), np.nan)
    pinst, dinst = iarr("pinst"), iarr("dinst")
    df = pd.DataFrame({
        "request_id": [request_id(r.idx) for r in reqs],
        "conversation_id": [conversation_id(r.conv) for r in reqs],
        "turn": iarr("turn"),
        "mode": np.full(n, config.mode.value, dtype=object),
        "prompt_tokens": iarr("prompt"),
        "output_tokens": output,
        "history_tokens": iarr("history"),
        "cached_tokens": iarr("cached"),
        "computed_tokens": iarr("computed"),
        "forward_tokens": iarr("fwd_tokens"),
        "reverse_tokens": iarr("rev_tokens"),
        "reuse_outcome": [r.outcome for r in reqs],
        "prefill_instance": pinst,
        "decode_instance": dinst,
        "arrival_s": arrival / 1e3,
        "prefill_start_s": ps / 1e3,
        "prefill_end_s": pe / 1e3,
        "first_token_s": first / 1e3,
        "done_s": done / 1e3,
        "queue_ms": ps - arr("queue_enter"),
        "reverse_ms": rev_end - rev_start,
        "prefill_ms": pe - ps,
        "transfer_ms": rdma_end - setup_start,
        "decode_wait_ms": dstart - kv_ready,
        "ttft_ms": ttft,
        "e2e_ms": e2e,
        "tpot_ms": tpot,
    }, columns=list(REQUEST_COLUMNS))
    df["mode"] = df["mode"].astype("string")
    df["reuse_outcome"] = df["reuse_outcome"].astype("string")
    return df


def simulate(config: SimConfig, *, progress: bool = False) -> SimResult:
    """Run one simulation (deterministic for a given ``config.seed``)."""
    t0 = time.perf_counter()
    sim = Simulation(config, progress=progress).run()
    wall = time.perf_counter() - t0
    return build_result(sim, wall)
