"""``kv.rdma`` time per size from Tempo's metrics (``kvtune.traces.tempo_rdma``) and the fit from
its medians (``kvtune.analysis.fit.fit_floor_medians``): hand-computed numbers, and the recorded
stand-in (``tests/tempo_standin.py``), which answers the per-size queries from the recorded spans
as Tempo does (checked against real Tempo 2.10.8 and 3.0.3 in ``test_traces_tempo_real.py``)."""
from __future__ import annotations

import argparse
import math

import pytest
from tempo_standin import rdma_spans, serve, tempo_log2_quantile

from kvtune import spans as sc
from kvtune.analysis.fit import fit_floor_medians
from kvtune.errors import AnalysisError
from kvtune.traces import TempoSource
from kvtune.traces.cli import run_fleet
from kvtune.traces.tempo_metrics import fleet_metrics
from kvtune.traces.tempo_rdma import (
    FIT_SOURCE,
    TRACE_FIT_SOURCE,
    rdma_queries,
    rdma_quantiles,
)


def test_the_queries_are_one_quantile_and_one_count_by_mode_direction_and_bytes():
    q = rdma_queries()
    assert q["quantiles"] == ('{ name = "kv.rdma" } | quantile_over_time(duration, 0.5, 0.9) '
                              'by (span.kv.mode, span.kv.direction, span.kv.bytes)')
    assert q["counts"] == ('{ name = "kv.rdma" } | count_over_time() '
                           'by (span.kv.mode, span.kv.direction, span.kv.bytes)')


def test_tempos_log2_quantile_by_hand():
    # 3, 3, 3 ns fall in the bucket (2, 4], 5 ns in (4, 8]: the median is the 2nd of 4, two
    # thirds into the first bucket, exponentially from 2: 2 ** (1 + 2/3); p90 is the 4th: 8
    assert tempo_log2_quantile(0.5, [3, 3, 3, 5]) == pytest.approx(2 ** (1 + 2 / 3))
    assert tempo_log2_quantile(0.9, [3, 3, 3, 5]) == 8.0
    # the bucket below is the non-empty one: 3 ns in (2, 4], 100 ns in (64, 128]: p75 is the 3rd,
    # two thirds of the way from 4 to 128 in log2
    assert tempo_log2_quantile(0.75, [3, 100, 100, 100]) == pytest.approx(2 ** (2 + 5 * 2 / 3))


def test_fit_from_medians_recovers_a_known_line_and_weights_by_count():
    sizes = [1e6, 2e6, 4e6, 8e6]
    ms = [0.5 + b * 8 / 10e9 * 1e3 for b in sizes]  # 0.5 ms floor, 10 Gbit/s
    fit = fit_floor_medians(sizes, ms, [5, 5, 5, 5], source="x")
    assert (fit.floor_ms, fit.bandwidth_gbps) == (pytest.approx(0.5), pytest.approx(10.0))
    assert (fit.n_transfers, fit.n_sizes, fit.source) == (20, 4, "x")
    # one size off the line: with 1000 transfers on the line and 1 on the outlier, the line wins
    off = [*ms[:3], ms[3] * 2]
    heavy = fit_floor_medians(sizes, off, [1000, 1000, 1000, 1], source="x")
    light = fit_floor_medians(sizes, off, [1, 1, 1, 1000], source="x")
    assert abs(heavy.floor_ms - 0.5) < 0.01 and abs(heavy.bandwidth_gbps - 10) < 0.1
    assert light.bandwidth_gbps < 8
    # a negative intercept is held at 0
    assert fit_floor_medians([1e6, 2e6, 4e6], [0.5, 1.6, 3.4], [3, 3, 3]).floor_ms == 0.0
    with pytest.raises(AnalysisError, match="2 distinct size"):
        fit_floor_medians([1e6, 2e6], [1.0, 2.0], [10, 10])
    with pytest.raises(AnalysisError, match="does not grow with bytes"):
        fit_floor_medians([1e6, 2e6, 4e6], [3.0, 2.0, 1.0], [3, 3, 3])


def _recorded_groups(rec) -> dict[tuple[str, str, int], list[int]]:
    out: dict[tuple[str, str, int], list[int]] = {}
    for sp in rdma_spans(rec):
        a = {kv["key"]: next(iter(kv["value"].values())) for kv in sp["attributes"]}
        out.setdefault((a[sc.MODE], a[sc.DIRECTION], int(a[sc.BYTES])), []).append(
            int(sp["endTimeUnixNano"]) - int(sp["startTimeUnixNano"]))
    return out


