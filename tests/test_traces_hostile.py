"""kvtune.traces.load on hostile or unlucky files: regression tests for the issue's examples and
hypothesis properties over random OTLP-JSON documents, valid and corrupted (500 examples each)."""
from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path

import pytest
from fuzz_settings import PROPERTY
from hypothesis import given
from hypothesis import strategies as st

from kvtune import spans
from kvtune.cli import main
from kvtune.errors import KvtuneError, TraceFormatError
from kvtune.traces import load
from kvtune.traces.otlp_json import MAX_VALUE_DEPTH

TRACE = "5b8efff798038103d269b633813fc60c"
SPAN_PATH = "$.resourceSpans[0].scopeSpans[0].spans[0]"
CLI = (("traces", "kvtune.traces.cli"),)


def _doc(span_list: list, resource_attrs: list | None = None) -> dict:
    return {"resourceSpans": [{"resource": {"attributes": resource_attrs or []},
                               "scopeSpans": [{"spans": span_list}]}]}


def _span(span_id: str, start: object = 1_000, end: object = 2_000, attrs: list | None = None) -> dict:
    return {"traceId": TRACE, "spanId": span_id, "name": spans.SpanName.RDMA.value,
            "startTimeUnixNano": start, "endTimeUnixNano": end, "attributes": attrs or []}


def _nested(levels: int, kind: str) -> str:
    """An AnyValue nested ``levels`` deep, as JSON text (json.dumps itself recurses)."""
    if kind == "kvlist":
        return ('{"kvlistValue":{"values":[{"key":"k","value":' * levels + '{"stringValue":"x"}'
                + "}]}}" * levels)
    return '{"arrayValue":{"values":[' * levels + '{"stringValue":"x"}' + "]}}" * levels


def _with_attr(span_id: str, value_json: str) -> str:
    doc = json.dumps(_doc([_span(span_id, attrs=[{"key": "deep", "value": None}])]))
    return doc.replace('"value": null', f'"value": {value_json}')


def _three_lines(tmp_path: Path, bad: str, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(_doc([_span("00000000000000e1")])) + "\n" + bad + "\n"
                    + json.dumps(_doc([_span("00000000000000e3")])) + "\n")
    return path


def _no_traceback_from_cli(path: Path, capsys) -> str:
    code = main(["traces", "summary", str(path)], CLI)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and f"{path}:2" in err
    return err


# --- regressions ----------------------------------------------------------------------------------
@pytest.mark.parametrize("start", [2**63, str(2**63), 2**64 - 1, str(2**64 + 5), -1])
def test_timestamps_outside_int64_are_bad_records_not_overflow(tmp_path, start, capsys):
    path = _three_lines(tmp_path, json.dumps(_doc([_span("00000000000000e2", start=start)])))
    with pytest.raises(TraceFormatError) as info:
        load(path)
    assert info.value.line == 2 and info.value.field == f"{SPAN_PATH}.startTimeUnixNano"
    df = load(path, skip_bad=True)
    assert list(df["span_id"]) == ["00000000000000e1", "00000000000000e3"]
    (source, line, reason), = df.attrs["skipped"]
    assert (source, line) == (str(path), 2) and "startTimeUnixNano" in reason
    _no_traceback_from_cli(path, capsys)


def test_a_huge_timestamp_drops_only_its_span(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_doc([_span("00000000000000f1"), _span("00000000000000f2", end=2**63),
                                     _span("00000000000000f3")])) + "\n")
    df = load(path, skip_bad=True)
    assert list(df["span_id"]) == ["00000000000000f1", "00000000000000f3"]
    assert "1 span(s) dropped" in df.attrs["skipped"][0][2]


@pytest.mark.parametrize(("levels", "kind", "field"), [
    (MAX_VALUE_DEPTH + 1, "array", "attributes[deep]"),
    (MAX_VALUE_DEPTH + 1, "kvlist", "attributes[deep]"),
    (300, "kvlist", "(json)"),  # the example: a few hundred levels
    (100_000, "array", "(json)"),
])
def test_deeply_nested_attributes_are_bad_records_not_recursion_errors(tmp_path, levels, kind,
                                                                       field, capsys):
    path = _three_lines(tmp_path, _with_attr("00000000000000e2", _nested(levels, kind)))
    with pytest.raises(TraceFormatError) as info:
        load(path)
    assert (info.value.source, info.value.line, info.value.field) == (str(path), 2, field)
    df = load(path, skip_bad=True)
    assert list(df["span_id"]) == ["00000000000000e1", "00000000000000e3"]
    assert [s[:2] for s in df.attrs["skipped"]] == [(str(path), 2)]
    _no_traceback_from_cli(path, capsys)


