"""kvtune.traces.load on files: the column contract, the Collector's format, file kinds, errors."""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from kvtune import spans
from kvtune.errors import KvtuneError, TraceFormatError, TraceSourceError
from kvtune.traces import SPAN_COLUMNS, SPAN_DTYPES, all_columns, empty_frame, load

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
COLLECTOR = FIXTURES / "collector_file_exporter.jsonl"
TRACE = "5b8efff798038103d269b633813fc60c"


def _line(span_list: list[dict], service: str = "kvtune-prefill", host: str = "h1") -> str:
    return json.dumps({"resourceSpans": [{
        "resource": {"attributes": [{"key": spans.SERVICE_NAME, "value": {"stringValue": service}},
                                    {"key": spans.HOST_NAME, "value": {"stringValue": host}}]},
        "scopeSpans": [{"scope": {"name": "t"}, "spans": span_list}]}]})


def _span(span_id: str, name: str = spans.SpanName.RDMA.value, start: int = 1_000, end: int = 2_000,
          parent: str = "", attrs: list | None = None, trace: str = TRACE) -> dict:
    return {"traceId": trace, "spanId": span_id, "parentSpanId": parent, "name": name, "kind": 1,
            "startTimeUnixNano": str(start), "endTimeUnixNano": str(end),
            "attributes": attrs or [], "status": {}}


def test_span_columns_contract() -> None:
    assert SPAN_COLUMNS == (
        "trace_id", "span_id", "parent_span_id", "name", "service", "host", "start_ns", "end_ns",
        "duration_ms", "status", "status_message", "attrs", "resource")
    df = empty_frame()
    assert tuple(df.columns) == SPAN_COLUMNS + tuple(spans.ATTRIBUTE_TYPES)
    assert tuple(df.columns) == all_columns()
    for col, dtype in SPAN_DTYPES.items():
        assert str(df[col].dtype) == dtype, col
    expected = {int: "Int64", float: "Float64", str: "string", bool: "boolean"}
    for attr, typ in spans.ATTRIBUTE_TYPES.items():
        assert str(df[attr].dtype) == expected[typ], attr


def test_collector_file_exporter_format() -> None:
    df = load(COLLECTOR)
    assert tuple(df.columns) == all_columns()
    assert len(df) == 4
    by_name = df.set_index("name")
    root = by_name.loc[spans.SpanName.REQUEST.value]
    assert root["trace_id"] == TRACE and root["span_id"] == "eee19b7ec3c1b100"
    assert pd.isna(root["parent_span_id"])
    assert root["service"] == "kvtune-router" and root["host"] == "node-a"
    assert root["start_ns"] == 1_700_000_000_000_000_000 and root["end_ns"] == 1_700_000_000_900_000_000
    assert root["duration_ms"] == 900.0
    assert root["status"] == "OK"
    assert root[spans.PROMPT_TOKENS] == 4096 and root[spans.TTFT_MS] == 120.5
    assert bool(root[spans.STREAM]) is True and root[spans.HTTP_STATUS] == 200

    rdma = by_name.loc[spans.SpanName.RDMA.value]
    assert rdma["parent_span_id"] == "eee19b7ec3c1b100"
    assert rdma["status"] == "ERROR" and rdma["status_message"] == "NIXL_ERR_REMOTE_DISCONNECT"
    assert rdma[spans.BYTES] == 671_088_640 and rdma[spans.DESCRIPTORS] == 8192
    assert rdma[spans.NIXL_OP] == spans.NixlOp.WRITE.value and rdma[spans.NIXL_POST_US] == 41.5
    assert bool(rdma[spans.PROBE_WARMUP]) is False
    assert rdma["attrs"]["custom.list"] == [1, "two"]
    assert rdma["attrs"]["custom.map"] == {"k": 0.5}
    assert rdma["attrs"]["custom.bytes"] == "AAEC"
    assert rdma["resource"][spans.TP_SIZE] == 2
    assert pd.isna(rdma[spans.TURN])

    notify = by_name.loc[spans.SpanName.NOTIFY.value]
    assert notify["service"] == "kvtune-decode" and notify["status"] == "UNSET"
    assert notify[spans.NOTIFY_SENT_NS] == 1_700_000_000_103_600_000 and notify[spans.TURN] == 3
    assert df.attrs["sources"] == [str(COLLECTOR)]
    assert df.attrs["skipped"] == []
    assert df.attrs["clock_offsets_ns"] == {"node-a": 0}


