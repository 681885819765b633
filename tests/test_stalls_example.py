"""The committed stall example (examples/stalls): real spans of the CPU pair, before and after.

``before``: NIXL's default progress thread (spins a core per agent); ``after``: kvtune's
``kvtune_progress_delay_us`` = 1000. Both: 30 requests per mode through the real vLLM pair with
one CPU-bound process beside it (``bench/stalls.py``). The analysis, not a person, must name where
the stalled requests' time went, and ``recommend`` must turn that into a readiness finding.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtune import spans as S
from kvtune.analysis import transfers
from kvtune.analysis.stalls import EXTRA_COLS, stall_diagnosis
from kvtune.connectors.progress import EXTRA_CONFIG_KEY, RECOMMENDED_DELAY_US
from kvtune.recommend import recommend
from kvtune.recommend.findings import OUTSIDE_TRANSFER_COLS, readiness
from kvtune.traces import load

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "stalls"
SUMMARY = json.loads((EXAMPLE / "summary.json").read_text())


def _spans(run: str):
    return load(EXAMPLE / run / "spans")


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_before_the_analysis_names_time_outside_the_transfer(mode: str) -> None:
    spans = _spans(f"{mode}-default")
    tx = transfers(spans)
    diag = stall_diagnosis(tx, spans)
    assert diag.n_requests >= 30
    assert diag.n_stalled >= 1 and diag.fast_trace and diag.slow_trace
    assert diag.dominant_phase in OUTSIDE_TRANSFER_COLS
    # the stalled requests' time is not in the READ/WRITE: the stalled row's transfer phases are
    # a small part of its time
    slow = diag.table.set_index("trace_id").loc[diag.slow_trace]
    phase_ms = sum(float(slow[S.PHASE_COLUMNS[p]]) for p in S.PHASES
                   if S.PHASE_COLUMNS[p] in slow.index and slow[S.PHASE_COLUMNS[p]] == slow[
                       S.PHASE_COLUMNS[p]])
    assert phase_ms < 0.5 * float(slow["request_ms"])
    for col in EXTRA_COLS:
        assert col in diag.table.columns
    # the side-by-side figure has the slowest and the fastest request
    from kvtune.analysis.stalls import side_by_side_figure
    fig = side_by_side_figure(diag)
    labels = set(fig.data[0].x)
    assert any(x.startswith("slowest") for x in labels) and any(x.startswith("fastest")
                                                               for x in labels)


def test_before_recommend_reports_the_pattern_with_the_setting() -> None:
    tuning = recommend(_spans("pull-default"))
    found = {f.code: f for f in tuning.findings}
    f = found["stalls_outside_transfer"]
    assert f.severity == "warning"
    assert f.evidence["setting"] == {EXTRA_CONFIG_KEY: RECOMMENDED_DELAY_US}
    assert f.evidence["progress_delay_us_seen"] == [0]
    assert EXTRA_CONFIG_KEY in f.message


def test_after_the_setting_is_seen_in_force() -> None:
    spans = _spans("pull-sleeping-progress")
    assert set(spans[S.NIXL_PROGRESS_DELAY_US].dropna().astype(int)) == {RECOMMENDED_DELAY_US}
    for f in readiness(transfers(spans), spans, fit=None, workload=None):
        if f.code == "stalls_outside_transfer":
            assert f.evidence["setting"] is None  # already in force: no advice to set it again


def test_summary_records_before_and_after_for_every_mode() -> None:
    runs = {(r["mode"], r["setting"]): r for r in SUMMARY}
    for mode in ("pull", "push", "bidirectional"):
        before, after = runs[(mode, "default")], runs[(mode, "sleeping-progress")]
        assert before["ok"] >= 30 and after["ok"] >= 30
        assert after["idle_cores"] < before["idle_cores"]


def test_timeline_shows_every_span_of_the_slowest_and_fastest_request() -> None:
    from kvtune.analysis.stalls import timeline_figure

    spans = _spans("push-default")
    diag = stall_diagnosis(transfers(spans), spans)
    fig = timeline_figure(diag, spans)
    assert len(fig.data) == 2
    slow = spans[spans["trace_id"] == diag.slow_trace]
    slow_bar = fig.data[0]
    assert any("kv.prefill" in y for y in slow_bar.y)
    assert len(slow_bar.y) == len(slow[slow["name"] != S.SpanName.RETENTION.value])
    # bars start at their span's offset from the request's first span
    assert min(slow_bar.base) == 0.0
    assert max(b + x for b, x in zip(slow_bar.base, slow_bar.x)) == pytest.approx(
        float(diag.table.set_index("trace_id").loc[diag.slow_trace, "request_ms"]), rel=0.01)
