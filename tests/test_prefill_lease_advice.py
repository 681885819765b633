"""vLLM's prefill lease (kv_lease_duration): holds measured from kv.prefill_lease.* on synthetic
spans, the findings on reads near or after expiry, the recommended lease and its export."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from kvtune import spans as sc
from kvtune.analysis.prefill_lease import prefill_lease_holds
from kvtune.export import kv_transfer_configs, write
from kvtune.recommend import prefill_lease as PL
from kvtune.recommend.prefill_lease import recommend_lease
from kvtune.testing import synthetic as syn
from kvtune.vllm_pd import KV_CONNECTOR_EXTRA_CONFIG, KV_LEASE_DURATION

_O = sc.PrefillLeaseOutcome


def _hold(held_s: float, outcome: _O = _O.READ, lease_s: float = 30.0, renewals: int = 0,
          margin_s: float | None = None) -> dict:
    margin = lease_s - held_s if margin_s is None else margin_s
    return {"name": sc.SpanName.NOTIFY.value, "host": "prefill-0", "start_ns": syn.T0_NS,
            "end_ns": syn.T0_NS,
            "attrs": {sc.ROLE: sc.Role.PREFILL.value, sc.PREFILL_LEASE_S: lease_s,
                      sc.PREFILL_LEASE_HELD_S: held_s, sc.PREFILL_LEASE_RENEWALS: renewals,
                      sc.PREFILL_LEASE_MARGIN_S: margin, sc.PREFILL_LEASE_OUTCOME: outcome.value}}


def _frame(records: list[dict]):
    other = {"name": sc.SpanName.NOTIFY.value, "host": "decode-0", "start_ns": syn.T0_NS,
             "end_ns": syn.T0_NS, "attrs": {sc.ROLE: sc.Role.DECODE.value}}
    return syn.spans_frame([other, *records])


def test_holds_summarise_reads_expiries_and_near_expiry() -> None:
    delays = [0.2, 0.5, 1.0, 2.0, 27.0]
    recs = [_hold(d) for d in delays] + [_hold(31.0, _O.EXPIRED, margin_s=-0.1),
                                         _hold(4.0, _O.RELEASED),
                                         _hold(40.0, renewals=5, margin_s=15.0)]
    h = prefill_lease_holds(_frame(recs))
    assert h is not None
    assert (h.n_holds, h.n_read, h.n_expired, h.n_released) == (8, 6, 1, 1)
    assert h.read_delays_s == (0.2, 0.5, 1.0, 2.0, 27.0, 40.0)  # ascending, reads only
    assert h.lease_s == 30.0 and h.near_margin_s == pytest.approx(6.0)
    assert h.n_near_expiry == 1                                  # the 27 s read: 3 s left
    assert h.read_renewals == 5
    assert h.delay_quantile_s(0.5) == pytest.approx(1.5)


def test_no_hold_attributes_means_no_holds_and_no_advice() -> None:
    spans = syn.serving_spans(syn.SyntheticWorkload(n_conversations=3), mode="pull", seed=1)
    assert prefill_lease_holds(spans) is None
    assert recommend_lease(None) == (None, [])


def test_lease_is_a_high_quantile_with_headroom_in_whole_seconds() -> None:
    rng = np.random.default_rng(3)
    delays = rng.uniform(0.5, 8.0, 400)
    rec, findings = recommend_lease(prefill_lease_holds(_frame([_hold(float(d)) for d in delays])))
    assert findings == []
    want = math.ceil(float(np.quantile(np.sort(delays), PL.QUANTILE)) * PL.HEADROOM)
    assert rec is not None and rec.name == KV_LEASE_DURATION and rec.unit == "s"
    assert rec.value == want and isinstance(rec.value, int)
    assert rec.range[0] <= rec.value <= rec.range[1]
    ev = rec.evidence.as_dict()
    assert ev["n_read"] == 400 and ev["lease_s_in_force"] == 30.0 and "kv.prefill_lease" in ev["source"]


def test_lease_is_bounded() -> None:
    short, _ = recommend_lease(prefill_lease_holds(_frame([_hold(0.01)] * 10)))
    long_, _ = recommend_lease(prefill_lease_holds(_frame([_hold(900.0, lease_s=1200.0)] * 10)))
    assert short.value == PL.MIN_S and long_.value == PL.MAX_S


def test_expiries_and_near_expiry_reads_are_findings_and_keep_the_lease() -> None:
    recs = [_hold(0.3)] * 50 + [_hold(28.5)] + [_hold(30.2, _O.EXPIRED, margin_s=-0.2)] * 3
    rec, findings = recommend_lease(prefill_lease_holds(_frame(recs)))
    by = {f.code: f for f in findings}
    assert set(by) == {"prefill_lease_expired", "prefill_lease_near_expiry"}
    assert by["prefill_lease_expired"].severity == "warning"
    assert by["prefill_lease_expired"].evidence["n_expired"] == 3
    assert by["prefill_lease_near_expiry"].evidence["n_near_expiry"] == 1
    # the reads alone would say ceil(p99 x 1.5); with expiries it never drops below the lease
    assert rec.value >= 30


def _with_lease(tuning, value: int):
    rec, _ = recommend_lease(prefill_lease_holds(_frame([_hold(value / PL.HEADROOM)] * 5)))
    assert rec.value == value
    return dataclasses.replace(tuning, extra={**tuning.extra, KV_LEASE_DURATION: rec.as_dict()})


def test_export_writes_the_lease_only_when_it_is_not_vllms_default(tmp_path) -> None:
    from tests.test_export import _tuning

    base = _tuning(mode="pull")
    plain = kv_transfer_configs(base)
    assert all(KV_LEASE_DURATION not in c[KV_CONNECTOR_EXTRA_CONFIG] for c in plain.values())
    default = kv_transfer_configs(_with_lease(base, 30))
    assert all(KV_LEASE_DURATION not in c[KV_CONNECTOR_EXTRA_CONFIG] for c in default.values())
    t = _with_lease(base, 12)
    changed = kv_transfer_configs(t)
    assert {r: c[KV_CONNECTOR_EXTRA_CONFIG][KV_LEASE_DURATION] for r, c in changed.items()} == \
        {"prefill": 12, "decode": 12}
    for role in ("prefill", "decode"):  # nothing else moved
        a = dict(changed[role][KV_CONNECTOR_EXTRA_CONFIG])
        a.pop(KV_LEASE_DURATION)
        assert a == plain[role][KV_CONNECTOR_EXTRA_CONFIG]
    write(t, tmp_path / "out", model="m")
    rec = json.loads((tmp_path / "out" / "recommendation.json").read_text())
    assert rec["written"][KV_LEASE_DURATION] == 12
    assert rec["recommendations"][KV_LEASE_DURATION]["value"] == 12
    assert rec["extra"][KV_LEASE_DURATION]["evidence"]["n_read"] == 5
    assert "kv_lease_duration | **12**" in (tmp_path / "out" / "REPORT.md").read_text()


def test_recommend_adds_the_lease_without_changing_the_other_values() -> None:
    from kvtune.recommend import recommend

    wl = syn.SyntheticWorkload(n_conversations=10)
    plain_spans = syn.serving_spans(wl, mode="pull", seed=4)
    held_spans = syn.serving_spans(dataclasses.replace(wl, prefill_lease_s=30.0), mode="pull",
                                   seed=4)
    plain = recommend(plain_spans, n_boot=10, use_simulator=False)
    held = recommend(held_spans, n_boot=10, use_simulator=False)
    assert KV_LEASE_DURATION not in plain.extra
    lease = held.extra[KV_LEASE_DURATION]
    assert lease["name"] == KV_LEASE_DURATION and PL.MIN_S <= lease["value"] <= PL.MAX_S
    assert lease["evidence"]["n_read"] == int(
        (held_spans[sc.PREFILL_LEASE_OUTCOME].astype("object") == "read").sum())
    for name in ("threshold", "ttl", "mode"):
        assert getattr(held, name).value == getattr(plain, name).value
