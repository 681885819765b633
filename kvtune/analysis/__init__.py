"""From spans to numbers: the per-transfer phase table, the floor/bandwidth fit, prefill cost and
the workload's shape. Pure functions in, new DataFrames or frozen results out."""
from __future__ import annotations

from kvtune.analysis.fit import FloorFit, fit_floor_points

__all__ = ["FloorFit", "fit_floor_points"]
