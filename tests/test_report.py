"""The report's top: numbers rounded to what they support, findings as HTML, the model's name.

Pure functions on small hand-made inputs, plus the page built from ``kvtune recommend``'s files
(no notebooks) read in headless Chromium at 1400x900. The notebook path (papermill) has its own
screenshot test in ``test_tune.py``. (The real spans in ``examples/stalls`` cannot be used here:
their transfers span too few sizes for a floor fit, so ``recommend`` refuses them.)
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from kvtune.export import PLACEHOLDER, model_name
from kvtune.recommend.pipeline import recommend_source
from kvtune.traces import load
from kvtune.tune import headline
from kvtune.tune.findings import findings_html, sorted_findings
from kvtune.tune.numbers import (MAX_SIG_DIGITS, fmt_num, fmt_value, readable_text,
                                 significant_digits)
from kvtune.tune.report import write_report

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 1400, 900
NUMBER = re.compile(r"(?<![A-Za-z0-9_.])[-+]?\d[\d,]*(?:\.\d+)?")
HEX_ID = re.compile(r"\b(?=[0-9a-f]*[a-f])[0-9a-f]{16,}\b")  # trace/span ids, not numbers


def numbers_over(text: str, limit: int = MAX_SIG_DIGITS) -> list[str]:
    """Numbers in ``text`` with more than ``limit`` significant digits (ids left out)."""
    text = HEX_ID.sub(" ", text)
    return [m.group(0) for m in NUMBER.finditer(text)
            if significant_digits(m.group(0)) > limit]


@pytest.mark.parametrize("x, sig, want", [
    (0.22157840746361993, 3, "0.222"), (0.22157840746361993, 4, "0.2216"), (131072, 4, "131.1k"),
    (2147483647, 3, "2.15G"), (9876, 3, "9880"), (64, 3, "64"), (3.0, 3, "3"), (1e-5, 3, "1.00e-5"),
    (float("nan"), 3, "n/a"), (None, 3, "n/a"), (12, 9, "12"), (1234.5678, 9, "1235"),
])
def test_fmt_num_rounds_to_at_most_four_significant_digits(x, sig, want):
    assert fmt_num(x, sig) == want


@pytest.mark.parametrize("value, lo, hi, want", [
    (523, 410, 690, ("520", "410", "690")),     # range 280 wide: tens are what it supports
    (45, 30, 61, ("45", "30", "61")),
    (12345, 9000, 16000, ("12.3k", "9000", "16k")),
    (3, 3, 3, ("3", "3", "3")),                  # no width: the value as written, 4 digits at most
    ("never", 500, "never", ("never", "500", "never")),
])
def test_fmt_value_rounds_value_and_range_to_the_range_resolution(value, lo, hi, want):
    assert fmt_value(value, lo, hi) == want


@pytest.mark.parametrize("token, n", [("0.2216", 4), ("12300", 3), ("1,250", 3), ("0.22157", 5),
                                      ("2147483647", 10), ("0", 1), ("45", 2)])
def test_significant_digits(token, n):
    assert significant_digits(token) == n


def test_numbers_over_finds_long_numbers_and_skips_ids():
    text = "floor 0.22157840746361993 ms, trace 5b9310ad8ae13c6ecb261d55f7e91c6d, 131.1k, 2147483647"
    assert numbers_over(text) == ["0.22157840746361993", "2147483647"]


def test_readable_text_rounds_long_numbers_only_and_leaves_ids_alone():
    text = ("12 of 30 requests took over 1000 ms (p50 183456 ms, p99 0.22157840746361993 ms); "
            "conv-12345 5b9310ad8ae13c6e port :8100")
    assert readable_text(text) == ("12 of 30 requests took over 1000 ms (p50 183.5k ms, p99 0.2216 "
                                   "ms); conv-12345 5b9310ad8ae13c6e port :8100")


def test_findings_html_keeps_every_message_whole_most_severe_first():
    long = "x" * 400 + " the end of a long message, 183456 ms"
    fs = [{"code": "a_info", "severity": "info", "message": "short", "evidence": {}},
          {"code": "b_warn", "severity": "warning", "message": long,
           "evidence": {"ratio": 0.22157840746361993, "nested": {"n": 131072}, "ids": ["p", "q"]}}]
    out = findings_html(fs)
    assert long.replace("183456", "183.5k") in out
    assert out.index("b_warn") < out.index("a_info")
    assert "<details" in out and "<summary>" in out
    assert "0.222" in out and "nested.n" in out and "131k" in out and "p, q" in out
    assert "0.2215784" not in out
    assert [f["code"] for f in sorted_findings(fs)] == ["b_warn", "a_info"]


def test_findings_html_escapes_markup():
    out = findings_html([{"code": "c", "severity": "warning", "message": "<script>x</script>"}])
    assert "<script>x" not in out and "&lt;script&gt;" in out


def _rec(**over):
    rec = {
        "model": "Qwen/Qwen3-8B", "model_source": "given",
        "recommendations": {
            "kv_recompute_threshold": {"value": 523, "range": [410, 690], "unit": "tokens",
                                       "evidence": {"break_even_tokens": 522.6,
                                                    "pull_ms_at_break_even": 4.2183,
                                                    "prefill_n_observations": 41}},
            "decoder_kv_blocks_ttl": {"value": 45, "range": [30, 61], "unit": "s",
                                      "evidence": {"captured_share": 0.8531,
                                                   "retained_gb_at_ttl": 0.421998,
                                                   "gap_s_p50": 3.21987, "gap_s_p90": 8.0123,
                                                   "hbm_budget_gb": 2.0,
                                                   "router_params_ttl_s": 40, "n_gaps": 18}},
            "mode": {"value": "bidirectional", "range": ["bidirectional", "pull"], "unit": "mode",
                     "evidence": {"model": "kvtune.sim",
                                  "expected_ttft_ms": {"bidirectional": {"p50": 12.3456, "p99": 40.1},
                                                       "pull": {"p50": 15.6789, "p99": 44.0}}}}},
        "fit_quality": {"r2": 0.98765, "n_transfers": 120, "n_sizes": 5, "n_outliers": 2},
        "fit": {"floor_ms": 0.22157840746361993, "floor_ci_ms": [0.2011, 0.2432],
                "bandwidth_gbps": 12.3456, "bandwidth_ci_gbps": [11.02, 13.9]},
        "span_count": 123456, "written": {"mode": "bidirectional"}, "findings": [],
    }
    rec.update(over)
    return rec


def test_headline_cards_say_value_range_and_why_in_rounded_numbers():
    h = headline.build(_rec())
    thr, ttl, mode = h.cards
    assert (thr.value_text, thr.unit, thr.range_text) == ("520", "tokens", "range 410 – 690 tokens")
    assert thr.exact_text == "523 in the config files"  # what is applied, said once
    assert "about 520 tokens" in thr.why and "4.22 ms" in thr.why
    assert (ttl.value_text, ttl.range_text) == ("45", "range 30 – 61 s")
    assert ttl.exact_text == ""
    assert "85%" in ttl.why and "0.422 GB" in ttl.why
    assert mode.value_text == "bidirectional" and mode.range_text == "runner-up: pull"
    assert "12.3 ms" in mode.why and "15.7 ms" in mode.why
    assert h.verification.status == "not verified"
    assert any("R² 0.988" in line and "120 transfers" in line for line in h.confidence)
    page = headline.render(h)
    assert not numbers_over(re.sub(r"<[^>]+>", " ", page))
    assert 'kvtune router --config configs/router.yaml' in page
    assert "configs/prefill.vllm-serve.args" in page and "Qwen/Qwen3-8B" in page


def test_headline_reads_a_verification_when_one_is_recorded():
    h = headline.build(_rec(verification={"status": "confirmed", "ttft_p50_change_pct": -12.345,
                                          "detail": "kvtune verify, 200 requests"}))
    assert h.verification.text() == ("Verification: confirmed, TTFT p50 12.3% lower than under "
                                     "vLLM's defaults — kvtune verify, 200 requests")


def test_headline_names_the_lab_regime_it_measured():
    h = headline.build(_rec(lab={"regime": "fleet", "why": "later turns reach a prefill that "
                                                           "lacks the history"}))
    assert h.confidence[0] == ("Measured on this machine's lab in its fleet regime: later turns "
                               "reach a prefill that lacks the history.")
    assert not any("regime" in line for line in headline.build(_rec()).confidence)


def test_headline_never_threshold_and_unknown_model():
    rec = _rec(model=PLACEHOLDER, model_source="unknown: no kv.model")
    rec["recommendations"]["kv_recompute_threshold"].update(value="never", range=["never", "never"])
    h = headline.build(rec)
    assert h.cards[0].value_text == "never" and not h.model_known
    assert "Model name unknown" in headline.render(h)


def test_headline_missing_recommendation_names_the_key():
    rec = _rec()
    del rec["recommendations"]["mode"]
    with pytest.raises(Exception, match="recommendation.json.*'mode'"):
        headline.build(rec)


def test_model_name_order_given_then_spans_then_config_dir_then_placeholder(tmp_path):
    import pandas as pd

    res = {"kv.model": "Qwen/Qwen3-8B", "service.name": "kvtune-decode"}
    spans = pd.DataFrame({"resource": [res, res], "attrs": [{}, {}]})
    assert model_name("my-model", spans=spans).name == "my-model"
    assert model_name(None, spans=spans).name == "Qwen/Qwen3-8B"
    assert "kv.model" in model_name(None, spans=spans).source
    cfg = tmp_path / "m" / "config.json"
    assert model_name(None, spans=None, geometry_model=str(cfg)).name == str(cfg.parent)
    unknown = model_name(None, spans=pd.DataFrame({"resource": [{}], "attrs": [{}]}))
    assert unknown.name == PLACEHOLDER and not unknown.known and "kv.model" in unknown.source
    spaced = pd.DataFrame({"resource": [{"kv.model": "kvtune-tiny (simulated)"}], "attrs": [{}]})
    assert model_name(None, spans=spaced).name == PLACEHOLDER
    two = pd.DataFrame({"resource": [{"kv.model": "a"}, {"kv.model": "b"}], "attrs": [{}, {}]})
    assert "2 models" in model_name(None, spans=two).source


@pytest.fixture(scope="module")
def example_report(tmp_path_factory, spans_file):
    """``kvtune recommend``'s files and the report's top (no notebooks), no --model given."""
    out = tmp_path_factory.mktemp("example")
    tuning, configs = recommend_source(str(spans_file), out / "configs", model=None)
    rec = json.loads((configs / "recommendation.json").read_text())
    report = write_report(out / "report.html", out / "figures", title="kvtune tuning report",
                          source=f"{spans_file} (user)", values={},
                          notebooks=[], recommendation=rec, configs_dir=configs)
    return out, rec, report, tuning


def test_export_without_a_model_name_says_so_everywhere(example_report, spans_file):
    out, rec, _, _ = example_report
    spans = load(str(spans_file))
    assert rec["model"] == model_name(None, spans=spans).name
    if rec["model"] == PLACEHOLDER:  # these spans carry no kv.model
        assert "unknown" in rec["model_source"]
        assert "Model name unknown" in (out / "configs" / "REPORT.md").read_text()
    assert (out / "configs" / "prefill.vllm-serve.args").read_text().split("\n")[0] == rec["model"]


def test_export_writes_the_given_model_name_in_every_file(tmp_path, spans_file):
    _, configs = recommend_source(str(spans_file), tmp_path / "c", model="Qwen/Qwen3-8B")
    for f in ("prefill.vllm-serve.args", "decode.vllm-serve.args", "REPORT.md",
              "recommendation.json"):
        text = (configs / f).read_text()
        assert "Qwen/Qwen3-8B" in text and PLACEHOLDER not in text, f


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                    "(scripts/setup.sh --test installs it when run as root)")

PAGE_FACTS = """(() => {
  const rect = (sel) => { const e = document.querySelector(sel); if (!e) return null;
    const r = e.getBoundingClientRect(); return {top: r.top, bottom: r.bottom, width: r.width,
    text: e.textContent}; };
  // Every text node, joined with spaces (SVG tick labels are separate nodes), scripts left out.
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT, {acceptNode: n =>
    n.parentElement && n.parentElement.closest('script,style') ? NodeFilter.FILTER_REJECT
                                                                : NodeFilter.FILTER_ACCEPT});
  const parts = [];
  while (walker.nextNode()) parts.push(walker.currentNode.nodeValue);
  const out = {text: parts.join(' '), scrollY: window.scrollY, innerHeight: window.innerHeight,
               plots: document.querySelectorAll('.js-plotly-plot .main-svg').length, rects: {}};
  for (const n of ['kv_recompute_threshold', 'decoder_kv_blocks_ttl', 'mode']) {
    out.rects[n + ' value'] = rect('#rec-' + n + ' .value');
    out.rects[n + ' range'] = rect('#rec-' + n + ' .range');
  }
  out.rects['verification'] = rect('#verification');
  return out; })()"""


def check_report_top(page, report: Path, rec: dict, shot: Path) -> dict:
    """The issue's checks on a report in a 1400x900 page; returns the page facts."""
    page.goto(report.as_uri())
    facts = page.eval(PAGE_FACTS)
    assert facts["scrollY"] == 0 and facts["innerHeight"] == HEIGHT
    for what, r in facts["rects"].items():
        assert r is not None, f"{what}: not on the page"
        assert r["width"] > 0 and 0 <= r["top"] and r["bottom"] <= HEIGHT, \
            f"{what} is not visible without scrolling at {WIDTH}x{HEIGHT}: {r}"
    assert "not verified" in facts["rects"]["verification"]["text"]
    assert not numbers_over(facts["text"]), numbers_over(facts["text"])[:10]
    flat = " ".join(facts["text"].split())
    for f in rec["findings"]:  # whole, only long numbers rounded
        assert " ".join(readable_text(f["message"]).split()) in flat, f["code"]
    page.screenshot(shot)
    keep = ROOT / "out" / shot.name
    keep.parent.mkdir(exist_ok=True)
    shutil.copy(shot, keep)
    return facts


@needs_chromium
def test_report_top_from_kvtune_recommend_files_in_chromium_at_1400x900(example_report, tmp_path):
    from cdp import Chromium

    out, rec, report, tuning = example_report
    with Chromium(tmp_path / "profile", WIDTH, HEIGHT) as page:
        facts = check_report_top(page, report, rec, tmp_path / "report-top-recommend.png")
    assert "Model name unknown" in facts["text"]  # no --model, no kv.model: said at the top
