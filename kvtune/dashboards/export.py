"""Writing kvtune's dashboards to a directory, for users who import them into Grafana by hand."""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Final

from kvtune.dashboards.generator import DS_VARIABLE, dashboards, render
from kvtune.errors import ConfigError

UID_RE: Final = re.compile(r"^[A-Za-z0-9._-]{1,40}$")
"""Grafana datasource uids: up to 40 letters, digits, '.', '_' or '-'."""


def with_datasource(dashboard: dict[str, Any], datasource_uid: str) -> dict[str, Any]:
    """A copy of ``dashboard`` whose ``${DS_TEMPO}`` variable starts on ``datasource_uid``.

    Panels keep referring to the variable, so the datasource can still be switched in Grafana.
    """
    if not UID_RE.match(datasource_uid):
        raise ConfigError(f"--datasource-uid: expected 1-40 letters, digits, '.', '_' or '-', "
                          f"got {datasource_uid!r}")
    out = copy.deepcopy(dashboard)
    for var in out.get("templating", {}).get("list", []):
        if var.get("name") == DS_VARIABLE:
            var["current"] = {"selected": True, "text": datasource_uid, "value": datasource_uid}
            break
    else:
        raise ConfigError(f"dashboard {dashboard.get('uid')!r}: no ${DS_VARIABLE} variable to set")
    return out


def export_dashboards(out_dir: str | Path, *, datasource_uid: str | None = None) -> list[Path]:
    """Write every dashboard as ``<out_dir>/<file>.json``; return the paths written.

    With ``datasource_uid`` the ``${DS_TEMPO}`` variable's initial value is that datasource;
    without it Grafana picks the default Tempo datasource.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: expected a directory, found a file")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, dashboard in dashboards().items():
        if datasource_uid is not None:
            dashboard = with_datasource(dashboard, datasource_uid)
        path = out / name
        path.write_text(render(dashboard), encoding="utf-8")
        written.append(path)
    return written
