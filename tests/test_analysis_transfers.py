"""transfers(): the per-transfer phase table from hand-made spans frames."""
from __future__ import annotations

import logging

import pandas as pd
import pytest

from kvtune import spans as sc
from kvtune.analysis import TRANSFER_COLUMNS, empty_transfers, transfers
from kvtune.errors import AnalysisError
from kvtune.testing import synthetic as syn

MS = 1_000_000
T0 = syn.T0_NS

EXPECTED_COLUMNS = [
    "transfer_id", "trace_id", "request_id", "base_request_id", "conversation_id", "turn", "mode",
    "direction", "op", "tokens", "blocks", "bytes", "descriptors", "initiator_host", "target_host",
    "fabric", "registration_ms", "rendezvous_ms", "first_arrival", "descriptor_setup_ms", "rdma_ms",
    "notify_ms", "decode_start_ms", "total_ms", "critical_ms", "start_ns", "end_ns", "nixl_post_us",
    "nixl_xfer_us", "status",
]


def _span(name: sc.SpanName | str, host: str, start_ms: float, end_ms: float, tid: str = "r1:forward",
          **attrs) -> dict:
    base = {sc.TRANSFER_ID: tid, sc.MODE: sc.Mode.PULL.value,
            sc.DIRECTION: sc.Direction.FORWARD.value, sc.BASE_REQUEST_ID: tid.split(":")[0]}
    return {"name": getattr(name, "value", name), "host": host, "trace_id": "a" * 32,
            "start_ns": T0 + int(start_ms * MS), "end_ns": T0 + int(end_ms * MS),
            "attrs": {**base, **attrs}}


def _pull(tid: str = "r1:forward", t0: float = 0.0, notify_at: float = 5.0, **kw) -> list[dict]:
    return [
        _span(sc.SpanName.DESCRIPTOR_SETUP, "decode-0", t0, t0 + 1, tid, **kw),
        _span(sc.SpanName.RDMA, "decode-0", t0 + 1, t0 + 4, tid,
              **{sc.NIXL_OP: "READ", sc.BYTES: 4096, sc.DESCRIPTORS: 4, sc.TOKENS: 32,
                 sc.BLOCKS: 2, sc.NIXL_XFER_US: 2900.0, **kw}),
        _span(sc.SpanName.NOTIFY, "prefill-0", t0 + notify_at, t0 + notify_at + 0.01, tid, **kw),
        _span(sc.SpanName.DECODE_START, "decode-0", t0 + 4.5, t0 + 6.5, tid, **kw),
    ]


def test_columns_and_dtypes_are_the_contract():
    assert list(TRANSFER_COLUMNS) == EXPECTED_COLUMNS
    t = transfers(syn.spans_frame(_pull()))
    assert list(t.columns) == EXPECTED_COLUMNS
    assert list(empty_transfers().columns) == EXPECTED_COLUMNS
    assert str(t["bytes"].dtype) == "Int64" and str(t["rdma_ms"].dtype) == "Float64"
    assert str(t["transfer_id"].dtype) == "string"


def test_hand_computed_pull_transfer():
    t = transfers(syn.spans_frame(_pull()))
    assert len(t) == 1
    r = t.iloc[0]
    assert r["transfer_id"] == "r1:forward" and r["op"] == "READ" and r["mode"] == "pull"
    assert r["descriptor_setup_ms"] == pytest.approx(1.0)
    assert r["rdma_ms"] == pytest.approx(3.0)
    assert r["notify_ms"] == pytest.approx(0.01)
    assert r["decode_start_ms"] == pytest.approx(2.0)
    assert r["critical_ms"] == pytest.approx(4.0)
    assert r["total_ms"] == pytest.approx(6.5)
    assert r["initiator_host"] == "decode-0" and r["target_host"] == "prefill-0"
    assert (r["bytes"], r["descriptors"], r["tokens"], r["blocks"]) == (4096, 4, 32, 2)
    # push-only phases are missing, not zero
    assert pd.isna(r["registration_ms"]) and pd.isna(r["rendezvous_ms"])
    assert pd.isna(r["first_arrival"])


