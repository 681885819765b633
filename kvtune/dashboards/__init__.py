"""Grafana dashboards for kvtune's spans in Tempo: generator, TraceQL parser and evaluator."""
from __future__ import annotations

from kvtune.dashboards.evaluate import evaluate
from kvtune.dashboards.export import export_dashboards
from kvtune.dashboards.generator import dashboards, kv_transfer_dashboard, render
from kvtune.dashboards.traceql import TraceQLSyntaxError, parse

__all__ = ["TraceQLSyntaxError", "dashboards", "evaluate", "export_dashboards", "kv_transfer_dashboard",
           "parse", "render"]
