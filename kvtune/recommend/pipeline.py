"""``kvtune recommend SOURCE --out DIR``: load a trace, recommend, export the files."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvtune.recommend.results import Tuning
from kvtune.recommend.tuning import DEFAULT_HBM_BUDGET_GB, recommend


def recommend_source(source: str | list[str], out_dir: str | os.PathLike[str], *,
                     model: str | None = None, geometry: Any = None,
                     hbm_budget_gb: float = DEFAULT_HBM_BUDGET_GB, early_decode_ok: bool = True,
                     fabric: str | None = None, prefill_instances: int = 1,
                     skip_bad: bool = False, overwrite: bool = False,
                     export_options: dict[str, Any] | None = None) -> tuple[Tuning, Path]:
    """Load ``source`` (``kvtune.traces.load``), :func:`recommend`, and write the files
    (``kvtune.export.write``) into ``out_dir``; returns the tuning and the directory.
    ``model``: the name for ``vllm serve``; None: the spans' ``kv.model`` (else a placeholder)."""
    from kvtune.export import write
    from kvtune.export.model import resolve
    from kvtune.traces import load

    spans = load(source, skip_bad=skip_bad)
    tuning = recommend(spans, geometry=geometry, hbm_budget_gb=hbm_budget_gb,
                       early_decode_ok=early_decode_ok, fabric=fabric,
                       prefill_instances=prefill_instances)
    out = write(tuning, out_dir, geometry=geometry, model=resolve(model, spans=spans),
                overwrite=overwrite,
                **(export_options or {}))
    return tuning, out