def test_missing_setup_keeps_critical_from_rdma_alone():
    spans = [s for s in _pull() if s["name"] != sc.SpanName.DESCRIPTOR_SETUP.value]
    r = transfers(syn.spans_frame(spans)).iloc[0]
    assert pd.isna(r["descriptor_setup_ms"])
    assert r["critical_ms"] == pytest.approx(3.0)


def test_tp_ranks_phase_spans_first_start_to_last_end():
    spans = _pull()
    spans.append(_span(sc.SpanName.RDMA, "decode-0", 1.5, 4.5, **{sc.TP_RANK: 1, sc.BYTES: 4096,
                                                                  sc.NIXL_XFER_US: 2900.0}))
    r = transfers(syn.spans_frame(spans)).iloc[0]
    assert r["rdma_ms"] == pytest.approx(3.5)
    assert r["bytes"] == 4096  # per rank, not summed


def test_push_phases_and_first_arrival():
    tid = "r2:forward"
    common = {sc.MODE: "push"}
    spans = [
        _span(sc.SpanName.REGISTRATION, "decode-0", 0, 0.5, tid, **common),
        _span(sc.SpanName.RENDEZVOUS, "prefill-0", 0.6, 10, tid,
              **{**common, sc.FIRST_ARRIVAL: sc.FirstArrival.REGISTRATION.value}),
        _span(sc.SpanName.DESCRIPTOR_SETUP, "prefill-0", 10, 10.5, tid, **common),
        _span(sc.SpanName.RDMA, "prefill-0", 10.5, 12, tid, **{**common, sc.NIXL_OP: "WRITE"}),
        _span(sc.SpanName.NOTIFY, "decode-0", 12.1, 12.2, tid, **common),
    ]
    r = transfers(syn.spans_frame(spans)).iloc[0]
    assert r["registration_ms"] == pytest.approx(0.5)
    assert r["rendezvous_ms"] == pytest.approx(9.4)
    assert r["first_arrival"] == "registration"
    assert r["initiator_host"] == "prefill-0" and r["target_host"] == "decode-0"
    assert pd.isna(r["decode_start_ms"])


def test_probe_warmups_are_dropped():
    spans = _pull("w:forward", **{sc.PROBE_WARMUP: True}) + _pull("m:forward", t0=10,
                                                                  **{sc.PROBE_WARMUP: False})
    t = transfers(syn.spans_frame(spans))
    assert list(t["transfer_id"]) == ["m:forward"]


def test_spans_without_transfer_id_are_ignored():
    spans = _pull() + [{"name": sc.SpanName.PREFILL.value, "host": "prefill-0", "start_ns": T0,
                        "end_ns": T0 + MS, "attrs": {sc.PROMPT_TOKENS: 10}}]
    assert len(transfers(syn.spans_frame(spans))) == 1


def test_no_transfers_is_a_clear_error():
    frame = syn.spans_frame([{"name": sc.SpanName.REQUEST.value, "host": "router",
                              "start_ns": T0, "end_ns": T0 + MS, "attrs": {}}])
    with pytest.raises(AnalysisError, match="no KV transfers.*kv.rdma.*1 span"):
        transfers(frame)


def test_only_warmups_is_a_clear_error():
    frame = syn.spans_frame(_pull(**{sc.PROBE_WARMUP: True}))
    with pytest.raises(AnalysisError, match="warm-up"):
        transfers(frame)


def test_same_host_notify_before_rdma_is_dropped_with_warning(caplog):
    spans = _pull()
    bad = _span(sc.SpanName.NOTIFY, "decode-0", -3, -2.9, "r3:forward")
    spans += [_span(sc.SpanName.RDMA, "decode-0", 0, 1, "r3:forward",
                    **{sc.NIXL_XFER_US: 1000.0}), bad]
    with caplog.at_level(logging.WARNING, logger="kvtune.analysis.transfers"):
        t = transfers(syn.spans_frame(spans))
    r3 = t.set_index("transfer_id").loc["r3:forward"]
    assert pd.isna(r3["notify_ms"])
    assert "1 kv.notify span(s)" in caplog.text and "1 same-host" in caplog.text


