"""`kvtune lab`: notebooks written with their parameters filled, and one run in JupyterLab through
its UI (headless Chromium over the DevTools protocol), figures checked drawn."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from kvtune.errors import ConfigError
from kvtune.tune import lab
from kvtune.tune.params import PARAMETERS
from _net import free_port

ROOT = Path(__file__).resolve().parents[1]
LAB_NOTEBOOK = "fabric_floor"
"""Run in the browser test: the notebook with the most figures (one per fit, phases, efficiency)."""
LAB_START_S = 120
RUN_ALL_S = 420
UI_S = 60


def injected(nb_path: Path) -> str:
    nb = nbformat.read(str(nb_path), as_version=4)
    cells = [c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, nb_path
    tags = [c.metadata.get("tags", []) for c in nb.cells]
    assert tags.index(["injected-parameters"]) == tags.index(["parameters"]) + 1
    return cells[0].source


def test_prepare_writes_every_notebook_with_its_parameters_filled(spans_file, tmp_path):
    ws = lab.prepare(str(spans_file), tmp_path / "lab", parameters={"hbm_budget_gb": 2.5,
                                                                   "model_name": "Qwen/Qwen3-8B"})
    assert [p.name for p in ws.notebooks] == [f"{n}.ipynb" for n in lab.TUNE_NOTEBOOKS]
    for path in ws.notebooks:
        src = injected(path)
        assert f'traces = "{spans_file}"' in src
        assert "hbm_budget_gb = 2.5" in src and 'model_name = "Qwen/Qwen3-8B"' in src
        assert f'out_dir = "{ws.root}"' in src
        for p in PARAMETERS:  # every parameter, defaults included
            assert f"\n{p.name} = " in "\n" + src, p.name


def test_prepare_names_a_bad_parameter_and_writes_nothing(spans_file, tmp_path):
    with pytest.raises(ConfigError, match="'tp_size': expected int"):
        lab.prepare(str(spans_file), tmp_path / "lab", parameters={"tp_size": "two"})
    assert not (tmp_path / "lab").exists()


def test_cli_without_traces_or_a_previous_tune_says_what_to_do(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvtune.cli", "lab", "--no-browser"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert "pass --traces" in proc.stderr and "kvtune tune" in proc.stderr


def test_lab_command_serves_the_workspace_on_loopback_only(spans_file, tmp_path):
    ws = lab.prepare(str(spans_file), tmp_path / "lab", notebooks=["tune", "stalls"])
    cmd = lab.lab_command(ws, port=9999, open_browser=False)
    assert cmd[:3] == [sys.executable, "-m", "jupyterlab"]
    assert "--ServerApp.ip=127.0.0.1" in cmd and f"--ServerApp.root_dir={ws.root}" in cmd
    assert "--LabApp.default_url=/lab/tree/tune.ipynb" in cmd
    assert not any(a.startswith("--IdentityProvider.token") for a in cmd)  # Jupyter makes one


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(not _has("jupyterlab"), reason="jupyterlab is not installed (the notebooks "
                                                   "extra installs it: pip install -e '.[notebooks]')")
@pytest.mark.skipif(not _has("websockets"), reason="websockets (dev extra) drives Chromium")
@pytest.mark.skipif(__import__("shutil").which("chromium") is None,
                    reason="Debian's chromium is not installed (scripts/setup.sh --test installs it "
                           "when run as root)")
def test_notebook_runs_all_cells_through_the_jupyterlab_ui_and_figures_draw(spans_file, tmp_path):
    from cdp import Chromium

    ws = lab.prepare(str(spans_file), tmp_path / "lab", notebooks=[LAB_NOTEBOOK])
    token, port = "kvtune-test-token", free_port()
    # JupyterLab's state in the test's own directories; windowing off so every output renders.
    settings = tmp_path / "lab-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    env = {**lab.lab_env(), "JUPYTER_CONFIG_DIR": str(tmp_path / "jcfg"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "jrt"), "JUPYTER_DATA_DIR": str(tmp_path / "jdata"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-ws"), "PYTHONPATH": str(ROOT)}
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(lab.lab_command(ws, port=port, token=token, open_browser=False),
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    shots = ROOT / "out"
    shots.mkdir(exist_ok=True)
    try:
        deadline = time.monotonic() + LAB_START_S
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5).read()
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "jupyterlab.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "JupyterLab did not answer on 127.0.0.1"
                time.sleep(1)
        with Chromium(tmp_path / "profile", 1400, 900) as page:
            try:
                _run_all_and_check(page, base, token, ws.notebooks[0], shots)
            except BaseException:
                page.screenshot(shots / "lab-failure.png")
                raise
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
        log.close()


CELL_STATE = """(() => {
  const cells = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')];
  const prompts = cells.map(c => (c.querySelector('.jp-InputPrompt') || {}).textContent || '');
  const errors = [...document.querySelectorAll('.jp-OutputArea-output')]
      .map(e => e.textContent).filter(t => /Traceback|Error: /.test(t));
  return {n: cells.length, prompts: prompts.map(p => p.trim()), errors: errors.slice(0, 3)};
})()"""
UI_STATE = """(() => {
  const tab = document.querySelector(
      '.lm-DockPanel .lm-TabBar-tab.jp-mod-current .lm-TabBar-tabLabel');
  const kernel = [...document.querySelectorAll('.jp-StatusBar-Item, .jp-StatusBar-TextItem')]
      .map(e => e.textContent.trim()).find(t => / \\| [A-Z][a-z]+$/.test(t));
  return {current: tab ? tab.textContent.trim() : null, kernel: kernel || null,
          dialogs: [...document.querySelectorAll('.jp-Dialog')].map(d => d.textContent),
          cells: document.querySelectorAll('.jp-Notebook .jp-CodeCell').length};
})()"""
"""What JupyterLab shows: the current tab (the one its commands act on), the status bar's kernel
item ("Python 3 (ipykernel) | Idle"; shown only for the current notebook once it has a kernel),
open dialogs, and the cells rendered."""
PLOTS = """(() => [...document.querySelectorAll('.jp-Notebook .js-plotly-plot')].map(p => ({
  svg: p.querySelectorAll('.main-svg').length, traces: p.querySelectorAll('g.trace').length,
  w: p.getBoundingClientRect().width, h: p.getBoundingClientRect().height})))()"""


def _menu(page, label: str, *items: str) -> None:
    """Open the menu bar's ``label`` menu and click its first item labelled one of ``items``
    (real clicks), once JupyterLab shows that item enabled."""
    idx = page.eval(f"[...document.querySelectorAll('.lm-MenuBar-item')].findIndex(e => "
                    f"e.textContent.trim() === {json.dumps(label)})")
    assert idx is not None and idx >= 0, f"no {label!r} menu in JupyterLab's menu bar"
    page.click(f".lm-MenuBar-item:nth-child({idx + 1})")
    find = (f"[...document.querySelectorAll('.lm-Menu-item')].findIndex(e => "
            f"{json.dumps(list(items))}.includes("
            f"(e.querySelector('.lm-Menu-itemLabel') || e).textContent.trim()) && "
            f"!e.classList.contains('lm-mod-disabled'))")
    page.wait_for(f"{find} >= 0", timeout_s=UI_S, what=f"menu item {items!r}, enabled")
    n = page.eval(find)
    page.eval(f"document.querySelectorAll('.lm-Menu-item')[{n}].setAttribute('data-kvtune-click', '1')")
    page.click('.lm-Menu-item[data-kvtune-click="1"]')
    page.eval("document.querySelectorAll('[data-kvtune-click]').forEach(e => "
              "e.removeAttribute('data-kvtune-click'))")


def _run_all_and_check(page, base: str, token: str, nb_path: Path, shots: Path) -> None:
    def done(state: dict) -> bool:
        return bool(state["n"]) and all(p[1:-2].isdigit() for p in state["prompts"])

    page.goto(f"{base}/lab/tree/{nb_path.name}?token={token}",
              ready="document.querySelectorAll('.jp-Notebook .jp-CodeCell').length > 0",
              timeout_s=LAB_START_S)
    # Run All acts on the current notebook, and runs in its kernel only once the session has one:
    # wait until JupyterLab shows both (the notebook's tab current, the status bar's kernel item
    # Idle) and no dialog is open. Body text is no sign: the notebook toolbar says "Idle" before
    # the session has a kernel.
    ui = page.wait_for(
        f"(s => s.current === {json.dumps(nb_path.name)} && / \\| Idle$/.test(s.kernel || '') && "
        f"!s.dialogs.length && s.cells > 0 ? s : JSON.stringify(s))({UI_STATE})",
        timeout_s=LAB_START_S, what="the notebook current, its kernel Idle, no dialog")
    page.screenshot(shots / "lab-ready.png")
    assert page.eval(CELL_STATE)["prompts"] == ["[ ]:"] * ui["cells"]  # nothing ran yet
    _menu(page, "Run", "Run All Cells")
    # Run All queues every cell at once: each prompt is [*] (queued or running) or a number.
    state = page.wait_for(
        f"(s => s.n && s.prompts.every(p => p !== '[ ]:') ? s : JSON.stringify(s))({CELL_STATE})",
        timeout_s=UI_S, what="Run All to queue every cell")
    deadline = time.monotonic() + RUN_ALL_S
    while not done(state) and not state["errors"] and time.monotonic() < deadline:
        time.sleep(2)
        state = page.eval(CELL_STATE)
    assert not state["errors"], state["errors"]
    assert done(state), f"cells did not all run within {RUN_ALL_S} s: {state['prompts']}"
    nb = nbformat.read(str(nb_path), as_version=4)
    assert state["n"] == sum(c.cell_type == "code" for c in nb.cells)
    assert state["prompts"] == [f"[{i}]:" for i in range(1, state["n"] + 1)]  # in order, once
    page.wait_for("[...document.querySelectorAll('.jp-Notebook .js-plotly-plot')].length >= 3 && "
                  "[...document.querySelectorAll('.jp-Notebook .js-plotly-plot')].every("
                  "p => p.querySelector('.main-svg'))", timeout_s=60, what="the figures to draw")
    plots = page.eval(PLOTS)
    assert len(plots) >= 3, plots  # one per fit group, phases, efficiency
    for i, p in enumerate(plots):
        assert p["svg"] >= 1 and p["traces"] >= 1 and p["w"] > 100 and p["h"] > 100, (i, p)
    # The findings render as HTML, whole (the old plotly table cut them off).
    assert page.eval("document.querySelectorAll('.jp-Notebook details.finding, "
                     ".jp-Notebook .no-findings').length") >= 1
    # Save through the UI: every figure the kernel produced is one that drew.
    _menu(page, "File", "Save Notebook", "Save")
    page.wait_for("!document.querySelector('.jp-mod-dirty')", timeout_s=30, what="the save")
    time.sleep(1)
    saved = nbformat.read(str(nb_path), as_version=4)
    produced = sum("application/vnd.plotly.v1+json" in (o.get("data") or {})
                   for c in saved.cells for o in c.get("outputs", []))
    assert produced == len(plots), (produced, len(plots))
    page.eval("document.querySelector('.jp-Notebook .js-plotly-plot').scrollIntoView()")
    time.sleep(1)
    page.screenshot(shots / "lab-screenshot.png")
