"""verify.json, the page, the verdict and the tune report's verification line, from a recorded real
run (``examples/verify-local-smoke``: the local vLLM pair, two configurations and a two-length
crossover sweep; see its README for the command)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from kvtune.errors import ConfigError
from kvtune.verify import measure, page, results, stats, verdict
from kvtune.verify import crossover as X
from kvtune.verify.configs import VerifyConfig
from kvtune.verify.results import RequestMeasurement
from kvtune.verify.stats import PairedChange

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verify-local-smoke"


@pytest.fixture(scope="module")
def recorded() -> results.VerifyResult:
    return results.read(EXAMPLE / results.RESULT_FILE)


def test_recorded_result_reads_and_round_trips(recorded, tmp_path):
    assert recorded.format == results.RESULT_FORMAT
    assert [c.config.name for c in recorded.configs] == ["defaults", "bidi"]
    back = results.read(results.write(recorded, tmp_path / "v.json"))
    assert back == recorded
    data = json.loads((tmp_path / "v.json").read_text())
    # units are in the field names
    cfg = data["configs"][0]
    assert {"ttft_p50", "reuse_captured_share", "decode_kv_usage_mean_pct", "wall_s"} <= set(cfg)
    assert {"value_ms", "low_ms", "high_ms"} <= set(cfg["ttft_p50"])


def test_recorded_real_run_measured_what_it_claims(recorded):
    defaults, bidi = recorded.configs
    for c in recorded.configs:
        assert c.n_failed == 0 and len(c.requests) >= 8
        assert all(r.ttft_ms is not None and r.ttft_ms > 0 for r in c.requests)
        assert c.ttft_p50.low_ms <= c.ttft_p50.value_ms <= c.ttft_p50.high_ms
        assert c.ttft_p50.value_ms <= c.ttft_p99.value_ms
        assert c.memory and c.decode_kv_blocks_total and c.decode_kv_blocks_total > 0
    # pull mode never pulls history back; bidirectional turns 2 did (real prefill counters)
    assert defaults.reused_tokens == 0 and defaults.reuse_captured_share == 0
    assert bidi.reused_tokens > 0 and 0 < bidi.reuse_captured_share <= 1
    (comp,) = recorded.comparisons
    assert (comp.baseline, comp.candidate) == ("defaults", "bidi")
    assert comp.p50.n_pairs == len(bidi.requests)
    assert comp.p50.low_pct <= comp.p50.faster_pct <= comp.p50.high_pct


def test_recorded_crossover(recorded):
    cx = recorded.crossover
    assert cx is not None
    assert set(cx.estimate.lengths_tokens) == {32, 256}
    assert {p.reuse for p in cx.points} == {"on", "off"}
    assert cx.recommended_range_tokens == (17.0, 74.0)
    # re-analysing the recorded points gives the recorded estimate (the analysis is pure)
    again = X.analyze(cx.points, {"recommendations": {"kv_recompute_threshold": {
        "value": cx.recommended_threshold_tokens, "range": list(cx.recommended_range_tokens),
        "evidence": {"break_even_tokens": cx.predicted_break_even_tokens}}}})
    assert again.estimate == cx.estimate and again.inside_range == cx.inside_range


def test_page_has_verdicts_table_and_figures(recorded):
    html = page.render(recorded)
    assert recorded.comparisons[0].verdict.split(" (")[0] in html
    assert 'id="plot-comparison"' in html and 'id="plot-crossover"' in html
    assert "Measured crossover" in html
    # plotly.js is inline (the page works offline), not a <script src=...> from a CDN
    assert "<script src=" not in html and len(html) > 1_000_000
    rows = page.table_rows(recorded)
    assert rows[0][0] == "config" and [r[0] for r in rows[1:]] == ["defaults", "bidi"]


def test_verdict_wording_follows_the_interval_and_names_the_detectable_effect():
    ch = PairedChange(0.5, 12.34, 4.0, 19.0, 40, 100.0, 87.66, detectable_pct=6.25, starts=2)
    text = verdict.verdict_text("defaults", "recommended", ch)
    assert text.startswith("recommended is 12.3% faster than defaults at p50")
    assert "[4.0, 19.0]" in text and "40 matched requests over 2 starts each" in text
    assert "smallest detectable effect 6.2% (80% power, 5% level)" in text
    assert verdict.status(ch) == verdict.STATUS_BETTER
    # an interval across zero: no word for a direction, only what the run could have seen
    tie = dataclasses.replace(ch, faster_pct=-5.6, low_pct=-15.5, high_pct=7.2)
    assert verdict.status(tie) == f"{verdict.STATUS_NO_DIFFERENCE} above 6.2%"
    text = verdict.verdict_text("defaults", "recommended", tie)
    assert "no difference detectable above 6.2% at p50" in text
    assert "faster than" not in text and "slower than" not in text
    slow = dataclasses.replace(ch, faster_pct=-20.0, low_pct=-30.0, high_pct=-10.0)
    assert verdict.status(slow) == verdict.STATUS_WORSE
    assert "20.0% slower" in verdict.verdict_text("d", "r", slow)
    assert verdict.status(None) == verdict.STATUS_UNKNOWN
    # where kvtune recommends vLLM's defaults, the decision is what is verified
    assert verdict.decision_status("bidirectional", tie).startswith(verdict.STATUS_DEFAULTS)
    assert "no difference detectable above 6.2% (a tie)" in verdict.decision_status(
        "bidirectional", tie)
    assert "decision verified" in verdict.decision_status("push", slow)
    assert "not confirmed" in verdict.decision_status("push", ch)


def test_paired_change_over_starts_holds_the_workload_fixed_and_counts_start_offsets():
    rng = np.random.default_rng(0)
    # a spread-out request mix (as the fleet's: first turns the same under both, later turns
    # much faster under the candidate), replayed in two starts with 3% jitter per measurement
    sizes = np.exp(rng.uniform(np.log(50), np.log(1500), 100))
    ratio = np.where(np.arange(100) % 4 == 0, 1.0, 0.4)
    base, cand, starts, units = {}, {}, {}, {}
    for s in (0, 1):
        for i, v in enumerate(sizes):
            k = f"r{i}@{s}"
            base[k] = v * rng.normal(1, 0.03)
            cand[k] = ratio[i] * v * rng.normal(1, 0.03)
            starts[k], units[k] = s, f"r{i}"
    flat = stats.paired_change(base, cand)  # requests resampled: the mix's spread counts
    rep = stats.paired_change(base, cand, starts=starts, units=units)
    assert flat.starts == 1 and rep.starts == 2
    assert flat.low_pct < rep.faster_pct < flat.high_pct
    assert rep.low_pct < rep.faster_pct < rep.high_pct
    # the same requests replayed in both starts: their mix is a design, not noise
    assert rep.detectable_pct < flat.detectable_pct / 2
    # a start whose candidate runs 15% slower is an offset the interval must carry
    shifted = {k: v * (1.15 if starts[k] else 1.0) for k, v in cand.items()}
    off = stats.paired_change(base, shifted, starts=starts, units=units)
    assert off.detectable_pct > 2 * rep.detectable_pct


def _tune_dir(tmp_path: Path, recorded: results.VerifyResult, *, matching: bool) -> Path:
    tune = tmp_path / "tune"
    (tune / "configs").mkdir(parents=True)
    bidi = recorded.configs[1].config
    rec = {"model": "m", "recommendations": {
        "mode": {"value": "bidirectional" if matching else "pull",
                 "range": ["bidirectional", "pull"]},
        "kv_recompute_threshold": {"value": bidi.recompute_threshold_tokens, "range": [17, 74]},
        "decoder_kv_blocks_ttl": {"value": bidi.ttl_s, "range": [4, 22]}}}
    (tune / "configs" / "recommendation.json").write_text(json.dumps(rec))
    return tune


def _as_recommended(recorded: results.VerifyResult) -> results.VerifyResult:
    cfgs = list(recorded.configs)
    cfgs[1] = dataclasses.replace(cfgs[1], config=dataclasses.replace(cfgs[1].config,
                                                                        name="recommended"))
    comps = tuple(dataclasses.replace(c, candidate="recommended") for c in recorded.comparisons)
    return dataclasses.replace(recorded, configs=tuple(cfgs), comparisons=comps)


def test_tune_report_shows_a_matching_verification(recorded, tmp_path):
    from kvtune.tune import headline
    from kvtune.verify import tune_link

    res = _as_recommended(recorded)
    tune = _tune_dir(tmp_path, recorded, matching=True)
    report = tune_link.attach(res, tune)
    assert report is not None
    rec = json.loads((tune / "configs" / "recommendation.json").read_text())
    entry = rec[headline.VERIFY_KEY]
    assert entry["status"] == verdict.status(res.comparisons[0].p50)
    assert entry["ttft_p50_change_pct"] == pytest.approx(-res.comparisons[0].p50.faster_pct,
                                                         abs=0.01)
    html = report.read_text()
    assert 'id="verification"' in html and entry["status"] in html
    assert "not-verified" not in html.split('id="verification"')[1][:40] or \
        entry["status"].startswith("not ")
    assert "Verification: measured TTFT per configuration" in html  # the figure's section
    # what `kvtune tune` reads from its own output directory
    results.write(res, tune_link.result_path(tune))
    assert tune_link.verification_for_tune_dir(tune, rec)["status"] == entry["status"]


def test_a_verification_of_other_values_is_not_shown(recorded, tmp_path):
    from kvtune.verify import tune_link

    res = _as_recommended(recorded)
    tune = _tune_dir(tmp_path, recorded, matching=False)
    assert tune_link.attach(res, tune) is None
    results.write(res, tune_link.result_path(tune))
    rec = json.loads((tune / "configs" / "recommendation.json").read_text())
    assert tune_link.verification_for_tune_dir(tune, rec) is None
    assert tune_link.verification_for_tune_dir(tmp_path / "empty", rec) is None


def test_headline_reads_the_entry():
    from kvtune.tune.headline import Verification

    v = Verification.from_json({"status": verdict.STATUS_BETTER, "ttft_p50_change_pct": -12.5,
                                "detail": "recommended beat defaults by 12.5%"})
    assert v.text().startswith("Verification: verified: faster than defaults, TTFT p50 12.5% "
                               "lower than under vLLM's defaults")


def test_bad_result_files(tmp_path):
    p = tmp_path / "v.json"
    p.write_text(json.dumps({"format": "nope"}))
    with pytest.raises(ConfigError, match="field 'format'"):
        results.read(p)
    p.write_text("[")
    with pytest.raises(ConfigError, match="expected JSON"):
        results.read(p)
    p.write_text(json.dumps({"format": results.RESULT_FORMAT, "configs": [{"config": 3}]}))
    with pytest.raises(ConfigError, match=r"configs\[0\].config"):
        results.read(p)


def test_router_spans_give_ttft_by_client_request_id():
    ttft = measure.ttft_from_router_spans(EXAMPLE / "router-spans-defaults.jsonl")
    recorded = results.read(EXAMPLE / results.RESULT_FILE)
    assert len(ttft) == len(recorded.configs[0].requests)
    assert all(v > 0 for v in ttft.values())
    assert sorted(round(v, 6) for v in ttft.values()) == sorted(
        round(r.ttft_ms, 6) for r in recorded.configs[0].requests)


def _otlp_line(service: str, spans_: list[tuple[str, str, int, int, dict]]) -> str:
    def attr(k, v):
        return {"key": k, "value": {"intValue": str(v)} if isinstance(v, int)
                else {"stringValue": v}}
    return json.dumps({"resourceSpans": [{
        "resource": {"attributes": [attr("service.name", service)]},
        "scopeSpans": [{"scope": {"name": "kvtune"}, "spans": [
            {"traceId": tid, "spanId": f"{i + 1:016x}", "name": name, "kind": 1,
             "startTimeUnixNano": str(start), "endTimeUnixNano": str(end),
             "attributes": [attr(k, v) for k, v in a.items()]}
            for i, (tid, name, start, end, a) in enumerate(spans_)]}]}]}) + "\n"


def test_ttft_to_the_decodes_first_step_joins_router_and_engine_spans(tmp_path):
    from kvtune import spans as S

    t1, t2, t3 = "a" * 32, "b" * 32, "c" * 32
    ms = 1_000_000
    router = tmp_path / "router.jsonl"
    router.write_text(_otlp_line("kvtune-router", [
        (t1, S.SpanName.REQUEST.value, 0, 90 * ms, {S.CLIENT_REQUEST_ID: "r1", S.ROLE: "router"}),
        (t2, S.SpanName.REQUEST.value, 5 * ms, 70 * ms, {S.CLIENT_REQUEST_ID: "r2",
                                                         S.ROLE: "router"}),
        (t3, S.SpanName.REQUEST.value, 0, 50 * ms, {S.CLIENT_REQUEST_ID: "r3",
                                                    S.ROLE: "router"})]))
    engines = tmp_path / "spans"
    engines.mkdir()
    (engines / "decode.jsonl").write_text(_otlp_line("kvtune-decode", [
        (t1, S.SpanName.DECODE_START.value, 30 * ms, 32 * ms, {S.ROLE: S.Role.DECODE.value}),
        (t2, S.SpanName.DECODE_START.value, 40 * ms, 45 * ms, {S.ROLE: S.Role.DECODE.value}),
        # a prefill's span of r3 is not the decode's first step
        (t3, S.SpanName.PREFILL.value, 1 * ms, 20 * ms, {S.ROLE: S.Role.PREFILL.value})]))
    got = measure.decode_first_step_ms(router, engines)
    assert got == pytest.approx({"r1": 32.0, "r2": 40.0})
    assert measure.decode_first_step_ms(router, None) == {}
    assert measure.decode_first_step_ms(router, tmp_path / "absent") == {}


def test_ttft_basis_is_the_decode_only_when_every_answered_request_has_it():
    from kvtune.local.workload import RequestResult

    res = [RequestResult("c", 1, "r1", 10, 2, 0.0, 90.0, 5.0, True),
           RequestResult("c", 2, "r2", 20, 2, 1.0, 70.0, 6.0, True),
           RequestResult("d", 1, "r3", 10, 0, 2.0, 10.0, None, False, "HttpError")]
    facts = {"r1": (7.0, None), "r2": (8.0, 300)}
    reqs, basis = measure.measurements(res, facts, {"r1": 32.0, "r2": 40.0})
    assert basis == results.TTFT_BASIS_DECODE
    assert [(r.ttft_ms, r.router_ttft_ms) for r in reqs] == [(32.0, 7.0), (40.0, 8.0),
                                                             (None, None)]
    assert reqs[1].offered_tokens == 300
    # one of two answered requests without a decode first step: the router's TTFT for all
    reqs, basis = measure.measurements(res, facts, {"r1": 32.0})
    assert basis == results.TTFT_BASIS_ROUTER
    assert [r.ttft_ms for r in reqs] == [7.0, 8.0, None]
    assert all(r.router_ttft_ms is None for r in reqs)
    # one of twenty (its decode's spans lost): the decode basis, that request without a TTFT
    many = [RequestResult("c", 1, f"q{i}", 10, 2, 0.0, 90.0, 5.0, True) for i in range(20)]
    reqs, basis = measure.measurements(many, {}, {f"q{i}": 30.0 + i for i in range(1, 20)})
    assert basis == results.TTFT_BASIS_DECODE
    assert reqs[0].ttft_ms is None and reqs[0].ok and reqs[1].ttft_ms == 31.0
    reqs, basis = measure.measurements(res, facts)
    assert basis == results.TTFT_BASIS_ROUTER and reqs[0].ttft_ms == 7.0


def test_kv_usage_and_summary_are_pure():
    text = ('# HELP vllm:kv_cache_usage_perc KV-cache usage.\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="256"} 1.0\n')
    assert measure.kv_usage_from_text(text) == (0.25, 256)
    assert measure.kv_usage_from_text("") == (None, None)
    reqs = (RequestMeasurement("c", 1, 100, 10.0, 20.0, True),
            RequestMeasurement("c", 2, 300, 12.0, 20.0, True),
            RequestMeasurement("d", 2, 100, None, 20.0, False, "HttpError"))
    s = measure.summarize(VerifyConfig("x", "bidirectional"), reqs, reused_tokens=150,
                          memory=(), blocks_total=None, wall_s=1.0)
    assert s.turn2plus_prompt_tokens == 300 and s.reuse_captured_share == 0.5
    assert s.n_failed == 1 and s.ttft_p50.value_ms == 11.0
    assert s.decode_kv_usage_mean_pct is None


def test_crossover_plans_and_lengths():
    spec = X.CrossoverSpec((128, 256), repeats=3)
    plans = X.plans(spec)
    assert plans == X.plans(spec)
    swept = [p for p in plans if X.history_of(p.conversation_id) is not None]
    fillers = [p for p in plans if X.history_of(p.conversation_id) is None]
    arms = [X.history_of(p.conversation_id) for p in swept]
    # each (length, repeat) has both arms in the same batch; only the reuse-on arm links turns
    assert sorted(arms) == sorted((h, a) for h in (128, 256) for _ in range(3) for a in ("on", "off"))
    for r in range(3):  # a repeat in two batches (every other length), both arms in each
        for i, lengths in enumerate(((128,), (256,))):
            batch = [p for p in swept if p.batch == 2 * r + i]
            assert sorted(X.history_of(p.conversation_id) for p in batch) == sorted(
                (h, a) for h in lengths for a in ("on", "off"))
            # the batch carries enough traffic to evict every history from the sweep's prefill
            carried = sum(len(p.turns[0].user_tokens) for p in plans if p.batch == 2 * r + i)
            assert carried >= X.EVICT_FACTOR * spec.prefill_cache_tokens
    assert fillers and all(len(p.turns) == 1 for p in fillers)
    for p, (h, arm) in zip(swept, arms):
        t1, t2 = p.turns
        assert len(t1.user_tokens) + t1.max_tokens == h and t2.max_tokens == 1
        assert p.link_turns == (arm == "on")
        assert (p.router_conversation_id(2) == p.router_conversation_id(1)) == (arm == "on")
    cfg = spec.config()
    assert (cfg.mode, cfg.recompute_threshold_tokens, cfg.ttl_s) == (
        "bidirectional", X.REUSE_ON_THRESHOLD_TOKENS, X.SWEEP_TTL_S)
    # lengths come from the workload: one block to the longest history, log-spaced
    grid = X.lengths_from_workload(2680)
    assert grid[0] == 128 and grid[-1] == 2680 and list(grid) == sorted(set(grid))
    assert len(grid) == X.N_LENGTHS
    assert X.lengths_from_workload(10 ** 6)[-1] == X.MAX_HISTORY_TOKENS
    with pytest.raises(ConfigError, match="repeats"):
        X.CrossoverSpec((128, 256), repeats=1)
    with pytest.raises(ConfigError, match="lengths_tokens"):
        X.CrossoverSpec((32, 256))
    with pytest.raises(ConfigError, match="lengths_tokens"):
        X.CrossoverSpec((128, 5000))


def test_crossover_statement_says_when_the_arms_never_cross():
    est = stats.crossover({128: [30, 31], 512: [35, 36]}, {128: [60, 61], 512: [200, 210]})
    assert est.side == "reuse_always_faster"
    assert X.statement(est).startswith("reuse faster at every swept length >= 128 tokens")
    est = stats.crossover({128: [60, 61], 512: [35, 36]}, {128: [30, 31], 512: [200, 210]})
    assert est.side == "crossed" and X.statement(est).startswith(f"crossover {est.tokens:.0f}")


def test_crossover_leaves_out_turns_whose_prefill_held_the_history():
    from kvtune.verify.results import CrossoverPoint as P
    pts = [P(256, "on", 30.0 + i, 256, 256) for i in range(4)]
    pts += [P(256, "off", 90.0 + i, None, 0) for i in range(3)]
    pts += [P(256, "off", 35.0, None, 256)]  # the prefill's own cache served it: not recomputed
    pts += [P(128, "on", 30.0 + i, 128, 128) for i in range(3)]
    pts += [P(128, "off", 60.0 + i, None, 0) for i in range(3)]
    res = X.analyze(pts)
    assert res.local_hits == 1
    assert res.estimate.diff_p50_ms[1] == pytest.approx(31.5 - 91.0)
