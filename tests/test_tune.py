"""`kvtune tune`: every notebook through papermill on small span fixtures, outputs and errors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from kvtune.errors import ConfigError
from kvtune.nb import PLOTLY_MIME
from kvtune.tune import params as P
from kvtune.tune.notebooks import NOTEBOOKS_DIR, TUNE_NOTEBOOKS, NotebookFailed
from kvtune.tune.run import run_tune

ROOT = Path(__file__).resolve().parents[1]


def _kernels_of_this_process() -> list[int]:
    """Pids of the IPython kernels this test process started that still exist (zombies too)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"ipykernel" in cmd:
            found.append(int(d.name))
    return found


@pytest.fixture(scope="module")
def tuned(spans_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "out"
    return run_tune(str(spans_file), out, parameters={"hbm_budget_gb": 2.0}, progress=False)


def test_committed_notebooks_are_what_the_generator_writes():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_notebooks
    finally:
        sys.path.pop(0)
    for name in make_notebooks.NOTEBOOKS:
        assert (NOTEBOOKS_DIR / f"{name}.ipynb").read_text() == make_notebooks.render(name), name
    assert set(TUNE_NOTEBOOKS) <= set(make_notebooks.NOTEBOOKS)


@pytest.mark.parametrize("name", TUNE_NOTEBOOKS)
def test_each_notebook_has_one_parameters_cell_with_every_parameter(name):
    nb = nbformat.read(str(NOTEBOOKS_DIR / f"{name}.ipynb"), as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1
    for p in P.PARAMETERS:
        assert f"\n{p.name} = " in "\n" + tagged[0].source, p.name


def test_tune_runs_every_notebook_and_values_match_recommendation_json(tuned):
    assert set(tuned.notebooks) == set(TUNE_NOTEBOOKS)
    rec = json.loads(tuned.recommendation_json.read_text())
    recs = rec["recommendations"]
    meta = {}
    for name, path in tuned.notebooks.items():
        nb = nbformat.read(str(path), as_version=4)
        assert "kvtune" in nb.metadata, name
        meta[name] = nb.metadata["kvtune"]
    assert meta["tune"]["kv_recompute_threshold"] == recs["kv_recompute_threshold"]["value"]
    assert meta["tune"]["decoder_kv_blocks_ttl"] == recs["decoder_kv_blocks_ttl"]["value"]
    assert meta["tune"]["mode"] == recs["mode"]["value"]
    # The question notebooks publish the same values the tune notebook exported.
    assert meta["recompute_threshold"]["kv_recompute_threshold"] == recs["kv_recompute_threshold"]["value"]
    assert meta["block_ttl"]["decoder_kv_blocks_ttl"] == recs["decoder_kv_blocks_ttl"]["value"]
    assert meta["mode_choice"]["mode"] == recs["mode"]["value"]
    assert meta["fabric_floor"]["floor_ms"] > 0
    assert rec["trace_source_kind"] == "user"
    for f in ("prefill.kv-transfer-config.json", "decode.kv-transfer-config.json",
              "prefill.vllm-serve.args", "decode.vllm-serve.args", "router.yaml"):
        assert (tuned.out_dir / "configs" / f).exists(), f


def test_report_embeds_every_figure_and_plotly_once(tuned):
    html = tuned.report_html.read_text()
    assert "<table><tr><th>kv_recompute_threshold" not in html  # the raw values table is gone
    assert 'id="headline"' in html and 'id="findings"' in html
    n_figs = len(list((tuned.out_dir / "figures").glob("*.json")))
    assert n_figs >= 8
    assert html.count('class="figure"') == n_figs
    assert html.count("plotly.js v") <= 2  # the library is inlined once (its banner)
    assert "cdn.plot.ly" not in html.split("<body>")[1]  # readable offline


def test_each_figure_is_displayed_once_and_no_kernel_is_left(tuned):
    saved: dict[str, int] = {}
    for f in (tuned.out_dir / "figures").glob("*.json"):
        saved[f.name.split("--")[0]] = saved.get(f.name.split("--")[0], 0) + 1
    shown = {name: sum(PLOTLY_MIME in (o.get("data") or {})
                       for c in nbformat.read(str(path), as_version=4).cells
                       for o in c.get("outputs", []))
             for name, path in tuned.notebooks.items()}
    assert shown == {name: saved.get(name, 0) for name in tuned.notebooks}
    assert sum(shown.values()) >= 8
    if Path("/proc/self/stat").exists():
        assert _kernels_of_this_process() == []


def test_hbm_budget_parameter_reaches_the_notebooks(tuned):
    rec = json.loads(tuned.recommendation_json.read_text())
    assert rec["recommendations"]["decoder_kv_blocks_ttl"]["evidence"]["hbm_budget_gb"] == 2.0


@pytest.mark.parametrize("params, needle", [
    ({"traces": "nosuch://x"}, "unknown source scheme"),
    ({"traces": "/nonexistent/spans.jsonl"}, "no such file"),
    ({"tp_size": "two"}, "'tp_size': expected int"),
    ({"early_decode_ok": "maybe"}, "'early_decode_ok'"),
    ({"hbm_budget_gb": 0}, "'hbm_budget_gb': expected > 0"),
])
def test_bad_parameters_fail_before_running_with_the_parameter_named(params, needle, tmp_path):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        run_tune(None, tmp_path / "out", parameters=params, progress=False)
    assert not (tmp_path / "out" / "notebooks").exists()


def test_failed_cell_leaves_the_executed_notebook_and_names_the_cell(spans_file, tmp_path):
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    nb = nbformat.read(str(NOTEBOOKS_DIR / "fabric_floor.ipynb"), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("raise RuntimeError('boom from a cell')"))
    nbformat.write(nb, str(nbdir / "fabric_floor.ipynb"))
    shutil.copy(NOTEBOOKS_DIR / "stalls.ipynb", nbdir / "stalls.ipynb")
    with pytest.raises(NotebookFailed) as err:
        run_tune(str(spans_file), tmp_path / "out", notebooks=["fabric_floor", "stalls"],
                 notebooks_dir=nbdir, progress=False)
    if Path("/proc/self/stat").exists():  # stalls' kernel, started ahead, was stopped too
        assert _kernels_of_this_process() == []
    msg = str(err.value)
    assert "fabric_floor" in msg and "raise RuntimeError('boom from a cell')" in msg
    assert "RuntimeError: boom" in msg and str(err.value.output) in msg
    executed = nbformat.read(str(err.value.output), as_version=4)
    assert any(o.get("ename") == "RuntimeError" for c in executed.cells
               for o in c.get("outputs", []))


def test_cli_prints_one_line_naming_the_bad_parameter(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvtune.cli", "tune", "--traces",
                           str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "parameter 'traces'" in proc.stderr and "missing.jsonl" in proc.stderr


def test_cli_papermill_style_parameters_file(tmp_path, spans_file):
    (tmp_path / "p.yaml").write_text("hbm_budget_gb: 3.5\nfabric: lab\n")
    proc = subprocess.run([sys.executable, "-m", "kvtune.cli", "tune", "--traces", str(spans_file),
                           "--out", str(tmp_path / "o"), "-f", str(tmp_path / "p.yaml"),
                           "-p", "seed", "3", "--notebooks", "tune", "--model", "Qwen/Qwen3-8B"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads((tmp_path / "o" / "configs" / "recommendation.json").read_text())
    assert rec["recommendations"]["decoder_kv_blocks_ttl"]["evidence"]["hbm_budget_gb"] == 3.5
    assert "kv_recompute_threshold" in proc.stdout
    # --model is the name written everywhere: serve args, REPORT.md, recommendation.json, report.
    assert rec["model"] == "Qwen/Qwen3-8B" and "given" in rec["model_source"]
    assert (tmp_path / "o" / "configs" / "prefill.vllm-serve.args").read_text().startswith(
        "Qwen/Qwen3-8B\n")
    assert "`Qwen/Qwen3-8B`" in (tmp_path / "o" / "configs" / "REPORT.md").read_text()
    assert "<code>Qwen/Qwen3-8B</code>" in (tmp_path / "o" / "report.html").read_text()
    assert "model:           Qwen/Qwen3-8B" in proc.stdout


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                    "(scripts/setup.sh --test installs it when run as root)")
def test_report_renders_every_plotly_graph_in_headless_chromium(tuned, tmp_path):
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000"]
    url = tuned.report_html.as_uri()
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", url], capture_output=True, text=True,
                         timeout=180).stdout
    n_figs = len(list((tuned.out_dir / "figures").glob("*.json")))
    # Each plotly graph that drew has a js-plotly-plot div with an svg.main-svg inside.
    assert dom.count("js-plotly-plot") >= n_figs, dom[:500]
    assert dom.count('class="main-svg"') >= n_figs
    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, *flags, "--window-size=1300,5000", f"--screenshot={shot}", url],
                   capture_output=True, timeout=180)
    assert shot.exists() and shot.stat().st_size > 20_000
    keep = ROOT / "out" / "report-screenshot.png"
    keep.parent.mkdir(exist_ok=True)
    shutil.copy(shot, keep)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                    "(scripts/setup.sh --test installs it when run as root)")
