"""One recorded run, three views of where its TTFT went: `bench/attribution.py`, the report (the
stalls notebook, executed with papermill: its table and its waterfalls) and the committed Grafana
panel's TraceQL (run by kvtune's evaluator, whose answers match a real Tempo's elsewhere). They
must print the same shares for the same spans (docs/spans.md, "Two views of the same spans")."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest

from kvtune import traces
from kvtune.analysis import attribution
from kvtune.dashboards import generator as gen
from kvtune.dashboards.evaluate import evaluate

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "examples" / "fleet" / "tune" / "spans"
PANEL_TITLE = "Share of time per phase (router legs and engine spans)"
ROW = re.compile(r"^(\S+)\s+(kv\.\S+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)$")
PCT = 0.0005 + 1e-9  # the bench prints shares to 0.1%


def pct(text: str) -> float | None:
    return None if text == "-" else float(text.rstrip("%")) / 100


@pytest.fixture(scope="module")
def spans():
    return traces.load(str(RUN))


@pytest.fixture(scope="module")
def bench_rows():
    spec = importlib.util.spec_from_file_location("bench_attribution", ROOT / "bench" / "attribution.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert mod.main([str(RUN)]) == 0
    rows = {}
    for line in buf.getvalue().splitlines():
        m = ROW.match(line.strip())
        if m:
            mode, phase, n, med, total, panel = m.groups()
            rows[(mode, phase)] = (int(n), pct(med), pct(total), pct(panel))
    assert rows, buf.getvalue()
    return rows


def panel_query() -> str:
    board = json.loads((ROOT / "dashboards" / "kv-transfer.json").read_text())
    panels = [p for p in board["panels"] if p.get("title") == PANEL_TITLE]
    assert len(panels) == 1, [p.get("title") for p in board["panels"]]
    return panels[0]["targets"][0]["query"]


def test_grafana_panel_shows_the_bench_panel_column(spans, bench_rows):
    query = panel_query()
    modes = {mode for mode, _ in bench_rows}
    assert {"pull", "push", "bidirectional"} <= modes
    for mode in sorted(modes):
        answer = evaluate(query, spans, variables={**gen.DEFAULT_VARIABLE_VALUES, "mode": mode},
                          all_values=gen.ALL_VALUES)
        total = float(answer["value"].sum())
        panel = {str(n): float(v) / total for n, v in zip(answer["name"], answer["value"])}
        bench = {ph: r[3] for (m, ph), r in bench_rows.items() if m == mode and r[3] is not None}
        assert set(panel) == set(bench), mode
        for phase, share in panel.items():
            assert abs(share - bench[phase]) <= PCT, (mode, phase, share, bench[phase])


def test_report_table_and_waterfalls_show_the_bench_shares(spans, bench_rows, tmp_path):
    from kvtune.tune.notebooks import run_notebook
    figures = tmp_path / "figures"
    run = run_notebook("stalls", tmp_path / "nb", {"traces": str(RUN), "out_dir": str(tmp_path)},
                       figures_dir=figures)
    table = run.values["ttft_phase_shares"]
    assert table, "the report tabulates no phase"
    seen = set()
    for row in table:
        n, med, total, _ = bench_rows[(row["mode"], row["phase"])]
        assert row["n_requests"] == n
        assert abs(row["share_p50"] - med) <= PCT and abs(row["share_total"] - total) <= PCT, row
        seen.add((row["mode"], row["phase"]))
    assert seen == {k for k, r in bench_rows.items() if r[1] is not None}

    # Each waterfall's legend names its request's shares: the same phase_shares the bench sums.
    shares = attribution.phase_shares(spans)
    drawn = sorted(figures.glob("stalls--waterfall-*.json"))
    assert len(drawn) >= attribution.WATERFALL_SLOWEST
    for path in drawn:
        fig = json.loads(path.read_text())
        prefix = path.stem.split("waterfall-", 1)[1]
        mine = shares[shares["trace_id"].str.startswith(prefix)]
        assert mine["trace_id"].nunique() == 1, prefix
        want = dict(zip(mine["phase"], mine["share"]))
        legend = {}
        for tr in fig["data"]:
            phase, share = tr["name"].rsplit(" ", 1)
            legend[phase] = pct(share)
        assert set(legend) == set(want), prefix
        for phase, share in legend.items():
            assert abs(share - want[phase]) <= PCT, (prefix, phase, share, want[phase])

