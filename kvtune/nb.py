"""Helpers that notebooks call: show a figure (and keep it for the report), publish a value, get
the tuning to draw (computed once by `kvtune tune`, or here).

Notebooks hold parameters, calls and plots only; these helpers are the glue, nothing to test there.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

KVTUNE_MIME = "application/vnd.kvtune.value+json"
"""Mime type of the display outputs that carry published values; `kvtune tune` lifts them into the
executed notebook's metadata (``metadata.kvtune``)."""

FIGURES_DIR_ENV = "KVTUNE_FIGURES_DIR"
"""Where `show` saves each figure's JSON for the HTML report (set by `kvtune tune`)."""


PLOTLY_MIME = "application/vnd.plotly.v1+json"
"""The mime type of a plotly figure in a notebook (JupyterLab and nbconvert draw it)."""


def show(fig: Any, name: str, *, notebook: str | None = None) -> None:
    """Display a plotly figure in the notebook, once, and save it for the report (when run by
    `kvtune tune`).

    The figure is displayed as plotly's ``plotly_mimetype`` renderer (its choice in a Jupyter
    kernel) would: the figure's JSON under :data:`PLOTLY_MIME`. Nothing is returned, so a cell
    that ends in ``nb.show(...)`` does not display the figure a second time as its result; that
    second display went through ``plotly.io``'s renderers, whose import (nbformat, jsonschema and
    its URI grammars) took 2-4 s in every notebook kernel (profiled for
    ``bench/notebook_stage.py``)."""
    text = fig.to_json()
    out = os.environ.get(FIGURES_DIR_ENV)
    if out:
        prefix = notebook or os.environ.get("KVTUNE_NOTEBOOK", "figure")
        path = Path(out) / f"{prefix}--{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    try:
        from IPython.display import display
        display({PLOTLY_MIME: json.loads(text)}, raw=True)
    except ImportError:  # outside IPython: nothing to display
        pass


def publish(name: str, value: Any) -> None:
    """Record a value in the notebook's outputs (and so its metadata after `kvtune tune`)."""
    payload = {name: _jsonable(value)}
    try:
        from IPython.display import display
        display({KVTUNE_MIME: payload, "text/plain": f"{name} = {payload[name]!r}"}, raw=True)
    except ImportError:
        print(json.dumps(payload))


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda o: getattr(o, "__dict__", str(o))))


def published_values(nb_json: dict) -> dict[str, Any]:
    """Collect every value published with `publish` from an executed notebook (nbformat dict)."""
    values: dict[str, Any] = {}
    for cell in nb_json.get("cells", []):
        for output in cell.get("outputs", []) or []:
            data = output.get("data") or {}
            if KVTUNE_MIME in data:
                values.update(data[KVTUNE_MIME])
    return values


def load_spans(source: str, **kwargs: Any):
    """Load spans for a notebook; ``source`` may be several comma-separated sources. A large
    source (or one read under `kvtune tune --max-spans`) is reduced to a sample in bounded memory
    (``kvtune.analysis.reduced.read``): the notebooks draw the reduced frame."""
    from kvtune.analysis.reduced import read
    parts = [s for s in str(source).split(",") if s] if "://" not in str(source) else [source]
    if not parts:
        from kvtune.errors import ConfigError
        raise ConfigError("parameter 'traces': empty; give a file, directory, glob or Tempo URL")
    return read(parts if len(parts) > 1 else parts[0], **kwargs)


def geometry(model: str, tp_size: int = 1):
    """A `KvGeometry` from a preset name or a local HF ``config.json`` path; None when ``model`` is ''."""
    if not model:
        return None
    from kvtune import geometry as g
    if model.endswith(".json") or os.path.sep in model:
        return g.from_hf_config(model, tp_size)
    return g.preset(model, tp_size)


def tuning(spans: Any, tuning_json: str = "", *, traces: str, model: str = "", tp_size: int = 1,
           hbm_budget_gb: float, early_decode_ok: bool = True, seed: int = 0) -> Any:
    """The `Tuning` a notebook draws: the one `kvtune tune` computed once and saved at
    ``tuning_json`` (checked against these parameters), else computed here from ``spans`` (a
    notebook run on its own: `kvtune lab`, papermill, a user's spans)."""
    from kvtune.recommend.saved import read_tuning, tuning_inputs
    inputs = tuning_inputs(traces=traces, model=model, tp_size=tp_size,
                           hbm_budget_gb=hbm_budget_gb, early_decode_ok=early_decode_ok, seed=seed)
    if tuning_json:
        return read_tuning(tuning_json, expect=inputs)
    from kvtune.recommend import Tuning, recommend
    computed = recommend(spans, geometry=geometry(model, tp_size), hbm_budget_gb=hbm_budget_gb,
                         early_decode_ok=early_decode_ok, seed=seed)
    # The plain (JSON) form either way, so a notebook draws the same whether it read the file.
    return Tuning.from_dict(computed.as_dict())
