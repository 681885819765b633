"""Traces holding several P/D modes (``kvtune.analysis.modes``) and what the mode choice does with
each mode's measured TTFT (``kvtune.recommend.mode``): pure, from hand-built span frames."""
from __future__ import annotations

import pandas as pd
import pytest

from kvtune import spans as S
from kvtune.analysis.modes import MeasuredTtft, first_step_ttft, measured_ttft, split_modes
from kvtune.recommend.mode import _with_measured
from kvtune.sim.calibrate import SimInput

MS = 1_000_000


def _span(trace: str, name: str, start_ms: float, end_ms: float, mode: str, role: str,
          **attrs: object) -> dict:
    return {"trace_id": trace, "name": name, "start_ns": int(start_ms * MS),
            "end_ns": int(end_ms * MS), "duration_ms": end_ms - start_ms, S.MODE: mode,
            S.ROLE: role, "attrs": {S.MODE: mode, S.ROLE: role, **attrs}}


def _request(i: int, mode: str, ttft_ms: float) -> list[dict]:
    t = f"{mode}-{i}"
    return [_span(t, S.SpanName.REQUEST.value, 0, 100, mode, "router",
                  **{S.CLIENT_REQUEST_ID: f"r-{t}"}),
            _span(t, S.SpanName.PREFILL.value, 2, 12, mode, S.Role.PREFILL.value),
            _span(t, S.SpanName.DECODE_START.value, ttft_ms - 1, ttft_ms, mode,
                  S.Role.DECODE.value)]


def _frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows)


def test_the_mode_with_most_requests_is_read_and_the_others_kept_apart():
    rows = [r for i in range(8) for r in _request(i, "bidirectional", 40.0 + i)]
    rows += [r for i in range(6) for r in _request(i, "push", 50.0 + i)]
    rows.append(_span("p", "kv.rdma", 0, 1, S.Mode.PROBE.value, "initiator"))
    split = split_modes(_frame(rows))
    assert split.main == "bidirectional" and split.requests == {"bidirectional": 8, "push": 6}
    assert set(split.main_spans[S.MODE]) == {"bidirectional", S.Mode.PROBE.value}
    assert set(split.others) == {"push"} and set(split.others["push"][S.MODE]) == {"push"}
    one = split_modes(_frame(rows[:24]))
    assert one.main == "bidirectional" and one.others == {} and len(one.main_spans) == 24


def test_ttft_runs_from_the_router_to_the_decodes_first_step():
    rows = [r for i in range(8) for r in _request(i, "pull", 30.0 + i)]
    rows += _request(99, "push", 70.0)[:2]  # no decode step traced: not measured
    t = first_step_ttft(_frame(rows))
    assert len(t) == 8 and sorted(t["ttft_ms"]) == [30.0 + i for i in range(8)]
    assert set(t["client_request_id"]) == {f"r-pull-{i}" for i in range(8)}
    got = measured_ttft(_frame(rows))
    assert set(got) == {"pull"} and got["pull"].n_requests == 8
    assert got["pull"].p50_ms == pytest.approx(33.5)
    few = [r for i in range(3) for r in _request(i, "push", 50.0)]
    assert measured_ttft(_frame(few)) == {}  # fewer than MIN_MODE_REQUESTS


def test_measured_modes_replace_simulated_ones_and_scale_the_rest():
    sim = {"pull": (44.0, 90.0), "push": (34.0, 70.0), "bidirectional": (44.0, 90.0)}
    inputs = (SimInput("overheads.hop_ms", 4.0, "measured"),)
    measured = {"bidirectional": MeasuredTtft(50.0, 200.0, 20),
                "push": MeasuredTtft(52.0, 210.0, 12)}
    out, scale, how = _with_measured(sim, inputs, measured, "bidirectional")
    # the simulated bidirectional TTFT less its hop back (40) against the measured 50: x 1.25
    assert scale == pytest.approx(1.25)
    assert out["bidirectional"] == (54.0, 204.0) and out["push"] == (56.0, 214.0)
    assert out["pull"] == pytest.approx((40.0 * 1.25 + 4.0, 86.0 * 1.25 + 4.0))
    assert how["pull"].startswith("kvtune.sim x 1.25") and how["push"].startswith("measured")
    # no measurement of the main mode: the simulator's numbers stand for unmeasured modes
    out, scale, how = _with_measured(sim, inputs, {"push": measured["push"]}, "bidirectional")
    assert scale is None and out["pull"] == sim["pull"] and out["push"] == (56.0, 214.0)


def test_traced_settings_and_the_scale_at_them():
    from kvtune.analysis.modes import traced_settings

    rows = [_span("t1", S.SpanName.REUSE_DECISION.value, 0, 0.1, "bidirectional",
                  S.Role.PREFILL.value, **{S.REUSE_THRESHOLD_TOKENS: 1}),
            _span("t2", S.SpanName.RETENTION.value, 0, 900, "bidirectional", S.Role.DECODE.value,
                  **{S.RETENTION_TTL_S: 480.0})]
    df = _frame(rows)
    df[S.REUSE_THRESHOLD_TOKENS] = [1, None]
    df[S.RETENTION_TTL_S] = [None, 480.0]
    got = traced_settings(df)
    assert (got.threshold_tokens, got.ttl_s) == (1, 480.0)
    assert traced_settings(_frame([])) == type(got)(None, None)
    # the main mode is compared with the simulator at the settings it was traced under
    sim = {"pull": (44.0, 90.0), "bidirectional": (44.0, 90.0)}
    at_traced = {"pull": (44.0, 90.0), "bidirectional": (54.0, 100.0)}
    inputs = (SimInput("overheads.hop_ms", 4.0, "measured"),)
    measured = {"bidirectional": MeasuredTtft(60.0, 200.0, 20)}
    _, scale, _ = _with_measured(sim, inputs, measured, "bidirectional", at_traced)
    assert scale == pytest.approx(60.0 / 50.0)


def test_a_measured_mode_leaves_pull_only_when_its_interval_clears_pull():
    from kvtune.recommend.mode import _pick

    ttft = {"pull": (48.0, 90.0), "push": (60.0, 99.0), "bidirectional": (44.0, 80.0)}
    allowed = ["pull", "push", "bidirectional"]
    noisy = {"pull": MeasuredTtft(48.0, 90.0, 24, (42.0, 55.0)),
             "bidirectional": MeasuredTtft(44.0, 80.0, 24, (38.0, 50.0))}  # reaches 48
    assert _pick(ttft, allowed) == "bidirectional"
    assert _pick(ttft, allowed, noisy) == "pull"
    clear = {**noisy, "bidirectional": MeasuredTtft(44.0, 80.0, 24, (40.0, 46.0))}
    assert _pick(ttft, allowed, clear) == "bidirectional"
    got = measured_ttft(_frame([r for i in range(20) for r in _request(i, "pull", 30.0 + i)]))
    lo, hi = got["pull"].p50_ci_ms
    assert lo <= got["pull"].p50_ms <= hi and hi - lo > 0
