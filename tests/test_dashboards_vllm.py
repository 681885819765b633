"""The dashboard on spans from real vLLM: a prefill/decode pair on CPU with kvtune's instrumented
connectors in push mode (the mode that has all six phases). Every phase panel must show rows, and
the slowest-transfers table must lead to a trace that holds every phase of that transfer.

Run with ``flock /tmp/kvt/vllm.lock .venv/bin/python -m pytest -m vllm tests/test_dashboards_vllm.py``.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvtune import spans as sc
from kvtune import traces
from kvtune.dashboards import generator as gen
from kvtune.dashboards.check import DashboardCheck, check_panels
from kvtune.dashboards.evaluate import evaluate

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")
from kvtune.local.pair import LocalPair  # noqa: E402

FAST_EXPORT_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
"""vLLM ends its engine processes without flushing spans: export every 100 ms while they run."""
SPANS_WAIT_S = 180.0
"""Bound on waiting for the spans to reach the files (busy 2-core machine)."""
PROMPTS = (tuple(range(20, 116)), tuple(range(300, 380)))
MAX_TOKENS = 8


def _wait_for_phases(spans_dir: Path, pair: LocalPair) -> tuple[DashboardCheck, object]:
    deadline = time.monotonic() + SPANS_WAIT_S
    result = None
    while True:
        if any(spans_dir.glob("*.jsonl")):
            df = traces.load(spans_dir)
            result = check_panels(df, variables={"mode": [sc.Mode.PUSH.value]})
            if not result.empty_phases:
                return result, df
        if time.monotonic() > deadline:
            table = result.table() if result is not None else "(no span files)"
            raise AssertionError(f"phase panels still empty after {SPANS_WAIT_S} s:\n{table}\n{pair.logs()}")
        time.sleep(0.5)


def test_every_phase_panel_shows_real_vllm_push_transfers(tmp_path):
    spans_dir = tmp_path / "spans"
    with LocalPair("push", connector="kvtune", workdir=tmp_path / "work", spans_dir=spans_dir,
                   extra_env=FAST_EXPORT_ENV) as pair:
        for i, prompt in enumerate(PROMPTS):
            pair.complete(list(prompt), MAX_TOKENS, request_id=f"dash-push-{i}")
        result, df = _wait_for_phases(spans_dir, pair)

    phases = {p.phase: p.rows for p in result.panels if p.phase}
    assert set(phases) == {ph.value for ph in sc.PHASES} and all(phases.values())
    by_title = {p.title: p.rows for p in result.panels}
    assert by_title["Transfers per second by mode and direction"] > 0
    assert by_title["Bytes moved by mode and direction"] > 0

    vars_ = {**gen.DEFAULT_VARIABLE_VALUES, "mode": [sc.Mode.PUSH.value]}
    slow = evaluate(gen.slowest_transfers_query(), df, variables=vars_, all_values=gen.ALL_VALUES)
    assert len(slow) > 0 and (slow[f"span.{sc.BYTES}"] > 0).all()
    # the table's row -> traceID -> trace panel: that trace holds every phase of the transfer
    row = slow.sort_values("duration_ms", ascending=False).iloc[0]
    in_trace = df[(df["trace_id"] == row["trace_id"])
                  & (df[sc.TRANSFER_ID] == row[f"span.{sc.TRANSFER_ID}"])]
    assert {ph.value for ph in sc.PHASES} <= set(in_trace["name"])
