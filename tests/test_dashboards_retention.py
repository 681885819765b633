"""The decode-retention panels of the committed dashboard (issue 28: held KV, lapses, renewals),
run by kvtune's TraceQL evaluator on ``kv.retention`` spans whose outcomes, hold times, tokens and
renewals are known, and compared with the numbers worked out by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kvtune import spans as sc
from kvtune.dashboards import generator as gen
from kvtune.dashboards.evaluate import evaluate
from kvtune.testing import synthetic

ROOT = Path(__file__).resolve().parent.parent
MS = 1_000_000
T0 = synthetic.T0_NS
RETENTION = sc.SpanName.RETENTION.value
OUTCOME = f"span.{sc.RETENTION_OUTCOME}"
RENEWALS = f"span.{sc.RETENTION_RENEWALS}"
STEP_S = 60.0


def _retention(i: int, start_s: float, held_s: float, outcome: sc.RetentionOutcome, tokens: int, *,
               renewals: int | None, conversation: str = "conv-a") -> dict:
    attrs = {sc.CONVERSATION_ID: conversation, sc.MODE: sc.Mode.BIDIRECTIONAL.value,
             sc.TOKENS: tokens, sc.RETENTION_TTL_S: 480.0, sc.RETENTION_OUTCOME: outcome.value}
    if renewals is not None:
        attrs |= {sc.RETENTION_RENEWALS: renewals, sc.RETENTION_LEASE_S: 30.0}
    start = T0 + int(start_s * 1000) * MS
    return {"name": RETENTION, "trace_id": f"{i:032x}", "service": "kvtune-decode", "host": "decode-0",
            "start_ns": start, "end_ns": start + int(held_s * 1000) * MS, "attrs": attrs}


Out = sc.RetentionOutcome
SPANS = (
    # first minute: a leased history reused after 3 renewals, one ended by the router, one lapsed
    _retention(1, 0.0, 2.0, Out.REUSED, 100, renewals=3),
    _retention(2, 0.5, 4.0, Out.ENDED, 50, renewals=1),
    _retention(3, 1.0, 30.0, Out.LAPSED, 200, renewals=0),
    # second minute: a fixed-TTL history (no lease attributes) expired, another lease lapsed
    _retention(4, 61.0, 480.0, Out.EXPIRED, 80, renewals=None),
    _retention(5, 62.0, 10.0, Out.LAPSED, 10, renewals=2),
    # another conversation, released at shutdown (filtered out by the conversation variable)
    _retention(6, 5.0, 7.0, Out.RELEASED, 40, renewals=4, conversation="conv-b"),
)
"""Known retention outcomes; buckets of STEP_S start at the first span (T0)."""


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    rdma = {"name": sc.SpanName.RDMA.value, "trace_id": f"{1:032x}", "service": "kvtune-decode",
            "host": "decode-0", "start_ns": T0 + 100 * MS, "end_ns": T0 + 900 * MS,
            "attrs": {sc.CONVERSATION_ID: "conv-a", sc.TOKENS: 100, sc.BYTES: 1 << 20}}
    return synthetic.spans_frame([*SPANS, rdma])


def _panel(title: str) -> dict:
    board = json.loads((ROOT / "dashboards" / gen.KV_TRANSFER_FILE).read_text(encoding="utf-8"))
    (panel,) = [p for p in board["panels"] if p["title"] == title]
    return panel


def _run(title: str, frame: pd.DataFrame, **variables: str) -> dict[tuple[str, float], float]:
    """{(series label, bucket start s after T0): value} of the committed panel's query."""
    (target,) = _panel(title)["targets"]
    r = evaluate(target["query"], frame, variables={**gen.DEFAULT_VARIABLE_VALUES, **variables},
                 all_values=gen.ALL_VALUES, step_s=STEP_S)
    (label,) = [c for c in r.columns if c not in ("time_s", "value")]
    return {(row[label], round(row["time_s"] - T0 / 1e9)): row["value"] for _, row in r.iterrows()}


def test_held_seconds_by_outcome(frame):
    assert _run("Decode KV held: seconds by outcome", frame, conversation="conv-a") == {
        ("reused", 0): 2.0, ("ended", 0): 4.0, ("lapsed", 0): 30.0,
        ("expired", 60): 480.0, ("lapsed", 60): 10.0}
    every = _run("Decode KV held: seconds by outcome", frame)
    assert every[("released", 0)] == 7.0
    assert sum(every.values()) == pytest.approx(2 + 4 + 30 + 480 + 10 + 7)


def test_held_tokens_by_outcome(frame):
    assert _run("Decode KV held: tokens by outcome", frame, conversation="conv-a") == {
        ("reused", 0): 100.0, ("ended", 0): 50.0, ("lapsed", 0): 200.0,
        ("expired", 60): 80.0, ("lapsed", 60): 10.0}


def test_outcomes_over_time_show_lapses(frame):
    got = _run("Retention outcomes", frame)
    assert got == {("reused", 0): 1.0, ("ended", 0): 1.0, ("lapsed", 0): 1.0, ("released", 0): 1.0,
                   ("expired", 60): 1.0, ("lapsed", 60): 1.0}
    assert sum(v for (o, _), v in got.items() if o == Out.LAPSED.value) == 2.0


def test_renewals_per_retained_history(frame):
    # histories per renewal count; the fixed-TTL history has no count and groups under nil
    assert _run("Renewals per retained history", frame, conversation="conv-a") == {
        ("3", 0): 1.0, ("1", 0): 1.0, ("0", 0): 1.0, ("nil", 60): 1.0, ("2", 60): 1.0}


@pytest.mark.parametrize("title", ["Retention outcomes", "Decode KV held: seconds by outcome",
                                   "Decode KV held: tokens by outcome"])
def test_lapses_are_red_on_outcome_panels(title):
    overrides = _panel(title)["fieldConfig"]["overrides"]
    colors = {o["matcher"]["options"]: o["properties"][0]["value"]["fixedColor"] for o in overrides}
    lapsed = [c for m, c in colors.items() if Out.LAPSED.value in m]
    assert lapsed == ["red"]
    assert len(set(colors.values())) == len(sc.RetentionOutcome)


def test_held_seconds_match_the_synthetic_server():
    """On a bidirectional synthetic run: the held-seconds panel sums every retention span's hold,
    per outcome, over all buckets."""
    df = synthetic.serving_spans(mode=sc.Mode.BIDIRECTIONAL, seed=4)
    ret = df[df["name"] == RETENTION]
    assert set(ret[sc.RETENTION_OUTCOME]) == {Out.REUSED.value, Out.EXPIRED.value}
    want = ((ret["end_ns"] - ret["start_ns"]) / 1e9).groupby(ret[sc.RETENTION_OUTCOME]).sum()
    got: dict[str, float] = {}
    for (outcome, _), v in _run("Decode KV held: seconds by outcome", df).items():
        got[outcome] = got.get(outcome, 0.0) + v
    assert got == pytest.approx(want.to_dict())
