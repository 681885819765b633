"""Attribution of TTFT to named phases (kvtune.analysis.attribution), on hand-built requests."""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

from kvtune import spans as S
from kvtune.analysis import attribution as A
from kvtune.recommend.findings import UNNAMED_SHARE_LIMIT, unnamed_time_finding
from kvtune.testing.synthetic import Step, request_spans, spans_frame

N, R = S.SpanName, S.Role
DOC = Path(__file__).resolve().parents[1] / "docs" / "spans.md"

# A pull request, TTFT 100 ms, in ms from the router's kv.request start:
#   route 0-1, prefill leg 1-50 (queue 5-10, prefill 10-45), handoff 50-52,
#   decode leg 52-120 (queue 60-70, setup 70-72, rdma 72-90, notify 91 (instant),
#   decode_start 95-100). TTFT ends at decode_start's end: 100 ms.
PULL_STEPS = (
    Step(N.ROUTE, R.ROUTER, 0, 1), Step(N.PREFILL_LEG, R.ROUTER, 1, 50),
    Step(N.QUEUE, R.PREFILL, 5, 10), Step(N.PREFILL, R.PREFILL, 10, 45),
    Step(N.HANDOFF, R.ROUTER, 50, 52), Step(N.DECODE_LEG, R.ROUTER, 52, 120),
    Step(N.QUEUE, R.DECODE, 60, 70), Step(N.DESCRIPTOR_SETUP, R.DECODE, 70, 72),
    Step(N.RDMA, R.DECODE, 72, 90), Step(N.NOTIFY, R.PREFILL, 91, 91),
    Step(N.DECODE_START, R.DECODE, 95, 100),
)
PULL_MS = {  # hand-computed: engine spans win over the legs they nest in
    N.ROUTE.value: 1, N.PREFILL_LEG.value: 4 + 5, N.QUEUE.value: 5 + 10, N.PREFILL.value: 35,
    N.HANDOFF.value: 2, N.DECODE_LEG.value: 8 + 5, N.DESCRIPTOR_SETUP.value: 2, N.RDMA.value: 18,
    N.DECODE_START.value: 5,
}
WITHOUT_ROUTER = tuple(s for s in PULL_STEPS if s.name not in S.ROUTER_PHASES)


def _frame(steps, *, trace_id="a" * 32, end_ms=200.0, **kw):
    return spans_frame(request_spans(steps, end_ms=end_ms, trace_id=trace_id, **kw))


def test_output_columns_are_the_documented_ones():
    df = _frame(PULL_STEPS)
    assert tuple(A.phase_shares(df).columns) == A.PHASE_COLUMNS == (
        "trace_id", "mode", "ttft_ms", "phase", "ms", "share")
    assert tuple(A.request_attribution(df).columns) == A.REQUEST_COLUMNS == (
        "trace_id", "mode", "start_ns", "ttft_ms", "named_ms", "unnamed_ms", "named_share",
        "unnamed_share", "gap_ms", "gap_after", "gap_before")
    assert tuple(A.segments(df).columns) == A.SEGMENT_COLUMNS == (
        "trace_id", "phase", "start_ms", "end_ms")
    empty = spans_frame([])
    assert tuple(A.phase_shares(empty).columns) == A.PHASE_COLUMNS
    assert tuple(A.request_attribution(empty).columns) == A.REQUEST_COLUMNS


def test_every_millisecond_of_a_traced_pull_request_is_named_once():
    shares = A.phase_shares(_frame(PULL_STEPS))
    got = dict(zip(shares["phase"], shares["ms"]))
    assert got == pytest.approx(PULL_MS)
    assert A.UNNAMED not in got and sum(got.values()) == pytest.approx(100.0)
    assert shares["share"].sum() == pytest.approx(1.0)
    assert (shares["ttft_ms"] == 100.0).all() and set(shares["mode"]) == {S.Mode.PULL.value}
    row = A.request_attribution(_frame(PULL_STEPS)).iloc[0]
    assert row["named_share"] == pytest.approx(1.0) and row["unnamed_ms"] == 0
    assert row["gap_after"] is None and row["gap_before"] is None


def test_without_the_router_spans_the_legs_time_is_unnamed_between_its_neighbours():
    row = A.request_attribution(_frame(WITHOUT_ROUTER)).iloc[0]
    # unnamed: 0-5, 45-60, 90-95 (the notify instant takes no time)
    assert row["unnamed_ms"] == pytest.approx(25.0)
    assert row["named_share"] == pytest.approx(0.75)
    assert row["gap_ms"] == pytest.approx(15.0)
    assert (row["gap_after"], row["gap_before"]) == (N.PREFILL.value, N.QUEUE.value)


def test_segments_abut_and_cover_the_window():
    seg = A.segments(_frame(WITHOUT_ROUTER))
    assert seg["start_ms"].iloc[0] == 0 and seg["end_ms"].iloc[-1] == pytest.approx(100.0)
    assert (seg["start_ms"].iloc[1:].to_numpy() == seg["end_ms"].iloc[:-1].to_numpy()).all()
    assert list(seg["phase"])[:3] == [A.UNNAMED, N.QUEUE.value, N.PREFILL.value]


