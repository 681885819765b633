"""Grafana dashboards for kvtune's spans in Tempo: generator, TraceQL parser and evaluator."""
from __future__ import annotations

from kvtune.dashboards.check import DashboardCheck, PanelCheck, check_panels
from kvtune.dashboards.evaluate import evaluate
from kvtune.dashboards.export import export_dashboards
from kvtune.dashboards.generator import dashboards, kv_transfer_dashboard, render
from kvtune.dashboards.traceql import TraceQLSyntaxError, parse

__all__ = ["DashboardCheck", "PanelCheck", "TraceQLSyntaxError", "check_panels", "dashboards",
           "evaluate", "export_dashboards", "kv_transfer_dashboard", "parse", "render"]