def test_gzip_glob_directory_and_lists(tmp_path: Path) -> None:
    nested = tmp_path / "run" / "deep"
    nested.mkdir(parents=True)
    with gzip.open(nested / "a.jsonl.gz", "wt") as f:
        f.write(_line([_span("00000000000000a1")]) + "\n")
    (tmp_path / "run" / "b.jsonl").write_text(_line([_span("00000000000000b1")]) + "\n\n")
    (tmp_path / "run" / "ignored.txt").write_text("not spans")
    df = load(tmp_path / "run")
    assert sorted(df["span_id"]) == ["00000000000000a1", "00000000000000b1"]
    assert len(df.attrs["sources"]) == 2
    assert sorted(load(str(tmp_path / "run" / "**" / "*.jsonl*"))["span_id"]) == [
        "00000000000000a1", "00000000000000b1"]
    both = load([nested / "a.jsonl.gz", tmp_path / "run" / "b.jsonl"])
    assert list(both["span_id"]) == ["00000000000000a1", "00000000000000b1"]


def test_pretty_printed_json_document(tmp_path: Path) -> None:
    doc = json.loads(_line([_span("00000000000000c1"), _span("00000000000000c2")]))
    path = tmp_path / "one.json"
    path.write_text(json.dumps(doc, indent=2))
    assert list(load(path)["span_id"]) == ["00000000000000c1", "00000000000000c2"]
    lines = tmp_path / "lines.json"  # JSON lines under a .json name
    lines.write_text(_line([_span("00000000000000d1")]) + "\n" + _line([_span("00000000000000d2")]))
    assert list(load(lines)["span_id"]) == ["00000000000000d1", "00000000000000d2"]


