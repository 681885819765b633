"""The committed side-by-side stall run (examples/stalls-side-by-side, ``bench/stalls.py``): the
local pair in two layouts, pull and bidirectional, kvtune's connectors and vLLM's own on the same
30 requests. The claims the README makes of it must hold in the data, and kvtune's spans of it must
carry the layout's NIXL setting and be analysable."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvtune import spans as S
from kvtune.analysis import transfers
from kvtune.analysis.stalls import stall_diagnosis
from kvtune.connectors.progress import NO_THREAD_SPAN_VALUE, RECOMMENDED_DELAY_US
from kvtune.traces import load

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "stalls-side-by-side"
SUMMARY = json.loads((EXAMPLE / "summary.json").read_text())
ROWS = {(r["layout"], r["mode"], r["connector"]): r for r in SUMMARY}


def test_every_run_has_both_connectors_on_the_same_requests() -> None:
    for layout, mode, _ in ROWS:
        kv, vl = ROWS[(layout, mode, "kvtune")], ROWS[(layout, mode, "vllm")]
        assert kv["n"] == vl["n"] == 30
        assert kv["ok"] == vl["ok"] == 30 and not kv["errors"] and not vl["errors"]
        assert len(kv["latencies_ms"]) == len(vl["latencies_ms"]) == 30


def test_the_table_prints_kvtune_p50_over_vllm_p50() -> None:
    table = (EXAMPLE / "table.md").read_text().splitlines()
    for line in table[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        layout, mode, connector, ratio = cells[0], cells[1], cells[2], cells[-1]
        if connector != "kvtune":
            assert ratio == ""
            continue
        expected = ROWS[(layout, mode, "kvtune")]["p50_ms"] / ROWS[(layout, mode, "vllm")]["p50_ms"]
        assert re.fullmatch(r"\d+\.\d\d", ratio) and float(ratio) == pytest.approx(expected, abs=0.006)


def test_quiet_layout_idles_at_a_fraction_of_the_pinned_one() -> None:
    for connector in ("kvtune", "vllm"):
        assert ROWS[("quiet", "pull", connector)]["idle_cores"] <= 0.2
        assert (ROWS[("quiet", "bidirectional", connector)]["idle_cores"]
                < 0.5 * ROWS[("pinned", "bidirectional", connector)]["idle_cores"])


def test_the_push_hang_left_every_server_threads_stack() -> None:
    row = ROWS[("pinned", "push", "kvtune")]
    assert row["stack_dumps"], "the hung warm-up left no stacks"
    for rel in row["stack_dumps"]:
        text = (EXAMPLE / rel).read_text()
        assert text.startswith("pid ") and "thread " in text
    workers = [t for t in ((EXAMPLE / r).read_text() for r in row["stack_dumps"])
               if "VLLM::Worker" in t.splitlines()[0]]
    assert workers and all("nixl-push-writer" in t for t in workers)


@pytest.mark.parametrize("layout, mode, delay", [
    ("pinned", "pull", RECOMMENDED_DELAY_US), ("pinned", "bidirectional", 0), ("pinned", "push", 0),
    ("quiet", "pull", NO_THREAD_SPAN_VALUE), ("quiet", "bidirectional", NO_THREAD_SPAN_VALUE)])
def test_kvtune_spans_carry_the_layout_and_are_analysable(layout, mode, delay) -> None:
    spans = load(EXAMPLE / f"{layout}-{mode}-kvtune" / "spans")
    assert set(spans[S.NIXL_PROGRESS_DELAY_US].dropna().astype(int)) == {delay}
    diag = stall_diagnosis(transfers(spans), spans)
    assert diag.n_requests >= 30
    row = ROWS[(layout, mode, "kvtune")]
    assert diag.dominant_phase == row["stall_phase"]
