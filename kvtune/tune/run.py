"""`kvtune tune`: run the tuning notebooks on a trace source and collect what they produced."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune import nb
from kvtune.errors import KvtuneError
from kvtune.recommend.saved import INPUT_NAMES, tuning_inputs, write_tuning
from kvtune.tune import params as P
from kvtune.tune.headline import LAB_KEY, VERIFY_KEY
from kvtune.tune.notebooks import (NOTEBOOKS_DIR, TUNE_NOTEBOOKS, NotebookKernels, draws_tuning,
                                   notebook_path, run_notebook)
from kvtune.tune.report import write_report

log = logging.getLogger(__name__)

TUNING_FILE = "tuning.json"
"""Under the output directory: the tuning computed once, which every notebook draws."""


@dataclass(frozen=True)
class TuneResult:
    out_dir: Path
    report_html: Path
    recommendation_json: Path
    notebooks: dict[str, Path]
    source: str
    source_kind: str
    values: dict[str, Any]
    elapsed_s: float


def run_tune(traces: str | None = None, out_dir: str | Path = "out/tune", *,
             parameters: dict[str, Any] | None = None,
             notebooks: Sequence[str] = TUNE_NOTEBOOKS, notebooks_dir: Path = NOTEBOOKS_DIR,
             default_source: dict[str, Any] | None = None, progress: bool = True,
             share_tuning: bool = True, kernels_ahead: bool = True) -> TuneResult:
    """Run the tuning end to end.

    Without ``traces`` kvtune makes its own spans on this machine first (see `kvtune.tune.sources`).
    The tuning (``recommend()``: the simulator and the bootstrap intervals) is computed once, saved
    as ``tuning.json`` and handed to the notebooks, which draw it; ``share_tuning=False`` lets
    each notebook compute it itself (the old way, kept for ``bench/notebook_stage.py``).
    Each notebook's kernel is started one notebook ahead (`NotebookKernels`);
    ``kernels_ahead=False`` lets papermill start each when its notebook's turn comes (the old way).
    A bad parameter raises `ConfigError` before anything runs; a failing cell raises `NotebookFailed`
    naming the notebook and cell, with the executed notebook left behind."""
    from tqdm import tqdm

    t0 = time.monotonic()
    out = Path(out_dir).resolve()
    merged = dict(parameters or {})
    if traces:
        merged["traces"] = traces
    merged["out_dir"] = str(out)
    checked = P.validate(merged)
    source_kind = "user"
    lab: dict[str, str] | None = None
    if not checked["traces"]:
        from kvtune.tune.sources import make_default_spans
        made = make_default_spans(out / "spans", seed=checked["seed"], **(default_source or {}))
        checked["traces"] = str(made.spans_dir)
        source_kind = made.kind
        source_desc = made.description
        if made.fabric and checked["fabric"] == "local":
            checked["fabric"] = made.fabric
        if made.model and not checked["model_name"]:
            checked["model_name"] = made.model
        if made.regime:
            from kvtune.local.regime import regime as lab_regime
            lab = {"regime": made.regime, "why": lab_regime(made.regime).why}
    else:
        source_desc = checked["traces"]
    figures = out / "figures"
    runs = {}
    values: dict[str, Any] = {}
    # Each notebook's kernel starts one notebook ahead (the first while the tuning is computed).
    with NotebookKernels(figures_dir=figures) as kernels:
        if notebooks and kernels_ahead:
            kernels.start(notebooks[0])
        if share_tuning and not checked["tuning_json"]:
            checked["tuning_json"] = _shared_tuning(checked, out / TUNING_FILE, notebooks,
                                                    notebooks_dir)
        bar = tqdm(notebooks, desc="kvtune tune", unit="notebook", disable=not progress)
        for i, name in enumerate(bar):
            bar.set_postfix_str(name)
            if kernels_ahead and i + 1 < len(notebooks):
                kernels.start(notebooks[i + 1])
            run = run_notebook(name, out / "notebooks", checked, notebooks_dir=notebooks_dir,
                               figures_dir=figures, kernels=kernels if kernels_ahead else None)
            runs[name] = run.output
            values.update(run.values)
    rec = out / "configs" / "recommendation.json"
    data = None
    if rec.exists() and "tune" in notebooks:  # else it is an earlier run's: not this report's
        data = json.loads(rec.read_text())
        data["trace_source_kind"] = source_kind
        data["report_source"] = f"{source_desc} ({source_kind})"  # the report's source line
        if lab is not None:  # which lab regime the spans were made in, and why (the report's)
            data[LAB_KEY] = lab
        # A ``kvtune verify --tune-dir`` result of these very values (in out/verify/) is shown;
        # one of other values (an earlier run's) is not.
        from kvtune.verify.tune_link import FIGURE_PREFIX, verification_for_tune_dir
        data[VERIFY_KEY] = verification_for_tune_dir(out, data)
        rec.write_text(json.dumps(data, indent=2))
    report_notebooks = list(notebooks)
    if data is not None and data.get(VERIFY_KEY):
        report_notebooks.append(FIGURE_PREFIX)
    report = write_report(out / "report.html", figures, title="kvtune tuning report",
                          source=f"{source_desc} ({source_kind})", values=values,
                          notebooks=report_notebooks, recommendation=data,
                          configs_dir=rec.parent)
    return TuneResult(out, report, rec, runs, source_desc, source_kind, values,
                      time.monotonic() - t0)


def _shared_tuning(params: dict[str, Any], path: Path, notebooks: Sequence[str],
                   notebooks_dir: Path) -> str:
    """Compute the tuning once and save it at ``path`` for the notebooks; returns the path, or ""
    when no notebook draws one, or when it cannot be computed: then the first notebook that needs
    it computes it itself and fails there, naming its cell."""
    if not any(draws_tuning(notebook_path(n, notebooks_dir)) for n in notebooks):
        return ""
    inputs = tuning_inputs(**{n: params[n] for n in INPUT_NAMES})
    try:
        spans = nb.load_spans(params["traces"])
        tuning = nb.tuning(spans, "", **{n: params[n] for n in INPUT_NAMES})
    except KvtuneError as exc:
        log.warning("the tuning could not be computed once for all notebooks (%s); each notebook "
                    "computes it", exc)
        path.unlink(missing_ok=True)  # an earlier run's would be read by no one: remove it
        return ""
    return str(write_tuning(tuning, path, inputs))
