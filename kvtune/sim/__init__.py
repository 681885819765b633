"""What-if simulation of KV transfer modes (push, pull, bidirectional) on a deployment's traffic.

A discrete-event simulator (:func:`simulate`) of xPyD prefill/decode serving that emits the same
spans as the instrumented connectors, plus :func:`expected_ttft` for the mode recommendation.
"""
from __future__ import annotations

from kvtune.sim.config import (MODES, DecodeModel, Dist, Overheads, PrefillModel, ReuseSettings,
                               SimConfig, TransferModel, WorkloadSpec)
from kvtune.sim.result import REQUEST_COLUMNS, SimResult, TtftEstimate, simulate
from kvtune.sim.estimate import best_mode, expected_ttft  # after the result types
from kvtune.sim import presets

__all__ = [
    "MODES", "DecodeModel", "Dist", "Overheads", "PrefillModel", "REQUEST_COLUMNS", "ReuseSettings",
    "SimConfig", "SimResult", "TransferModel", "TtftEstimate", "WorkloadSpec", "best_mode",
    "expected_ttft", "presets", "simulate",
]