def test_push_legs_side_by_side_the_latest_started_span_of_a_layer_wins():
    # push: both legs from 1 ms; the decode registers (3-4) while the prefill queues (2-6);
    # rendezvous 4-30 waits for the prefill (6-30); write 30-40; decode_start 40-42.
    steps = (Step(N.ROUTE, R.ROUTER, 0, 1), Step(N.PREFILL_LEG, R.ROUTER, 1, 45),
             Step(N.DECODE_LEG, R.ROUTER, 1, 80), Step(N.QUEUE, R.PREFILL, 2, 6),
             Step(N.REGISTRATION, R.DECODE, 3, 4), Step(N.RENDEZVOUS, R.PREFILL, 4, 30),
             Step(N.PREFILL, R.PREFILL, 6, 30), Step(N.RDMA, R.PREFILL, 30, 40),
             Step(N.DECODE_START, R.DECODE, 40, 42))
    got = A.phase_shares(_frame(steps, mode=S.Mode.PUSH))
    ms = dict(zip(got["phase"], got["ms"]))
    assert ms == pytest.approx({N.ROUTE.value: 1, N.DECODE_LEG.value: 1, N.QUEUE.value: 1,
                                N.REGISTRATION.value: 1, N.RENDEZVOUS.value: 2,
                                N.PREFILL.value: 24, N.RDMA.value: 10,
                                N.DECODE_START.value: 2})


def test_named_shares_per_mode_median_and_p10():
    frames = [_frame(PULL_STEPS, trace_id=f"{i + 1:032x}") for i in range(3)]
    frames.append(_frame(WITHOUT_ROUTER, trace_id=f"{9:032x}"))
    table = A.request_attribution(pd.concat(frames, ignore_index=True))
    (summary,) = A.named_shares(table).values()
    assert summary.mode == S.Mode.PULL.value and summary.n_requests == 4
    assert summary.named_share_p50 == pytest.approx(1.0)
    assert summary.named_share_p10 == pytest.approx(0.75 + 0.3 * 0.25)  # numpy's linear rule
    assert (summary.gap_after, summary.gap_before) == (N.PREFILL.value, N.QUEUE.value)


def test_finding_fires_when_a_phase_is_removed_from_the_trace():
    full = pd.concat([_frame(PULL_STEPS, trace_id=f"{i + 1:032x}") for i in range(5)],
                     ignore_index=True)
    assert unnamed_time_finding(full) is None
    without_handoff = full[(full["name"] != N.HANDOFF.value).to_numpy(dtype=bool)]
    # 2 ms of 100 is under the limit; the decode leg removed leaves 13 ms unnamed
    assert unnamed_time_finding(without_handoff) is None
    without_leg = full[(full["name"] != N.DECODE_LEG.value).to_numpy(dtype=bool)]
    finding = unnamed_time_finding(without_leg)
    assert finding is not None and finding.code == "ttft_unnamed"
    ev = finding.evidence["modes"][S.Mode.PULL.value]
    assert 1 - ev["named_share_p50"] > UNNAMED_SHARE_LIMIT
    assert (ev["gap_after"], ev["gap_before"]) == (N.HANDOFF.value, N.QUEUE.value)
    assert N.HANDOFF.value in finding.message and N.QUEUE.value in finding.message


def test_requests_without_a_decode_step_are_left_out():
    steps = tuple(s for s in PULL_STEPS if s.name is not N.DECODE_START)
    assert A.request_attribution(_frame(steps)).empty


def test_the_span_convention_doc_lists_every_span():
    listed = set(re.findall(r"^\| `(kv\.[a-z_]+)` \|", DOC.read_text(encoding="utf-8"), re.M))
    assert listed == S.span_names()


def test_waterfall_draws_each_phase_with_its_share_slowest_and_typical_chosen():
    from kvtune import plots
    frames = [_frame(PULL_STEPS, trace_id=f"{i + 1:032x}") for i in range(4)]
    frames.append(_frame(WITHOUT_ROUTER, trace_id=f"{9:032x}", end_ms=300.0))
    df = pd.concat(frames, ignore_index=True)
    ttfts = pd.DataFrame({"trace_id": ["a", "b", "c"], "ttft_ms": [10.0, 50.0, 20.0]})
    assert A.waterfall_requests(ttfts, slowest=1) == ["b", "c"]
    assert A.waterfall_requests(ttfts, slowest=3) == ["b", "c", "a"]
    seg = A.segments(df)
    fig = plots.waterfall(seg, f"{9:032x}")
    names = {t.name for t in fig.data}
    assert f"{A.UNNAMED} 25.0%" in names and f"{N.PREFILL.value} 35.0%" in names
    assert sum(len(t.x) for t in fig.data) == len(seg[seg["trace_id"] == f"{9:032x}"])
