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


KERNEL_NAME = "python3"
"""The kernel every notebook runs on: this interpreter's (the venv's) IPython kernel."""
KERNEL_ARGS: tuple[str, ...] = ("--HistoryManager.hist_file=:memory:",)
"""No IPython history file (what nbclient passes to the kernels it starts itself)."""
PRESTARTED_ENGINE = "kvtune-prestarted"
"""The papermill engine that runs a notebook on a kernel started ahead of it (`NotebookKernels`)."""


def _kernel_env(name: str, figures_dir: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env["KVTUNE_NOTEBOOK"] = name
    if figures_dir is not None:
        env[FIGURES_DIR_ENV] = str(figures_dir)
    # The kernel must be this interpreter (the venv's), whatever PATH the caller had.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


class NotebookKernels:
    """Starts each notebook's kernel ahead of its turn, so that it boots while the notebook
    before it runs (0.5-0.7 s a kernel on a 2-core machine, measured for
    ``bench/notebook_stage.py``), and stops each one at once when its notebook is done.

    Use as a context manager: kernels started but never used are stopped on exit."""

    def __init__(self, *, figures_dir: Path | None = None, cwd: Path | None = None) -> None:
        self.figures_dir, self.cwd = figures_dir, cwd or Path.cwd()
        self._ahead: dict[str, Any] = {}

    def __enter__(self) -> NotebookKernels:
        return self

    def __exit__(self, *exc: object) -> None:
        while self._ahead:
            _stop_kernel(self._ahead.popitem()[1])

    def start(self, name: str) -> None:
        """Start the kernel of notebook ``name`` now (once); `take` hands it over later."""
        if name in self._ahead:
            return
        from jupyter_client.manager import AsyncKernelManager
        from jupyter_core.utils import run_sync
        km = AsyncKernelManager(kernel_name=KERNEL_NAME)
        run_sync(km.start_kernel)(extra_arguments=list(KERNEL_ARGS), cwd=str(self.cwd),
                                  env=_kernel_env(name, self.figures_dir))
        self._ahead[name] = km

    def take(self, name: str) -> Any:
        """The kernel manager of notebook ``name``'s kernel (started now if it was not)."""
        self.start(name)
        return self._ahead.pop(name)


def _stop_kernel(km: Any) -> None:
    from jupyter_core.utils import run_sync
    try:
        if run_sync(km.is_alive)():
            run_sync(km.shutdown_kernel)(now=True)
    finally:
        run_sync(km.cleanup_resources)()


def _register_prestarted_engine() -> None:
    import papermill.engines as engines
    from papermill.clientwrap import PapermillNotebookClient

    if PRESTARTED_ENGINE in engines.papermill_engines._engines:
        return

    class PrestartedKernelEngine(engines.NBClientEngine):
        """papermill's nbclient engine on a kernel started beforehand (``km``), which it stops at
        once when the last cell is done (the notebook is complete; nothing waits on the kernel)."""

        @classmethod
        def execute_managed_notebook(cls, nb_man: Any, kernel_name: str, log_output: bool = False,
                                     stdout_file: Any = None, stderr_file: Any = None,
                                     start_timeout: int = 60, execution_timeout: Any = None,
                                     km: Any = None, **kwargs: Any) -> Any:
            client = PapermillNotebookClient(
                nb_man, km=km, timeout=execution_timeout, startup_timeout=start_timeout,
                kernel_name=kernel_name, log=engines.logger, log_output=log_output,
                stdout_file=stdout_file, stderr_file=stderr_file, shutdown_kernel="immediate")
            return client.execute(cleanup_kc=True)

    engines.papermill_engines.register(PRESTARTED_ENGINE, PrestartedKernelEngine)


def run_notebook(name: str, out_dir: Path, parameters: dict[str, Any], *,
                 notebooks_dir: Path = NOTEBOOKS_DIR, figures_dir: Path | None = None,
                 timeout_s: int = 1800, kernels: NotebookKernels | None = None) -> NotebookRun:
    """Execute one notebook with papermill into ``out_dir/<name>.ipynb``.

    ``kernels``: where the notebook's kernel may have been started ahead (see `NotebookKernels`;
    its ``figures_dir`` is the one that counts then); else papermill starts one.
    Published values (`kvtune.nb.publish`) go into the executed notebook's ``metadata.kvtune``.
    A failing cell raises `NotebookFailed` after papermill wrote the notebook with the error."""
    import logging

    import nbformat
    import papermill
    logging.getLogger("papermill").setLevel(logging.WARNING)
    from papermill.exceptions import PapermillExecutionError

    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / f"{name}.ipynb"
    source = str(notebook_path(name, notebooks_dir))
    env_backup = {k: os.environ.get(k) for k in (FIGURES_DIR_ENV, "KVTUNE_NOTEBOOK", "PATH")}
    engine: dict[str, Any] = {}
    if kernels is not None:
        _register_prestarted_engine()
        engine = {"engine_name": PRESTARTED_ENGINE, "km": kernels.take(name)}
    else:
        os.environ.update(_kernel_env(name, figures_dir))
    try:
        papermill.execute_notebook(source, str(output), parameters=parameters, progress_bar=False,
                                   kernel_name=KERNEL_NAME, cwd=str(Path.cwd()),
                                   execution_timeout=timeout_s, **engine)
    except PapermillExecutionError as exc:
        raise NotebookFailed(name, exc.cell_index, exc.exec_count, exc.ename, exc.evalue,
                             output, exc.source or "") from None
    finally:
        if "km" in engine:
            _stop_kernel(engine["km"])  # stopped already unless the notebook could not start
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