def test_nesting_within_the_limit_loads(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(_with_attr("00000000000000e1", _nested(MAX_VALUE_DEPTH, "kvlist")) + "\n")
    value = load(path)["attrs"].iloc[0]["deep"]
    for _ in range(MAX_VALUE_DEPTH):
        value = value["k"]
    assert value == "x"


def test_deeply_nested_resource_attribute_names_the_resource(tmp_path):
    deep = json.dumps(_doc([_span("00000000000000e1")], [{"key": "r", "value": None}]))
    path = tmp_path / "t.jsonl"
    path.write_text(deep.replace('"value": null', f'"value": {_nested(40, "array")}') + "\n")
    with pytest.raises(TraceFormatError, match=r"resource\.attributes\[r\]"):
        load(path)
    assert load(path, skip_bad=True).empty


def test_a_truncated_gzip_keeps_its_lines_before_the_cut(tmp_path, caplog):
    lines = [json.dumps(_doc([_span(f"{i:016x}")])) + "\n" for i in range(1, 3001)]
    data = gzip.compress("".join(lines).encode())
    d = tmp_path / "spans"
    d.mkdir()
    (d / "a.jsonl.gz").write_bytes(data[:len(data) // 2])  # a rotation cut short
    (d / "b.jsonl").write_text(json.dumps(_doc([_span("ffffffffffffff01")])) + "\n")
    with caplog.at_level("WARNING"):
        df = load(d)  # no skip_bad needed: the good lines are kept, the cut is reported
    kept = [s for s in df["span_id"] if s != "ffffffffffffff01"]
    assert "ffffffffffffff01" in set(df["span_id"]) and 0 < len(kept) < 3000
    assert kept == [f"{i:016x}" for i in range(1, len(kept) + 1)]  # every line before the cut
    (source, line, reason), = df.attrs["skipped"]
    assert source == str(d / "a.jsonl.gz") and line > len(kept) and "gzip" in reason
    assert any("gzip stream ends early" in r.getMessage() for r in caplog.records)


def test_a_truncated_json_gz_keeps_its_whole_lines(tmp_path):
    lines = [json.dumps(_doc([_span(f"{i:016x}")])) + "\n" for i in range(1, 3001)]
    data = gzip.compress("".join(lines).encode())
    path = tmp_path / "collector.json.gz"
    path.write_bytes(data[:len(data) // 2])
    df = load(path)
    assert 0 < len(df) < 3000 and len(df.attrs["skipped"]) == 1
    pretty = json.dumps(_doc([_span(f"{i:016x}") for i in range(1, 3001)]), indent=2).encode()
    data = gzip.compress(pretty)
    path.write_bytes(data[:len(data) // 2])  # one pretty-printed document, cut: nothing to keep
    df = load(path)
    assert df.empty and [s[:2] for s in df.attrs["skipped"]] == [(str(path), 1)]


@pytest.mark.timeout(120)
def test_globs_through_symlink_loops_load_each_file_once(tmp_path):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_text(json.dumps(_doc([_span("00000000000000a1")])) + "\n")
    (d / "sub" / "b.jsonl").write_text(json.dumps(_doc([_span("00000000000000b1")])) + "\n")
    (d / "self").symlink_to(".")
    (d / "alias.jsonl").symlink_to(d / "a.jsonl")
    df = load(str(d / "**" / "*.jsonl"))
    assert sorted(df["span_id"]) == ["00000000000000a1", "00000000000000b1"]
    (d / "sub" / "up").symlink_to("..")  # two loops: glob.glob's walk would be exponential
    for source in (str(d / "**" / "*.jsonl"), [str(d / "*.jsonl"), str(d / "self" / "a.jsonl"), d]):
        df = load(source)
        assert sorted(df["span_id"]) == ["00000000000000a1", "00000000000000b1"]


# --- properties -----------------------------------------------------------------------------------
hex_id = st.integers(1, 2**64 - 1).map(lambda i: f"{i:016x}")
trace_id = st.integers(1, 2**128 - 1).map(lambda i: f"{i:032x}")
timestamp = st.integers(0, 2**63 - 1)
scalar_value = st.one_of(
    st.text(max_size=30).map(lambda s: {"stringValue": s}),
    st.integers(-2**63, 2**63 - 1).map(lambda i: {"intValue": str(i)}),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda f: {"doubleValue": f}),
    st.booleans().map(lambda b: {"boolValue": b}))
any_value = st.recursive(scalar_value, lambda inner: st.one_of(
    st.lists(inner, max_size=3).map(lambda v: {"arrayValue": {"values": v}}),
    st.lists(st.tuples(st.text(max_size=5), inner), max_size=3).map(
        lambda kv: {"kvlistValue": {"values": [{"key": k, "value": v} for k, v in kv]}})),
    max_leaves=8)
attribute = st.one_of(
    st.tuples(st.sampled_from(["app.x", "app.y", "http.route"]), any_value),
    st.tuples(st.just(spans.TOKENS), st.integers(0, 2**40).map(lambda i: {"intValue": i})),
    st.tuples(st.just(spans.MODE), st.sampled_from([m.value for m in spans.Mode]).map(
        lambda m: {"stringValue": m})))


@st.composite
def valid_span(draw) -> dict:
    start = draw(timestamp)
    end = draw(st.integers(start, 2**63 - 1))
    as_text = draw(st.booleans())
    return {"traceId": draw(trace_id), "spanId": draw(hex_id),
            "parentSpanId": draw(st.one_of(st.just(""), hex_id)),
            "name": draw(st.sampled_from([n.value for n in spans.SpanName])),
            "startTimeUnixNano": str(start) if as_text else start,
            "endTimeUnixNano": str(end) if as_text else end,
            "attributes": [{"key": k, "value": v} for k, v in draw(st.lists(attribute, max_size=4))],
            "status": draw(st.sampled_from([{}, {"code": 1}, {"code": "STATUS_CODE_ERROR",
                                                               "message": "m"}]))}


documents = st.lists(st.lists(valid_span(), min_size=0, max_size=4), min_size=1, max_size=4).map(
    lambda lines: [_doc(sl) for sl in lines])
json_junk = st.recursive(st.none() | st.booleans() | st.integers() | st.integers(2**63, 2**70)
                         | st.floats() | st.text(max_size=10),
                         lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
suffix = st.sampled_from([".jsonl", ".json", ".jsonl.gz", ".json.gz"])


def _write(lines: list[bytes], suffix_: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix="kvtune-fuzz-"))
    data = b"".join(line + b"\n" for line in lines)
    path = d / f"spans{suffix_}"
    path.write_bytes(gzip.compress(data) if suffix_.endswith(".gz") else data)
    return path


def _cleanup(path: Path) -> None:
    path.unlink()
    os.rmdir(path.parent)


@PROPERTY
@given(documents, suffix)
def test_property_valid_documents_load_every_span(docs, suffix_):
    path = _write([json.dumps(d).encode() for d in docs], suffix_)
    try:
        df = load(path, correct_clocks=False, progress=False)
    finally:
        _cleanup(path)
    want = [s for d in docs for s in d["resourceSpans"][0]["scopeSpans"][0]["spans"]]
    assert list(df["span_id"]) == [s["spanId"] for s in want]
    assert list(df["start_ns"]) == [int(s["startTimeUnixNano"]) for s in want]
    assert df.attrs["skipped"] == []


def _set_at(doc: object, path: list[int], value: object) -> object:
    """``doc`` with the node reached by following ``path`` (indices into containers, taken
    modulo their size) replaced by ``value``."""
    if not path or not isinstance(doc, (dict, list)) or not doc:
        return value
    if isinstance(doc, dict):
        keys = list(doc)
        k = keys[path[0] % len(keys)]
        return {**doc, k: _set_at(doc[k], path[1:], value)}
    i = path[0] % len(doc)
    return [*doc[:i], _set_at(doc[i], path[1:], value), *doc[i + 1:]]


@st.composite
def corrupted_lines(draw) -> list[bytes]:
    docs = draw(documents)
    lines = []
    for d in docs:
        how = draw(st.sampled_from(["keep", "replace", "bytes", "cut", "deep"]))
        if how == "replace":  # a value of the wrong type or range anywhere in the document
            d = _set_at(d, draw(st.lists(st.integers(0, 50), max_size=8)), draw(json_junk))
        text = json.dumps(d).encode()
        if how == "bytes":
            at = draw(st.integers(0, len(text)))
            text = text[:at] + draw(st.binary(min_size=1, max_size=8)).replace(b"\n", b" ") + text[at:]
        elif how == "cut":
            text = text[:draw(st.integers(0, max(0, len(text) - 1)))]
        elif how == "deep":
            text = _with_attr("00000000000000d1", _nested(draw(st.integers(30, 400)),
                                                          draw(st.sampled_from(["array", "kvlist"])))).encode()
        lines.append(text)
    return lines


@PROPERTY
@given(corrupted_lines(), suffix)
def test_property_corrupted_documents_raise_kvtune_errors_or_are_skipped(lines, suffix_):
    path = _write(lines, suffix_)
    try:
        try:
            load(path, progress=False)
        except KvtuneError as exc:
            assert str(path) in str(exc)
        df = load(path, skip_bad=True, progress=False)  # never raises on bad records
    finally:
        _cleanup(path)
    assert df["start_ns"].between(0, 2**63 - 1).all()
    for source, line, reason in df.attrs["skipped"]:
        assert source == str(path) and reason
