"""Run kvtune's notebooks with papermill and lift their published values into metadata."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune.errors import KvtuneError
from kvtune.nb import FIGURES_DIR_ENV, published_values
from kvtune.notebooks import NOTEBOOKS_DIR  # the notebooks shipped in the package

TUNE_NOTEBOOKS: tuple[str, ...] = ("fabric_floor", "recompute_threshold", "block_ttl",
                                   "mode_choice", "stalls", "tune")
"""The notebooks `kvtune tune` runs, in order; `tune` exports the configs."""
TUNING_CALL = "nb.tuning("
"""How a notebook asks for the tuning (`kvtune.nb.tuning`)."""


class NotebookFailed(KvtuneError):
    """A notebook cell raised; the executed notebook with the error was written to ``output``."""

    def __init__(self, notebook: str, cell_index: int, exec_count: Any, ename: str, evalue: str,
                 output: Path, source: str = "") -> None:
        self.notebook, self.cell_index, self.output = notebook, cell_index, output
        first = next((ln for ln in source.splitlines() if ln.strip()), "")[:80]
        super().__init__(f"notebook {notebook!r} failed in cell {cell_index} (execution count "
                         f"{exec_count}: {first!r}): {ename}: {evalue}; the executed notebook with "
                         f"the error is {output}")


@dataclass(frozen=True)
class NotebookRun:
    name: str
    output: Path
    values: dict[str, Any]


def notebook_path(name: str, notebooks_dir: Path = NOTEBOOKS_DIR) -> Path:
    path = notebooks_dir / f"{name}.ipynb"
    if not path.exists():
        raise KvtuneError(f"no notebook {name!r} at {path}")
    return path


def draws_tuning(path: Path) -> bool:
    """Whether the notebook at ``path`` draws a tuning (calls `kvtune.nb.tuning`), so that
    `kvtune tune` computes one for it."""
    import nbformat
    nb = nbformat.read(str(path), as_version=4)
    return any(c.cell_type == "code" and TUNING_CALL in c.source for c in nb.cells)


def run_notebook(name: str, out_dir: Path, parameters: dict[str, Any], *,
                 notebooks_dir: Path = NOTEBOOKS_DIR, figures_dir: Path | None = None,
                 timeout_s: int = 1800) -> NotebookRun:
    """Execute one notebook with papermill into ``out_dir/<name>.ipynb``.

    Published values (`kvtune.nb.publish`) go into the executed notebook's ``metadata.kvtune``.
    A failing cell raises `NotebookFailed` after papermill wrote the notebook with the error."""
    import logging

    import nbformat
    import papermill
    logging.getLogger("papermill").setLevel(logging.WARNING)
    from papermill.exceptions import PapermillExecutionError

    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / f"{name}.ipynb"
    env_backup = {k: os.environ.get(k) for k in (FIGURES_DIR_ENV, "KVTUNE_NOTEBOOK", "PATH")}
    os.environ["KVTUNE_NOTEBOOK"] = name
    if figures_dir is not None:
        os.environ[FIGURES_DIR_ENV] = str(figures_dir)
    # The kernel must be this interpreter (the venv's), whatever PATH the caller had.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    try:
        papermill.execute_notebook(str(notebook_path(name, notebooks_dir)), str(output),
                                   parameters=parameters, progress_bar=False, kernel_name="python3",
                                   cwd=str(Path.cwd()), execution_timeout=timeout_s)
    except PapermillExecutionError as exc:
        raise NotebookFailed(name, exc.cell_index, exc.exec_count, exc.ename, exc.evalue,
                             output, exc.source or "") from None
    finally:
        for k, v in env_backup.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    nb = nbformat.read(str(output), as_version=4)
    values = published_values(nb)
    nb.metadata["kvtune"] = values
    nbformat.write(nb, str(output))
    return NotebookRun(name, output, values)