def test_clock_skewed_hosts_are_refused():
    # prefill-0's clock runs 50 ms behind: every notify "ends" before its rdma started
    spans = []
    for i in range(5):
        spans += _pull(f"r{i}:forward", t0=20.0 * i, notify_at=5.0 - 50.0)
    with pytest.raises(AnalysisError, match=r"decode-0 -> prefill-0.*skewed.*5 of 5.*correct_clocks"):
        transfers(syn.spans_frame(spans))


def test_a_few_acausal_cross_host_notifies_are_dropped():
    spans = []
    for i in range(10):
        spans += _pull(f"r{i}:forward", t0=20.0 * i, notify_at=-5.0 if i == 0 else 5.0)
    t = transfers(syn.spans_frame(spans)).set_index("transfer_id")
    assert pd.isna(t.loc["r0:forward", "notify_ms"])
    assert t["notify_ms"].notna().sum() == 9


def _on_host(spans: list[dict], host: str) -> list[dict]:
    for sp in spans:
        if sp["name"] in (sc.SpanName.RDMA.value, sc.SpanName.DESCRIPTOR_SETUP.value):
            sp["host"] = host
    return spans


def test_mixed_units_in_xfer_us_are_refused():
    spans = _pull("a:forward") + _pull("b:forward", t0=10)
    spans += _on_host(_pull("c:forward", t0=20) + _pull("d:forward", t0=30), "decode-1")
    for sp in spans[9::4]:  # decode-1's rdma spans: milliseconds written into a _us attribute
        sp["attrs"][sc.NIXL_XFER_US] = 2.9
    with pytest.raises(AnalysisError, match=r"mixed units.*2 transfer\(s\) initiated by decode-1.*"
                                            r"kv.nixl.xfer_us is 0.000967x"):
        transfers(syn.spans_frame(spans))


def test_one_stalled_rdma_is_not_a_unit_error():
    spans = _pull("a:forward") + _pull("b:forward", t0=10) + _pull("c:forward", t0=20)
    spans[5]["end_ns"] += 2000 * MS  # polled 2 s late; NIXL's own 2.9 ms stays
    t = transfers(syn.spans_frame(spans)).set_index("transfer_id")
    assert t.loc["b:forward", "rdma_ms"] == pytest.approx(2003.0)


def test_mixed_units_in_bytes_are_refused():
    spans = _pull("a:forward") + _pull("b:forward", t0=10)
    spans[5]["attrs"][sc.BYTES] = 4  # KiB instead of bytes
    with pytest.raises(AnalysisError, match="mixed units.*kv.bytes/kv.blocks"):
        transfers(syn.spans_frame(spans))


def test_span_ending_before_it_starts_is_refused():
    spans = _pull()
    spans[1]["end_ns"] = spans[1]["start_ns"] - MS
    with pytest.raises(AnalysisError, match="end before they start.*kv.rdma of r1:forward"):
        transfers(syn.spans_frame(spans))


def test_input_frame_is_not_modified():
    frame = syn.spans_frame(_pull())
    before = frame.copy()
    transfers(frame)
    pd.testing.assert_frame_equal(frame, before)


def test_loader_round_trip_gives_the_same_table(tmp_path):
    from kvtune.traces import load

    spans = syn.serving_spans(syn.SyntheticWorkload(n_conversations=5), mode="push", seed=4)
    path = tmp_path / "spans.jsonl"
    syn.write_otlp_json(spans, path)
    a = transfers(spans).sort_values("transfer_id").reset_index(drop=True)
    b = transfers(load(str(path))).sort_values("transfer_id").reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)