def test_base64_ids_are_converted_to_hex(tmp_path: Path) -> None:
    path = tmp_path / "b64.jsonl"
    span = _span("t61rcWkgMzE=", trace="CvdlGRbNQ92ESOshHIAxnA==", parent="APBnqgupArc=")
    path.write_text(_line([span]) + "\n")
    row = load(path).iloc[0]
    assert row["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert row["span_id"] == "b7ad6b7169203331"
    assert row["parent_span_id"] == "00f067aa0ba902b7"


def _bad_file(tmp_path: Path, bad_line: str) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text(_line([_span("00000000000000e1")]) + "\n" + bad_line + "\n"
                    + _line([_span("00000000000000e3")]) + "\n")
    return path


@pytest.mark.parametrize(("bad_line", "field"), [
    ('{"resourceSpans": [', "(json)"),
    (_line([{**_span("00000000000000e2"), "startTimeUnixNano": "soon"}]),
     "$.resourceSpans[0].scopeSpans[0].spans[0].startTimeUnixNano"),
    (_line([{k: v for k, v in _span("00000000000000e2").items() if k != "traceId"}]),
     "$.resourceSpans[0].scopeSpans[0].spans[0].traceId"),
    (_line([_span("xyz")]), "spanId"),
    (_line([_span("00000000000000e2", attrs=[{"key": spans.BYTES, "value": {"stringValue": "lots"}}])]),
     f"attributes[{spans.BYTES}]"),
    ('{"resourceMetrics": []}', "resourceSpans"),
])
def test_malformed_records_name_file_line_and_field(tmp_path: Path, bad_line: str, field: str) -> None:
    path = _bad_file(tmp_path, bad_line)
    with pytest.raises(TraceFormatError) as info:
        load(path)
    err = info.value
    assert isinstance(err, KvtuneError)
    assert err.source == str(path) and err.line == 2 and err.field == field
    assert f"{path}:2" in str(err)


@pytest.mark.parametrize("bad_line", [
    '{"resourceSpans": [',
    _line([{**_span("00000000000000e2"), "startTimeUnixNano": "soon"}]),
    _line([_span("00000000000000e2", attrs=[{"key": spans.TURN, "value": {"doubleValue": 1.5}}])]),
])
def test_skip_bad_reports_and_keeps_good_records(tmp_path: Path, bad_line: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    path = _bad_file(tmp_path, bad_line)
    with caplog.at_level("WARNING"):
        df = load(path, skip_bad=True)
    assert list(df["span_id"]) == ["00000000000000e1", "00000000000000e3"]
    skipped = df.attrs["skipped"]
    assert len(skipped) == 1
    assert skipped[0][0] == str(path) and skipped[0][1] == 2 and skipped[0][2]
    assert any("skipped 1 bad record" in r.getMessage() for r in caplog.records)


def test_skip_bad_keeps_good_spans_of_a_partly_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_text(_line([_span("00000000000000f1"), {**_span("00000000000000f2"), "name": 7},
                           _span("00000000000000f3")]) + "\n")
    df = load(path, skip_bad=True)
    assert list(df["span_id"]) == ["00000000000000f1", "00000000000000f3"]
    (source, line, reason), = df.attrs["skipped"]
    assert line == 1 and "1 span(s) dropped" in reason and "name" in reason


def test_integral_double_accepted_for_int_attribute(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(_line([_span("0000000000000001",
                                 attrs=[{"key": spans.TOKENS, "value": {"doubleValue": 128.0}}])]) + "\n")
    df = load(path)
    assert df[spans.TOKENS].iloc[0] == 128 and str(df[spans.TOKENS].dtype) == "Int64"


def test_source_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceSourceError, match="no such file"):
        load(tmp_path / "missing.jsonl")
    with pytest.raises(TraceSourceError, match="glob matches no files"):
        load(str(tmp_path / "*.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceSourceError, match="holds no"):
        load(tmp_path / "empty")
    with pytest.raises(TraceSourceError, match="unknown source scheme"):
        load("s3://bucket/spans.jsonl")


def test_empty_file_gives_empty_frame(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    df = load(path)
    assert df.empty and tuple(df.columns) == all_columns()
    assert df.attrs["sources"] == [str(path)]


def test_fixture_copy_under_any_name_loads_the_same(tmp_path: Path) -> None:
    shutil.copy(COLLECTOR, tmp_path / "collector.json")  # Collector files are often named .json
    a, b = load(COLLECTOR), load(tmp_path / "collector.json")
    pd.testing.assert_frame_equal(a.drop(columns=["attrs", "resource"]),
                                  b.drop(columns=["attrs", "resource"]))


def test_saved_tempo_bodies_load_as_files() -> None:
    v1 = load(FIXTURES / "tempo_v1_trace.json")
    assert sorted(v1["name"]) == [spans.SpanName.RDMA.value, spans.SpanName.REQUEST.value]
    assert set(v1["trace_id"]) == {"0af7651916cd43dd8448eb211c80319c"}
    v2 = load(FIXTURES / "tempo_v2_trace.json")
    assert list(v2["name"]) == [spans.SpanName.NOTIFY.value] and v2[spans.TURN].iloc[0] == 2


def test_load_restores_garbage_collection(tmp_path: Path) -> None:
    import gc
    assert gc.isenabled()
    load(COLLECTOR)
    assert gc.isenabled()
    with pytest.raises(TraceFormatError):
        load(_bad_file(tmp_path, '{"resourceSpans": ['))
    assert gc.isenabled()