def test_report_top_shows_values_ranges_and_verification_at_1400x900(tuned, tmp_path):
    """The issue's screenshot test on the page `kvtune tune` wrote (papermill path): the three
    values, their ranges and the verification line without scrolling, no number over 4
    significant digits, every finding's full text in the DOM; the figures drew too."""
    from cdp import Chromium
    from test_report import HEIGHT, WIDTH, check_report_top

    rec = json.loads(tuned.recommendation_json.read_text())
    assert rec["verification"] is None  # the field a verification run fills
    with Chromium(tmp_path / "profile", WIDTH, HEIGHT) as page:
        facts = check_report_top(page, tuned.report_html, rec, tmp_path / "report-top.png")
        n_figs = len(list((tuned.out_dir / "figures").glob("*.json")))
        page.wait_for("[...document.querySelectorAll('.js-plotly-plot')].filter(e => "
                      f"e.querySelector('.main-svg')).length >= {n_figs}", timeout_s=60,
                      what=f"{n_figs} plotly figures drawn")
    assert facts["rects"]["verification"]["text"].startswith("Verification: not verified")


@pytest.mark.nixl
def test_default_source_without_vllm_is_probe_plus_sim_and_says_so(tmp_path):
    """No --traces and no vLLM: real probe spans plus the simulator, and the report says which."""
    result = run_tune(None, tmp_path / "out", default_source={"use_vllm": False},
                      notebooks=["fabric_floor", "tune"], progress=False)
    assert result.source_kind == "probe+sim"
    rec = json.loads(result.recommendation_json.read_text())
    assert rec["trace_source_kind"] == "probe+sim"
    assert (tmp_path / "out" / "spans" / "probe").is_dir()
    assert list((tmp_path / "out" / "spans" / "sim").glob("*.jsonl"))
    assert "probe+sim" in result.report_html.read_text()
