"""The streamed reduction (``kvtune.traces.reduce``): spans through DuckDB on disk, a uniform sample
of whole conversations back in the loader's shape, and the workload scaled by the share."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvtune import spans as sc
from kvtune.analysis import workload
from kvtune.errors import TraceSourceError
from kvtune.traces import load
from kvtune.traces.reduce import SpanStore, load_sample, share_cut
from kvtune.traces.columns import all_columns

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "stalls" / "pull-default" / "spans"
KEY = ["trace_id", "span_id", "name", "start_ns", "end_ns"]


def _kv(key, value):
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    return {"key": key, "value": {"stringValue": str(value)}}


def write_conversations(path: Path, n_conv: int, seed: int = 0) -> Path:
    """``n_conv`` conversations of 1-4 turns: a router ``kv.request`` and a prefill ``kv.prefill``
    per turn (the prefill span names no conversation: it is sampled with its trace's)."""
    rng = np.random.default_rng(seed)
    router, prefill = [], []
    t = 1_700_000_000 * 10**9
    for c in range(n_conv):
        t += int(rng.exponential(2e9))
        at = t
        for turn in range(1, int(rng.integers(1, 5)) + 1):
            tid = f"{c:016x}{turn:016x}"
            root = f"{c * 8 + turn:016x}"
            prompt = 100 * turn + int(rng.integers(0, 50))
            router.append({"traceId": tid, "spanId": root, "name": sc.SpanName.REQUEST.value,
                           "startTimeUnixNano": str(at), "endTimeUnixNano": str(at + 10**8),
                           "attributes": [_kv(sc.CONVERSATION_ID, f"c{c}"), _kv(sc.TURN, turn),
                                          _kv(sc.PROMPT_TOKENS, prompt),
                                          _kv(sc.OUTPUT_TOKENS, 16), _kv("x.extra", "kept")]})
            prefill.append({"traceId": tid, "spanId": f"{c * 8 + turn:08x}{1:08x}",
                            "parentSpanId": root, "name": sc.SpanName.PREFILL.value,
                            "startTimeUnixNano": str(at + 10**6),
                            "endTimeUnixNano": str(at + 5 * 10**7),
                            "attributes": [_kv(sc.PROMPT_TOKENS, prompt),
                                           _kv(sc.COMPUTED_TOKENS, prompt)]})
            at += 10**8 + int(rng.uniform(1, 5) * 1e9)
    lines = []
    for service, spans in (("kvtune-router", router), ("kvtune-prefill", prefill)):
        for i in range(0, len(spans), 50):
            lines.append(json.dumps({"resourceSpans": [{
                "resource": {"attributes": [_kv(sc.SERVICE_NAME, service),
                                            _kv(sc.HOST_NAME, "h")]},
                "scopeSpans": [{"spans": spans[i:i + 50]}]}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_under_the_cap_the_reduced_frame_holds_every_span_as_load_does():
    full = load(str(EXAMPLE), correct_clocks=False)
    red = load_sample(str(EXAMPLE), max_spans=10**6, correct_clocks=False)
    assert list(red.columns) == list(all_columns())
    assert red.attrs["sample"].complete and red.attrs["sample"].share == 1.0
    a = full[KEY].astype(str).sort_values(KEY).reset_index(drop=True)
    b = red[KEY].astype(str).sort_values(KEY).reset_index(drop=True)
    assert a.equals(b)
    # typed columns come back with the loader's dtypes and values
    for col in (sc.TRANSFER_ID, sc.BYTES, sc.MODE, "duration_ms", "status", "parent_span_id"):
        assert red[col].dtype == full[col].dtype, col
        x = full.sort_values(KEY)[col].reset_index(drop=True)
        y = red.sort_values(KEY)[col].reset_index(drop=True)
        assert x.astype(str).equals(y.astype(str)), col


def test_the_sample_keeps_whole_conversations_and_scales_the_workload(tmp_path):
    f = write_conversations(tmp_path / "spans.jsonl", 600)
    full = load(str(f), correct_clocks=False)
    red = load_sample(str(f), max_spans=len(full) // 4, correct_clocks=False)
    rep = red.attrs["sample"]
    assert not rep.complete and rep.source_spans == len(full)
    assert 0.15 < rep.share < 0.35 and rep.sampled_spans == len(red)
    assert rep.interval_widening == pytest.approx(1 / np.sqrt(rep.share))
    conv = full[sc.CONVERSATION_ID].astype(object)
    kept = set(red[sc.CONVERSATION_ID].dropna().astype(str))
    # every trace of a kept conversation is there, prefill spans included; no other trace is
    want = set(full.loc[conv.isin(kept).to_numpy(dtype=bool), "trace_id"])
    assert set(red["trace_id"]) == want
    assert len(red) == int(full["trace_id"].isin(want).sum())
    # attributes outside the convention are kept in attrs
    req = red[red["name"] == sc.SpanName.REQUEST.value]
    assert {a.get("x.extra") for a in req["attrs"]} == {"kept"}
    # the same sample every time (md5 of the conversation id)
    again = load_sample(str(f), max_spans=len(full) // 4, correct_clocks=False)
    assert set(again["trace_id"]) == set(red["trace_id"])
    # the workload of the sample runs at the source's rate
    w_full, w_red = workload(full), workload(red)
    assert w_red.sampled_share == rep.share and w_full.sampled_share == 1.0
    assert w_red.qps == pytest.approx(w_full.qps, rel=0.25)
    assert w_red.duration_s == pytest.approx(w_full.duration_s * rep.share, rel=0.1)


def test_parquet_sources_reduce_as_the_json_lines_they_came_from(tmp_path):
    f = write_conversations(tmp_path / "spans.jsonl", 200)
    from kvtune.traces.loader import read_spans
    store = SpanStore(tmp_path)
    store.append(read_spans(str(f)), skip_bad=False)
    pq = store.export_parquet(tmp_path / "spans.parquet")
    store.close()
    a = load_sample(str(f), max_spans=500, correct_clocks=False)
    b = load_sample(str(pq), max_spans=500, correct_clocks=False)
    assert a[KEY].astype(str).sort_values(KEY).reset_index(drop=True).equals(
        b[KEY].astype(str).sort_values(KEY).reset_index(drop=True))
    with pytest.raises(TraceSourceError, match="Parquet"):
        bad = tmp_path / "bad.parquet"
        bad.write_bytes(b"not parquet")
        load_sample(str(bad))


def test_share_cut_orders_like_md5_prefixes():
    assert share_cut(1.0) > "ffffffff" and share_cut(0.5) == "80000000"
    assert share_cut(1e-12) == "00000001"


def test_the_fits_read_a_larger_sample_and_the_recommendation_says_so():
    from kvtune.analysis import transfers
    from kvtune.analysis.reduced import reduce_source
    from kvtune.recommend import recommend

    spans_dir = ROOT / "examples" / "verify-shaped" / "tune" / "spans"
    full = load(str(spans_dir))
    red = reduce_source(str(spans_dir), max_spans=len(full) // 3, max_transfers=10**6)
    rep, fits = red.attrs["sample"], red.attrs["fit_inputs"]
    assert rep.share < 1 and fits.share == 1.0 and rep.fit_units == rep.source_units
    # every transfer of the source, computed chunk by chunk, equals the table of the whole frame
    whole = transfers(full)
    assert len(fits.transfers) == len(whole) > len(transfers(red))
    key = ["transfer_id", "trace_id"]
    a = fits.transfers.sort_values(key).reset_index(drop=True)
    b = whole.sort_values(key).reset_index(drop=True)
    assert a[["transfer_id", "bytes", "critical_ms", "rdma_ms"]].astype(str).equals(
        b[["transfer_id", "bytes", "critical_ms", "rdma_ms"]].astype(str))
    assert (fits.prefill_spans["name"] == sc.SpanName.PREFILL.value).sum() == (
        full["name"] == sc.SpanName.PREFILL.value).sum()
    tuning = recommend(red, n_boot=20)
    assert tuning.fit.n_transfers == recommend(full, n_boot=20).fit.n_transfers
    (f,) = [f for f in tuning.findings if f.code == "spans_sampled"]
    assert "fits read" in f.message and tuning.extra["sample"]["share"] < 1


def test_read_loads_small_sources_whole_and_reduces_under_a_cap(monkeypatch):
    from kvtune.analysis.reduced import MAX_SPANS_ENV, read
    from kvtune.nb import load_spans

    monkeypatch.delenv(MAX_SPANS_ENV, raising=False)
    assert "sample" not in read(str(EXAMPLE)).attrs
    monkeypatch.setenv(MAX_SPANS_ENV, "60")
    df = load_spans(str(EXAMPLE))  # what every notebook calls
    assert df.attrs["sample"].max_spans == 60 and not df.attrs["sample"].complete
    monkeypatch.setenv(MAX_SPANS_ENV, "lots")
    with pytest.raises(TraceSourceError, match=MAX_SPANS_ENV):
        read(str(EXAMPLE))


def test_tune_max_spans_needs_traces_and_a_positive_count(capsys):
    from kvtune.cli import main

    assert main(["tune", "--max-spans", "1000"]) == 2
    assert main(["tune", "--traces", str(EXAMPLE), "--max-spans", "0"]) == 2
    assert capsys.readouterr().err.count("--max-spans") == 2
