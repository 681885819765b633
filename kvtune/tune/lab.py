"""`kvtune lab`: kvtune's notebooks in JupyterLab, their parameters filled in, ready to run.

:func:`prepare` writes the notebooks into a workspace with a papermill ``injected-parameters``
cell (the same parameters `kvtune tune` would pass, validated the same way);
:func:`lab_command` is the JupyterLab command line serving that workspace on 127.0.0.1.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune.errors import ConfigError
from kvtune.tune import params as P
from kvtune.tune.notebooks import NOTEBOOKS_DIR, TUNE_NOTEBOOKS, notebook_path

DEFAULT_TRACES = Path("out/tune/spans")
"""Without --traces: the spans of the last `kvtune tune` run in the current directory."""
DEFAULT_LAB_DIR = Path("out/lab")
LAB_HOST = "127.0.0.1"
"""JupyterLab runs code: it listens on loopback only (reach it with an SSH tunnel)."""
FIRST_NOTEBOOK = "tune"
"""The notebook JupyterLab opens first (the whole analysis, end to end)."""


@dataclass(frozen=True)
class LabWorkspace:
    """A directory of parameterized notebooks (``notebooks`` in `kvtune tune`'s order)."""

    root: Path
    notebooks: tuple[Path, ...]
    parameters: dict[str, Any]


def prepare(traces: str | None = None, out_dir: str | os.PathLike[str] = DEFAULT_LAB_DIR, *,
            parameters: dict[str, Any] | None = None,
            notebooks: Sequence[str] = TUNE_NOTEBOOKS,
            notebooks_dir: Path = NOTEBOOKS_DIR) -> LabWorkspace:
    """Write ``notebooks`` into ``out_dir`` with their parameters filled (papermill's
    ``injected-parameters`` cell after the ``parameters`` cell). A bad parameter raises
    `ConfigError` naming it, before anything is written."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    root = Path(out_dir).resolve()
    merged = dict(parameters or {})
    if traces:
        merged["traces"] = traces
    if not merged.get("traces"):
        if not DEFAULT_TRACES.is_dir():
            raise ConfigError(f"kvtune lab: no trace source: pass --traces (a file, directory, "
                              f"glob or tempo+http:// URL), or run `kvtune tune` first so that "
                              f"{DEFAULT_TRACES} exists")
        merged["traces"] = str(DEFAULT_TRACES.resolve())
    elif "://" not in str(merged["traces"]):
        merged["traces"] = ",".join(str(Path(p).resolve()) if Path(p).exists() else p
                                    for p in str(merged["traces"]).split(","))
    if merged.get("tuning_json"):  # the kernel's working directory is the workspace
        merged["tuning_json"] = str(Path(merged["tuning_json"]).resolve())
    merged.setdefault("out_dir", str(root))
    checked = P.validate(merged)
    paths = [notebook_path(n, notebooks_dir) for n in notebooks]  # unknown names fail here
    root.mkdir(parents=True, exist_ok=True)
    written = []
    for name, src in zip(notebooks, paths):
        nb = load_notebook_node(str(src))  # papermill's reader: every cell gets its tags list
        nb = parameterize_notebook(nb, checked, kernel_name="python3", language="python")
        dest = root / f"{name}.ipynb"
        nbformat.write(nb, str(dest))
        written.append(dest)
    return LabWorkspace(root, tuple(written), checked)


def lab_command(workspace: LabWorkspace, *, port: int = 8888, token: str | None = None,
                open_browser: bool = True, first: str = FIRST_NOTEBOOK) -> list[str]:
    """The JupyterLab command serving ``workspace`` on 127.0.0.1 (this interpreter's JupyterLab,
    so the notebooks' kernel is this environment's Python). ``token``: None lets JupyterLab make
    one (it prints the URL with it)."""
    names = [p.stem for p in workspace.notebooks]
    start = first if first in names else (names[0] if names else "")
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.ip={LAB_HOST}",
           f"--ServerApp.port={int(port)}", f"--ServerApp.root_dir={workspace.root}",
           f"--ServerApp.open_browser={open_browser}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers run as root; Jupyter refuses
        cmd.append("--ServerApp.allow_root=True")
    if token is not None:  # else JupyterLab makes one and prints the URL with it
        cmd.append(f"--IdentityProvider.token={token}")
    if start:
        cmd.append(f"--LabApp.default_url=/lab/tree/{start}.ipynb")
    return cmd


def lab_env() -> dict[str, str]:
    """The environment JupyterLab runs in: this interpreter's bin first on PATH (its kernel)."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env
