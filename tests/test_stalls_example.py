"""The committed stall examples: real spans of the CPU pair before the fix (examples/stalls: vLLM's
CPU worker process and NIXL's spinning progress thread, 30 requests per mode with one CPU-bound
process beside the pair) and after it (examples/stalls-side-by-side: the quiet layout). The
analysis, not a person, must name where the stalled requests' time went, and ``recommend`` must
turn that into a readiness finding with the settings that fixed it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtune import spans as S
from kvtune.analysis import transfers
from kvtune.analysis.stalls import EXTRA_COLS, stall_diagnosis
from kvtune.connectors.progress import THREAD_KEY
from kvtune.local.layout import ONE_PROCESS_ENV, QUIET
from kvtune.recommend import recommend
from kvtune.recommend.findings import OUTSIDE_TRANSFER_COLS, readiness
from kvtune.traces import load

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "stalls"
AFTER = Path(__file__).resolve().parents[1] / "examples" / "stalls-side-by-side"
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
    assert f.evidence["setting"] == QUIET.kv_extra_config("pull")
    assert f.evidence["setting"][THREAD_KEY] is False
    assert f.evidence["setting_env_cpu"] == ONE_PROCESS_ENV
    assert f.evidence["progress_delay_us_seen"] == [0]
    assert THREAD_KEY in f.message and "VLLM_ENABLE_V1_MULTIPROCESSING=0" in f.message


@pytest.mark.parametrize("mode", ["pull", "push", "bidirectional"])
def test_after_nothing_stalls_and_nothing_is_advised(mode: str) -> None:
    spans = load(AFTER / f"quiet-{mode}-kvtune" / "spans")
    for f in readiness(transfers(spans), spans, fit=None, workload=None):
        assert f.code != "stalls_outside_transfer"
    # the same spans with a stall pattern would not repeat the setting: it is in force
    assert set(spans[S.NIXL_PROGRESS_DELAY_US].dropna().astype(int)) == {-1}


def test_summary_records_the_starved_pair_in_every_mode() -> None:
    runs = {r["mode"]: r for r in SUMMARY}
    for mode in ("pull", "push", "bidirectional"):
        before = runs[mode]
        assert before["setting"] == "default" and before["ok"] >= 30
        assert before["idle_cores"] > 1.5  # the spinning pair used most of the 2 cores
        assert before["max_ms"] > 10_000


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
