"""The Tempo source against answers recorded from a real Tempo (``tests/tempo_standin.py``): every
trace without a range, splitting at the limit, the cut-short warning, Tempo's caps, bodies cut off
mid-transfer or nested too deeply; and kvtune's query evaluator against Tempo's metrics answers."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from tempo_standin import RECORDED, Recording, serve

from kvtune import spans as sc
from kvtune import traces
from kvtune.dashboards import generator as gen
from kvtune.dashboards.evaluate import evaluate
from kvtune.dashboards.templating import interpolate
from kvtune.dashboards.traceql import parse
from kvtune.errors import TraceSourceError
from kvtune.traces.tempo import TempoRead, TempoSource

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rec() -> Recording:
    return Recording.load()


def _ids(rec: Recording) -> set[str]:
    return {t.rjust(32, "0") for t in rec.trace_ids()}


def test_the_recording_shows_tempos_no_range_search_misses_traces(rec):
    """What the real server did: without start/end it answered from its ingesters only."""
    norange = {t["traceID"] for t in rec.search_norange.get("traces", [])}
    assert rec.meta["tempo_version"].lstrip("v").startswith("2.10")
    assert len(rec.trace_ids()) == rec.meta["traces"]
    assert len(norange) < len(rec.trace_ids())  # recorded: none of the 94


def test_search_without_a_range_yields_every_trace(rec):
    with serve(rec) as (host, state):
        df = traces.load(f"tempo+http://{host}?q=%7B%7D", correct_clocks=False)
    (read,) = df.attrs["tempo_reads"]
    assert isinstance(read, TempoRead) and read.search.complete and not read.partial
    assert set(df["trace_id"]) == _ids(rec)
    assert len(df) == rec.meta["spans"] == read.spans_read
    assert read.traces_fetched == len(rec.trace_ids())
    search = [q for p, q in state.requests if p == "/api/search"]
    # the range only: its lookahead (traces that start in the range and reached Tempo later;
    # kvtune.traces.tempo) would start past now, where nothing has arrived yet
    assert [int(q["end"][0]) - int(q["start"][0]) for q in search] == [3600]
    assert read.search.end_s - read.search.start_s == 3600
    finding = read.findings()
    assert [f["code"] for f in finding] == ["tempo_read"]
    assert f"{len(rec.trace_ids())} trace(s) found" in finding[0]["message"]
    assert f"{rec.meta['spans']} span(s) read" in finding[0]["message"]


def _densest_second(rec: Recording, shift_ns: int) -> int:
    starts = Counter((int(t["startTimeUnixNano"]) + shift_ns) // 10**9
                     for t in rec.search_range["traces"])
    return max(starts.values())


def test_a_window_at_the_limit_is_split_until_every_trace_is_found(rec):
    with serve(rec) as (host, state):
        limit = _densest_second(rec, state.shift_ns) + 1
        df = traces.load(f"tempo+http://{host}?q=%7B%7D&limit={limit}&since=2h",
                         correct_clocks=False)
    (read,) = df.attrs["tempo_reads"]
    assert read.search.complete and read.search.requests > 3
    assert set(df["trace_id"]) == _ids(rec)


def test_a_cut_short_search_warns(rec, caplog):
    with serve(rec) as (host, state):
        limit = _densest_second(rec, state.shift_ns)
        df = traces.load(f"tempo+http://{host}?q=%7B%7D&limit={limit}", correct_clocks=False)
    (read,) = df.attrs["tempo_reads"]
    assert not read.search.complete and read.partial
    assert "one-second window" in read.search.cut_short[0]
    codes = {f["code"]: f for f in read.findings()}
    assert codes["tempo_search_cut_short"]["severity"] == "warning"
    assert "raise limit=" in codes["tempo_search_cut_short"]["message"]
    assert any("cut short" in r.getMessage() for r in caplog.records)


def test_the_warning_reaches_the_recommendation(rec):
    from kvtune.recommend.tuning import recommend
    with serve(rec) as (host, state):
        limit = _densest_second(rec, state.shift_ns)
        df = traces.load(f"tempo+http://{host}?q=%7B%7D&limit={limit}", correct_clocks=False)
    tuning = recommend(df, n_boot=20, use_simulator=False)
    codes = {f.code: f.severity for f in tuning.findings}
    assert codes["tempo_search_cut_short"] == "warning" and codes["tempo_read"] == "info"


def test_tempos_caps_range_length_and_limit(rec):
    """Tempo answers 400 to a range over its max_duration and a limit over max_result_limit
    (bodies recorded from the real server): the source splits the range and lowers the limit."""
    with serve(rec, max_duration_s=1800, max_limit=50) as (host, state):
        df = traces.load(f"tempo+http://{host}?q=%7B%7D&since=3h&limit=5000", correct_clocks=False)
    (read,) = df.attrs["tempo_reads"]
    assert set(df["trace_id"]) == _ids(rec) and read.search.complete
    assert read.search.limit == 50
    sent = [q for p, q in state.requests if p == "/api/search"]
    ok = [q for q in sent if int(q["end"][0]) - int(q["start"][0]) <= 1800
          and int(q["limit"][0]) <= 50]
    assert len(ok) < len(sent)  # it did hit both caps, then kept within them
    assert int(sent[-1]["limit"][0]) == 50


def test_a_body_cut_off_mid_transfer_names_the_url(rec):
    with serve(rec, cut_body_at=100) as (host, _):
        with pytest.raises(TraceSourceError, match=r"/api/v2/traces/[0-9a-f]+: .*cut off"):
            traces.load(f"tempo+http://{host}?q=%7B%7D")


def test_deeply_nested_answers_name_the_url(rec):
    nested = b'{"traces": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with serve(rec, search_override=nested) as (host, _):
        with pytest.raises(TraceSourceError, match=r"/api/search\?.*nested too deeply"):
            traces.load(f"tempo+http://{host}?q=%7B%7D")
    tid = "ab" * 16
    value = '{"intValue": "1"}'
    for _ in range(5000):
        value = '{"arrayValue": {"values": [' + value + "]}}"
    body = ('{"trace": {"resourceSpans": [{"resource": {"attributes": [{"key": "a", "value": '
            + value + '}]}, "scopeSpans": []}]}}').encode()
    deep = Recording(meta={}, search_range={"traces": [{"traceID": tid,
                                                        "startTimeUnixNano": "1"}]},
                     search_norange={}, traces={tid: body}, metrics={}, errors={})
    with serve(deep) as (host, _):
        with pytest.raises(TraceSourceError, match=rf"/api/v2/traces/{tid}: .*nested too deeply"):
            traces.load(f"tempo+http://{host}?q=%7B%7D")
        skipped = traces.load(f"tempo+http://{host}?q=%7B%7D", skip_bad=True)
    assert len(skipped) == 0 and "nested" in skipped.attrs["skipped"][0][2]


def test_non_finite_parameters_never_reach_the_server(rec):
    with serve(rec) as (host, state):
        for q in ("limit=inf", "limit=nan", "start=-inf", "since=inf"):
            with pytest.raises(TraceSourceError, match=q.split("=")[0]):
                traces.load(f"tempo+http://{host}?q=%7B%7D&{q}")
    assert state.requests == []


def _series(answer: dict) -> set[tuple[tuple[str, str], ...]]:
    out = set()
    for s in answer.get("series", []):
        if not any(float(x.get("value", 0)) for x in s.get("samples", [])):
            continue  # a series without samples shows nothing
        labels = []
        for kv in s.get("labels", []):
            val = next(iter(kv["value"].values())) if kv["value"] else "nil"
            labels.append((kv["key"], f"{float(val):g}" if kv["key"] == "p" else str(val)))
        out.add(tuple(sorted(labels)))
    return out


def test_the_evaluator_gives_the_series_tempo_gave(rec):
    """Every panel's metrics query on the recorded spans: kvtune's evaluator returns the label sets
    the real Tempo returned, including none for quantiles of instants (kv.notify)."""
    spans_df = traces.load([str(ROOT / p) for p in rec.meta["sources"]], correct_clocks=False)
    assert len(spans_df) == rec.meta["spans"]
    old_notify = parse(interpolate(gen.phase_latency_query(sc.SpanName.NOTIFY),
                                   gen.DEFAULT_VARIABLE_VALUES, all_values=gen.ALL_VALUES)).text
    assert rec.metrics[old_notify].get("series", []) == []  # what the real Tempo answered
    panel_count = 0
    for query, answer in rec.metrics.items():
        q = parse(query)
        result = evaluate(q, spans_df)
        label_cols = [c for c in result.columns if c not in ("time_s", "value")]
        ours = {tuple(sorted((c, str(r[c])) for c in label_cols)) for _, r in result.iterrows()}
        assert _series(answer) == ours, query
        panel_count += query != old_notify
    dashboard = json.loads((ROOT / "dashboards" / "kv-transfer.json").read_text())
    # panels that came after the recording: the per-phase shares, and the retention panels
    # (checked against a real Tempo by tests/test_dashboards_retention.py)
    not_recorded = {parse(interpolate(q(), gen.DEFAULT_VARIABLE_VALUES,
                                      all_values=gen.ALL_VALUES)).text
                    for q in (gen.phase_shares_query, gen.retention_held_query,
                              gen.retention_tokens_query, gen.retention_renewals_query)}
    assert not not_recorded & set(rec.metrics)
    metrics_panels = [t for p in dashboard["panels"] for t in p.get("targets", [])
                      if t.get("metricsQueryType")
                      and parse(interpolate(t["query"], gen.DEFAULT_VARIABLE_VALUES,
                                            all_values=gen.ALL_VALUES)).text not in not_recorded]
    assert panel_count == len(metrics_panels)


def test_recorded_fixture_files_are_what_the_stand_in_serves():
    assert {p.name for p in RECORDED.iterdir()} >= {
        "recording.json", "search_range.json", "search_norange.json", "traces.json.gz",
        "metrics.json", "errors.json"}


def test_source_object_search_and_documents(rec):
    with serve(rec) as (host, _):
        src = TempoSource(f"http://{host}", limit=1000)
        found = src.search()
        docs = list(src.documents(found))
    assert len(docs) == len(found.trace_ids) == len(rec.trace_ids())
    assert all(url.startswith(f"http://{host}/api/v2/traces/") for url, _ in docs)
