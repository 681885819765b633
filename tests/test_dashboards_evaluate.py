"""The evaluator on tiny hand-computed frames, Grafana variable interpolation, and the end-to-end
check: every panel query of the committed dashboard returns rows on spans kvtune's producers wrote
(the simulator; the fabric probe) as OTLP-JSON lines, read back by kvtune's own loader."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from kvtune import spans as sc
from kvtune import telemetry, traces
from kvtune.dashboards import generator as gen
from kvtune.dashboards.check import check_panels
from kvtune.dashboards.evaluate import SEARCH_COLUMNS, evaluate
from kvtune.dashboards.templating import interpolate, variable_names
from kvtune.dashboards.traceql import parse
from kvtune.errors import ConfigError
from kvtune.sim import Dist, WorkloadSpec, simulate
from kvtune.sim.presets import public_h200_qwen3_32b
from kvtune.testing import synthetic

ROOT = Path(__file__).resolve().parent.parent
MS = 1_000_000
T0 = synthetic.T0_NS


def frame(*records: dict) -> pd.DataFrame:
    return synthetic.spans_frame(records)


def rec(name: str, start_ms: float, dur_ms: float, *, trace: str = "a" * 32, service: str = "kvtune-prefill",
        status: str = "UNSET", **attrs) -> dict:
    return {"name": name, "trace_id": trace, "service": service, "status": status,
            "start_ns": T0 + int(start_ms * MS), "end_ns": T0 + int((start_ms + dur_ms) * MS), "attrs": attrs}


RDMA, NOTIFY = sc.SpanName.RDMA.value, sc.SpanName.NOTIFY.value


@pytest.fixture(scope="module")
def small() -> pd.DataFrame:
    return frame(
        rec(RDMA, 0, 10, **{sc.MODE: "pull", sc.DIRECTION: "forward", sc.BYTES: 100}),
        rec(RDMA, 100, 20, **{sc.MODE: "pull", sc.DIRECTION: "forward", sc.BYTES: 300}),
        rec(RDMA, 200, 30, trace="b" * 32, **{sc.MODE: "push", sc.DIRECTION: "forward", sc.BYTES: 1000}),
        rec(RDMA, 1000, 40, trace="c" * 32, status="ERROR", **{sc.MODE: "pull", sc.DIRECTION: "reverse"}),
        rec(NOTIFY, 15, 1, service="kvtune-decode", **{sc.MODE: "pull", sc.TURN: 2}),
        rec(NOTIFY, 215, 2, trace="b" * 32, service="kvtune-decode", **{sc.MODE: "push", "custom.flag": True}),
    )


def test_search_filters_and_select(small):
    r = evaluate('{ name = "kv.rdma" && duration >= 20ms } | select(span.kv.bytes, span.kv.mode)', small)
    assert list(r.columns) == list(SEARCH_COLUMNS) + ["span.kv.bytes", "span.kv.mode"]
    assert r["duration_ms"].tolist() == [20.0, 30.0, 40.0]
    assert str(r["span.kv.bytes"].dtype) == "Int64"
    assert r["span.kv.bytes"].fillna(-1).tolist() == [300, 1000, -1]
    assert r["span.kv.mode"].tolist() == ["pull", "push", "pull"]


@pytest.mark.parametrize("query,expected", [
    ('{ span.kv.bytes > 200 }', 2),
    ('{ span.kv.bytes != 100 }', 2),          # absent attribute: != is false too
    ('{ .kv.bytes <= 100 }', 1),
    ('{ status = error }', 1),
    ('{ status != error }', 5),
    ('{ resource.service.name = "kvtune-decode" }', 2),
    ('{ .service.name =~ "kvtune-.*" }', 6),     # unscoped falls back to resource attributes
    ('{ span.kv.mode =~ "pu" }', 0),             # regexes are anchored, as in Tempo
    ('{ span.kv.mode !~ "pu.*" }', 0),
    ('{ span.kv.mode =~ "pu.*" && !(span.kv.mode = "push") }', 4),
    ('{ span.custom.flag }', 1),
    ('{ span.kv.turn = 2.0 }', 1),
    ('{ span.kv.turn = "2" }', 0),               # type mismatch is false
    ('{ kind = server }', 0),                    # no kind column in the contract
    ('{ }', 6),
    ('{ name = "kv.rdma" } && { name = "kv.notify" }', 5),  # 3 in trace a + 2 in b; c lacks notify
    ('{ name = "kv.rdma" } || { name = "kv.notify" }', 6),
    ('{ name = "kv.rdma" } | { span.kv.mode = "push" }', 1),
])
def test_filter_semantics(small, query, expected):
    assert len(evaluate(query, small)) == expected


def test_quantiles_by_labels_in_seconds(small):
    r = evaluate('{ name = "kv.rdma" } | quantile_over_time(duration, .5, 1) by (span.kv.mode)', small)
    assert list(r.columns) == ["span.kv.mode", "p", "time_s", "value"]
    got = {(m, p): v for m, p, v in zip(r["span.kv.mode"], r["p"], r["value"])}
    assert got == pytest.approx({("pull", "0.5"): 0.020, ("pull", "1"): 0.040,
                                 ("push", "0.5"): 0.030, ("push", "1"): 0.030})


def test_rate_count_sum_avg_min_max_with_buckets(small):
    # span starts 0,100,200,1000 ms (rdma) and 15,215 (notify); frame spans 0..1040 ms
    r = evaluate('{ name = "kv.rdma" } | count_over_time() by (span.kv.direction)', small, step_s=0.5)
    got = sorted(zip(r["span.kv.direction"], (r["time_s"] - T0 / 1e9).round(6), r["value"]))
    assert got == [("forward", 0.0, 3.0), ("reverse", 1.0, 1.0)]
    r = evaluate('{ name = "kv.rdma" } | rate()', small, step_s=0.5)
    assert r["value"].tolist() == [6.0, 2.0]  # 3 and 1 spans per 0.5 s bucket
    r = evaluate('{ name = "kv.rdma" } | sum_over_time(span.kv.bytes) by (span.kv.mode)', small)
    assert dict(zip(r["span.kv.mode"], r["value"])) == {"pull": 400.0, "push": 1000.0}
    for fn, pull in (("avg", 200.0), ("min", 100.0), ("max", 300.0)):
        r = evaluate(f'{{ name = "kv.rdma" }} | {fn}_over_time(span.kv.bytes) by (span.kv.mode)', small)
        assert dict(zip(r["span.kv.mode"], r["value"]))["pull"] == pull


def test_quantiles_skip_zero_duration_spans_as_tempo_does():
    """Tempo 2.10's quantile_over_time(duration) buckets by powers of two and skips spans under 2 ns
    (recorded from a real Tempo: kv.notify instants give no series while count_over_time does)."""
    spans_ = frame(
        rec(NOTIFY, 0, 0, **{sc.MODE: "pull"}),            # instant: skipped
        rec(NOTIFY, 10, 0.000001, **{sc.MODE: "pull"}),    # 1 ns: skipped too
        rec(NOTIFY, 20, 0, **{sc.MODE: "push"}),
        rec(NOTIFY, 30, 5, **{sc.MODE: "push"}),           # a real extent counts
        rec(RDMA, 0, 0, **{sc.MODE: "pull", sc.BYTES: 1}),   # bytes under 2: skipped as well
        rec(RDMA, 5, 0, **{sc.MODE: "pull", sc.BYTES: 4096}),
    )
    q = evaluate('{ name = "kv.notify" } | quantile_over_time(duration, .5) by (span.kv.mode)', spans_)
    assert q["span.kv.mode"].tolist() == ["push"] and q["value"].tolist() == pytest.approx([0.005])
    counts = evaluate('{ name = "kv.notify" } | count_over_time() by (span.kv.mode)', spans_)
    assert dict(zip(counts["span.kv.mode"], counts["value"])) == {"pull": 2.0, "push": 2.0}
    b = evaluate('{ name = "kv.rdma" } | quantile_over_time(span.kv.bytes, 1)', spans_)
    assert b["value"].tolist() == [4096.0]
    # other aggregates keep instants (Tempo's simple aggregators read zero as a value)
    mx = evaluate('{ name = "kv.notify" } | max_over_time(duration) by (span.kv.mode)', spans_)
    assert dict(zip(mx["span.kv.mode"], mx["value"])) == pytest.approx({"pull": 1e-9, "push": 0.005})


def test_missing_by_label_groups_under_nil(small):
    r = evaluate("{ } | count_over_time() by (span.kv.turn)", small)
    assert dict(zip(r["span.kv.turn"], r["value"])) == {"2": 1.0, "nil": 5.0}


def test_empty_result_keeps_columns(small):
    r = evaluate('{ name = "none" } | quantile_over_time(duration, .9) by (name)', small)
    assert r.empty and list(r.columns) == ["name", "p", "time_s", "value"]


def test_bad_inputs_raise_config_errors(small):
    with pytest.raises(ConfigError, match="missing columns"):
        evaluate("{ }", small.drop(columns=["attrs"]))
    with pytest.raises(ConfigError, match="step_s"):
        evaluate("{ } | rate()", small, step_s=0)
    with pytest.raises(ConfigError, match="regex"):
        evaluate('{ name =~ "(" }', small)
    with pytest.raises(ConfigError, match=r"\$nope"):
        evaluate('{ name = "$nope" }', small, variables={})


def test_interpolation_like_grafana():
    values = {"service": ["kvtune-prefill", "a.b"], "mode": ".*", "one": "x"}
    text = "${service:regex} ${mode:regex} $one ${one} ${service:pipe} ${service:queryparam} ${__all}"
    assert interpolate(text, values, all_values={"mode": ".*"}) == (
        r"(kvtune-prefill|a\.b) .* x x kvtune-prefill|a.b var-service=kvtune-prefill&var-service=a.b ${__all}")
    assert variable_names("${a} $b ${c:regex}") == ["a", "b", "c"]
    with pytest.raises(ConfigError, match="unknown format"):
        interpolate("${one:nope}", values)


def test_interpolated_regex_escapes_survive_traceql_raw_strings(small):
    q = interpolate(gen.transfer_rate_query(), {"service": ["kvtune-prefill"], "mode": ["pull", "push"]},
                    all_values=gen.ALL_VALUES)
    parse(q)
    r = evaluate(q, small)
    assert set(r["span.kv.mode"]) == {"pull", "push"}


# --- End to end: producers -> OTLP-JSON lines -> kvtune.traces.load -> dashboard queries --------


def _replay_through_sdk(df: pd.DataFrame, out_dir: Path) -> None:
    """Emit every row of a producer's spans frame as a real OTel span, one tracer provider per
    (service, host), exported by ``kvtune.telemetry`` to OTLP-JSON lines (the Collector's format)."""
    for (service, host), group in df.groupby(["service", "host"], sort=True):
        role = next((r for r in group[sc.ROLE].dropna()), sc.Role.SIM.value)
        tel = telemetry.setup(role, service_name=service, json_path=out_dir / f"{service}-{host}.jsonl",
                              resource={sc.HOST_NAME: host}, batch=False)
        try:
            for row in group.itertuples(index=False):
                parent = SpanContext(trace_id=int(row.trace_id, 16), span_id=int("1" * 16, 16),
                                     is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
                ctx = otel_trace.set_span_in_context(NonRecordingSpan(parent))
                span = tel.tracer.start_span(row.name, context=ctx, start_time=int(row.start_ns),
                                             attributes=dict(row.attrs))
                if row.status == "ERROR":
                    span.set_status(Status(StatusCode.ERROR, row.status_message or None))
                span.end(end_time=int(row.end_ns))
        finally:
            tel.provider.shutdown()


SIM_WORKLOAD = WorkloadSpec(qps=2.0, duration_s=4.0, turns=Dist.fixed(2), think_time_s=Dist.fixed(1.0))
"""A few two-turn conversations: enough for every span kind of every mode, fast to simulate."""


@pytest.fixture(scope="module")
def produced_dir(tmp_path_factory) -> Path:
    """OTLP-JSON lines from kvtune's producers: the simulator in push, pull and bidirectional mode
    (``SimResult.write_spans``), and a probe sweep (the synthetic one, replayed through the OTel SDK
    and ``kvtune.telemetry``, so this test needs no NIXL; the real probe runs in the nixl test)."""
    out = tmp_path_factory.mktemp("spans")
    count = 0
    for i, mode in enumerate((sc.Mode.PUSH, sc.Mode.PULL, sc.Mode.BIDIRECTIONAL)):
        config = public_h200_qwen3_32b(mode=mode.value).with_(seed=i + 1, workload=SIM_WORKLOAD)
        count += simulate(config).write_spans(out / f"sim-{mode.value}.jsonl")
    probe = synthetic.probe_spans(seed=3).head(60)
    _replay_through_sdk(probe, out)
    _count_file(out).write_text(str(count + len(probe)))
    return out


def _count_file(spans_dir: Path) -> Path:
    return spans_dir.parent / f"{spans_dir.name}.count"


@pytest.fixture(scope="module")
def produced(produced_dir) -> pd.DataFrame:
    # one simulated clock for every host: nothing to correct
    loaded = traces.load(str(produced_dir), correct_clocks=False)
    assert len(loaded) == int(_count_file(produced_dir).read_text())
    return loaded


def _dashboard() -> dict:
    return json.loads((ROOT / "dashboards" / "kv-transfer.json").read_text(encoding="utf-8"))


def _queries(d: dict):
    for p in d["panels"]:
        for t in p.get("targets", []):
            if p["type"] != "traces":
                yield p, t["query"]


def test_every_phase_panel_returns_rows_on_loaded_spans(produced):
    d = _dashboard()
    seen = set()
    for p, query in _queries(d):
        q = parse(interpolate(query, gen.DEFAULT_VARIABLE_VALUES, all_values=gen.ALL_VALUES))
        names = q.span_names()
        if not (q.metrics and q.metrics.function == "quantile_over_time" and len(names) == 1):
            continue
        r = evaluate(q, produced)
        assert len(r) > 0, f"panel {p['title']!r} is empty on produced spans"
        (phase,) = names
        assert set(r["name"]) == {phase}
        assert set(r["p"]) == {"0.5", "0.9", "0.99"} and (r["value"] > 0).all()
        seen.add(phase)
    assert seen == {ph.value for ph in gen.TIMED_PHASES}


EXAMPLE_SPANS = sorted((ROOT / "examples" / "stalls").glob("*-default/spans"))
"""Spans of real vLLM pairs (push, pull, bidirectional) on this machine, as the connectors wrote them:
their kv.notify spans are instants, unlike the simulator's."""


def test_every_panel_returns_rows_on_real_connector_spans():
    """The panels on what real connectors emit (zero-duration kv.notify), with Tempo's rule for
    zero durations: no panel may be empty (the old Notify latency panel was, on a real Tempo)."""
    assert len(EXAMPLE_SPANS) == 3
    real = traces.load([str(p) for p in EXAMPLE_SPANS], correct_clocks=False)
    notify = real[real["name"] == NOTIFY]
    assert len(notify) and (notify["end_ns"] == notify["start_ns"]).all()
    result = check_panels(real)
    assert result.empty_phases == ()
    assert {p.phase for p in result.panels if p.phase} == {ph.value for ph in sc.PHASES}
    assert all(p.rows > 0 for p in result.panels), result.table()
    old_notify = gen.phase_latency_query(sc.SpanName.NOTIFY)
    assert evaluate(old_notify, real, variables=gen.DEFAULT_VARIABLE_VALUES,
                    all_values=gen.ALL_VALUES).empty


def test_every_panel_returns_rows_on_loaded_spans(produced):
    d = _dashboard()
    for p, query in _queries(d):
        r = evaluate(query, produced, variables=gen.DEFAULT_VARIABLE_VALUES, all_values=gen.ALL_VALUES)
        assert len(r) > 0, f"panel {p['title']!r} is empty on produced spans"


def test_panels_show_what_the_producer_did(produced):
    vars_ = gen.DEFAULT_VARIABLE_VALUES
    reuse = evaluate(gen.reuse_decisions_query(), produced, variables=vars_, all_values=gen.ALL_VALUES)
    expected = produced[produced["name"] == sc.SpanName.REUSE_DECISION.value][sc.REUSE_OUTCOME].value_counts()
    assert dict(zip(reuse[f"span.{sc.REUSE_OUTCOME}"], reuse["value"])) == {k: float(v) for k, v in expected.items()}
    rate = evaluate(gen.transfer_rate_query(), produced, variables=vars_, all_values=gen.ALL_VALUES)
    modes = set(rate[f"span.{sc.MODE}"])
    assert {sc.Mode.PUSH.value, sc.Mode.PULL.value, sc.Mode.BIDIRECTIONAL.value, sc.Mode.PROBE.value} <= modes
    assert sc.Direction.REVERSE.value in set(rate[f"span.{sc.DIRECTION}"])
    only_push = evaluate(gen.phase_latency_query(sc.SpanName.RDMA), produced,
                         variables={**vars_, "mode": [sc.Mode.PUSH.value]}, all_values=gen.ALL_VALUES)
    assert set(only_push[f"span.{sc.MODE}"]) == {sc.Mode.PUSH.value}
    slow = evaluate(gen.slowest_transfers_query(), produced,
                    variables={**vars_, "min_duration": "5ms"}, all_values=gen.ALL_VALUES)
    assert len(slow) > 0 and (slow["duration_ms"] >= 5).all()
    rdma = produced[produced["name"] == sc.SpanName.RDMA.value]
    assert len(slow) == int((rdma["duration_ms"] >= 5).sum())
    assert np.isin(slow["trace_id"], produced["trace_id"]).all()
    # a click on a row sets traceID; the trace panel's query becomes that bare hex id, which Grafana's
    # Tempo datasource fetches as a trace (its isTraceIdQuery: only hex characters)
    picked = slow.sort_values("duration_ms", ascending=False)["trace_id"].iloc[0]
    trace_query = interpolate(gen.TRACE_QUERY, {**vars_, "traceID": picked})
    assert trace_query == picked and all(c in "0123456789abcdef" for c in trace_query)
    in_trace = set(produced.loc[produced["trace_id"] == picked, "name"])
    assert sc.SpanName.RDMA.value in in_trace and len(in_trace) > 1


def test_check_panels_reports_rows_per_panel(produced):
    result = check_panels(produced)
    assert result.span_count == len(produced) and result.empty_phases == ()
    phases = {p.phase for p in result.panels if p.phase}
    assert phases == {ph.value for ph in sc.PHASES}
    assert all(p.rows > 0 for p in result.panels)
    probe_only = check_panels(produced, variables={"mode": [sc.Mode.PROBE.value]})
    # the probe has no push rendezvous, registration or decode: those panels are empty
    assert set(probe_only.empty_phases) == {sc.SpanName.REGISTRATION.value, sc.SpanName.RENDEZVOUS.value,
                                            sc.SpanName.DECODE_START.value}
    assert "Transfer phases of conversation .*" in probe_only.table()


def test_check_cli(produced_dir, capsys):
    from kvtune.cli import main as kvtune_main
    files = [str(p) for p in sorted(produced_dir.glob("*.jsonl"))]
    assert kvtune_main(["dashboards", "check", *files, "--strict"]) == 0
    out = capsys.readouterr().out
    assert "RDMA (post → completion)" in out and "rows" in out
    assert kvtune_main(["dashboards", "check", str(produced_dir), "--mode", "probe"]) == 0
    assert kvtune_main(["dashboards", "check", str(produced_dir), "--mode", "probe", "--strict"]) == 1
    assert sc.SpanName.REGISTRATION.value in capsys.readouterr().err


# --- End to end with the real fabric probe (NIXL transfers on this host) -------------------------


@pytest.mark.nixl
def test_probe_phase_panels_return_rows(tmp_path):
    probe = pytest.importorskip("kvtune.probe.sweep")
    pytest.importorskip("nixl._api")
    config = probe.ProbeConfig(tokens=(16, 32), ops=("READ",), iters=2, warmup=1, spans_dir=tmp_path,
                               max_mem_mb=64, progress=False, n_boot=10)
    probe.run_and_write(config)
    loaded = traces.load(str(tmp_path))
    probe_phases = {sc.SpanName.DESCRIPTOR_SETUP.value, sc.SpanName.RDMA.value, sc.SpanName.NOTIFY.value}
    assert probe_phases <= set(loaded["name"])
    seen = set()
    for p, query in _queries(_dashboard()):
        q = parse(interpolate(query, gen.DEFAULT_VARIABLE_VALUES, all_values=gen.ALL_VALUES))
        instant = q.span_names() <= {ph.value for ph in gen.INSTANT_PHASES}
        if q.metrics and (q.metrics.function == "quantile_over_time"
                          or (instant and q.metrics.function == "count_over_time")) \
                and q.span_names() <= probe_phases and len(q.span_names()) == 1:
            r = evaluate(q, loaded)
            assert len(r) > 0 and set(r[f"span.{sc.MODE}"]) == {sc.Mode.PROBE.value}, p["title"]
            seen |= q.span_names()
    assert seen == probe_phases
    vars_ = {**gen.DEFAULT_VARIABLE_VALUES, "mode": [sc.Mode.PROBE.value]}
    slow = evaluate(gen.slowest_transfers_query(), loaded, variables=vars_, all_values=gen.ALL_VALUES)
    assert len(slow) == int((loaded["name"] == sc.SpanName.RDMA.value).sum()) > 0
    assert (slow[f"span.{sc.BYTES}"] > 0).all()
    moved = evaluate(gen.transfer_bytes_query(), loaded, variables=vars_, all_values=gen.ALL_VALUES)
    rdma = loaded[loaded["name"] == sc.SpanName.RDMA.value]
    assert moved["value"].sum() == float(rdma[sc.BYTES].sum())
