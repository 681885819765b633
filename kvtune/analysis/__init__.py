"""From spans to numbers: the per-transfer phase table, the floor/bandwidth fit, prefill cost and
the workload's shape. Pure functions in, new DataFrames or frozen results out."""
from __future__ import annotations

from kvtune.analysis.fit import FloorFit, fit_floor, fit_floor_points
from kvtune.analysis.prefill import PrefillCost, prefill_cost
from kvtune.analysis.summary import AnalysisSummary, summarize
from kvtune.analysis.transfers import TRANSFER_COLUMNS, empty_transfers, transfers
from kvtune.analysis.workload import TracedRequest, Workload, workload

__all__ = ["AnalysisSummary", "FloorFit", "PrefillCost", "TRANSFER_COLUMNS", "TracedRequest", "Workload",
           "empty_transfers", "fit_floor", "fit_floor_points", "prefill_cost", "summarize",
           "transfers", "workload"]
