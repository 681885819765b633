"""What a user would see, without Grafana: every panel query of kvtune's dashboards run over spans.

``check_panels(spans_df)`` evaluates each panel's TraceQL (with the variables' default values)
with :func:`kvtune.dashboards.evaluate.evaluate` and reports how many rows it returns, so a user
can tell whether their spans light up the dashboards before starting Tempo and Grafana.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from kvtune.dashboards.evaluate import evaluate
from kvtune.dashboards.generator import ALL_VALUES, DEFAULT_VARIABLE_VALUES, INSTANT_PHASES, dashboards
from kvtune.dashboards.templating import interpolate
from kvtune.dashboards.traceql import parse


INSTANT_PHASE_NAMES = frozenset(p.value for p in INSTANT_PHASES)


@dataclass(frozen=True)
class PanelCheck:
    """One panel query's result on the given spans."""

    dashboard: str
    title: str
    query: str
    """The query as sent to Tempo (variables interpolated)."""
    rows: int
    phase: str | None
    """The transfer phase a per-phase panel shows (None for other panels)."""


@dataclass(frozen=True)
class DashboardCheck:
    panels: tuple[PanelCheck, ...]
    span_count: int

    @property
    def empty_phases(self) -> tuple[str, ...]:
        """Phases whose panel shows nothing on these spans."""
        return tuple(p.phase for p in self.panels if p.phase is not None and p.rows == 0)

    def table(self) -> str:
        """A plain-text table: rows per panel."""
        width = max((len(p.title) for p in self.panels), default=5)
        lines = [f"{'panel':<{width}}  rows", f"{'-' * width}  ----"]
        lines += [f"{p.title:<{width}}  {p.rows}" for p in self.panels]
        return "\n".join(lines)


def check_panels(spans: pd.DataFrame, *, variables: Mapping[str, str | Sequence[str]] | None = None,
                 boards: Mapping[str, dict[str, Any]] | None = None) -> DashboardCheck:
    """Run every TraceQL panel query of ``boards`` (default: kvtune's dashboards) over ``spans``.

    ``variables`` overrides the variables' default values (e.g. ``{"mode": ["push"]}``). The trace
    panel (a bare ``${traceID}``) is skipped: it shows one trace by id, not a query result.
    """
    values = {**DEFAULT_VARIABLE_VALUES, **(variables or {})}
    boards = dashboards() if boards is None else boards
    out: list[PanelCheck] = []
    for name, board in boards.items():
        for panel in board.get("panels", []):
            if panel.get("type") in ("row", "traces"):
                continue
            for target in panel.get("targets", []):
                query = parse(interpolate(target["query"], values, all_values=ALL_VALUES))
                names = query.span_names()
                metrics = query.metrics
                phase = (next(iter(names)) if metrics is not None and len(names) == 1
                         and (metrics.function == "quantile_over_time"
                              or (metrics.function == "count_over_time"
                                  and names <= INSTANT_PHASE_NAMES)) else None)
                rows = len(evaluate(query, spans))
                title = interpolate(panel["title"], values, all_values=ALL_VALUES)
                out.append(PanelCheck(name, title, query.text, rows, phase))
    return DashboardCheck(tuple(out), len(spans))


def check_source(source: str | Sequence[str], *, mode: Sequence[str] | None = None) -> DashboardCheck:
    """:func:`check_panels` on spans loaded by ``kvtune.traces.load(source)``."""
    from kvtune import traces
    variables = {"mode": list(mode)} if mode else None
    return check_panels(traces.load(source), variables=variables)