def test_quantiles_per_size_are_read_from_tempos_answer():
    with serve() as (host, state):
        src = TempoSource(f"http://{host}")
        now = math.ceil(state.shift_ns / 1e9 + max(int(sp["startTimeUnixNano"]) for sp in
                                                   rdma_spans(state.rec)) / 1e9) + 1
        got = rdma_quantiles(src, now - 3600, now)
        paths = [p for p, _ in state.requests]
    groups = _recorded_groups(state.rec)
    assert not got.missing and not got.refused and paths == ["/api/metrics/query"] * 2
    assert {(r.mode, r.direction, r.bytes): r.count for r in got.rows} == {
        k: len(v) for k, v in groups.items()}
    pull = {r.bytes: r for r in got.rows if (r.mode, r.direction) == ("pull", "forward")}
    assert pull[131072].count == 9
    assert pull[131072].p50_ms == pytest.approx(tempo_log2_quantile(0.5, groups[
        ("pull", "forward", 131072)]) / 1e6)
    assert pull[131072].p90_ms == pytest.approx(tempo_log2_quantile(0.9, groups[
        ("pull", "forward", 131072)]) / 1e6)
    # the fit is the medians' fit, weighted by the counts, and says so
    want = fit_floor_medians(list(pull), [r.p50_ms for r in pull.values()],
                             [r.count for r in pull.values()])
    assert got.fits["pull/forward"].floor_ms == pytest.approx(want.floor_ms)
    assert got.fits["pull/forward"].source == FIT_SOURCE
    assert "2 distinct size(s)" in got.unfitted["bidirectional/reverse"]
    assert "does not grow with bytes" in got.unfitted["push/forward"]


def test_a_range_longer_than_one_request_is_refused_saying_why():
    with serve() as (host, state):
        fleet = fleet_metrics(TempoSource(f"http://{host}"), 1_000_000, 1_000_000 + 86400)
        asked = [q["q"][0] for _, q in state.requests]
    assert fleet.rdma.refused and not fleet.rdma.rows
    assert "quantiles of pieces cannot be merged" in fleet.rdma.refused
    assert not set(rdma_queries().values()) & set(asked)
    notes = {f["code"]: f["message"] for f in fleet.findings()}
    assert "24 h" in notes["tempo_rdma_quantiles_not_asked"]
    assert "not asked" in fleet.summary()


def test_a_partial_answer_of_the_quantiles_is_said():
    with serve(metrics_jobs=(1, 2)) as (host, _):
        got = rdma_quantiles(TempoSource(f"http://{host}"), 1_000_000, 1_000_000 + 3600)
    assert len(got.missing) == 2 and all("completed 1 of 2" in m for m in got.missing)
    assert got.missing[0].startswith("rdma quantiles:")


def test_the_cli_sets_the_trace_fit_beside_tempos(capsys):
    with serve() as (host, _):
        assert run_fleet(argparse.Namespace(source=f"tempo+http://{host}?since=1h",
                                            traces=True)) == 0
    out = capsys.readouterr().out
    assert "pull/forward 131072 B: n=9" in out
    assert f"pull/forward: {FIT_SOURCE}: floor" in out
    assert f"{TRACE_FIT_SOURCE}: floor" in out


def test_kv_rdma_spans_read_beyond_tempos_counts_are_a_warning():
    from kvtune.traces.tempo_metrics import FleetMetrics, short_of_read
    from kvtune.traces.tempo_rdma import RdmaQuantiles, SizeQuantiles

    rows = (SizeQuantiles("pull", "forward", 131072, 9, 1.0, 2.0),
            SizeQuantiles("pull", "forward", 262144, 8, 1.0, 2.0))
    fleet = FleetMetrics(0, 3600, {}, {}, {}, requests=5, rdma=RdmaQuantiles(0, 3600, rows))
    assert short_of_read(fleet, {}, {("pull", "forward", 131072): 9}) is fleet
    short = short_of_read(fleet, {}, {("pull", "forward", 131072): 10,
                                      ("push", "forward", 4096): 1})
    (warning,) = [f for f in short.findings() if f["severity"] == "warning"]
    assert ("pull/forward 131072 B: 10 read, 9 counted, push/forward 4096 B: 1 read, 0 counted"
            in warning["message"])
