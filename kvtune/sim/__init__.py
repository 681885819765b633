"""What-if simulation of KV transfer modes (push, pull, bidirectional) on a deployment's traffic.

A discrete-event simulator (:func:`simulate`) of xPyD prefill/decode serving that emits the same
spans as the instrumented connectors, plus :func:`expected_ttft` for the mode recommendation.
Modules, each importing only those before it: ``config`` (inputs) -> ``presets`` ->
``calibrate`` (fits into a preset, with sources) ; ``timeline`` (what happened) ; ``workload``
(traffic) -> ``engine`` -> ``otlp`` (spans) -> ``result`` (``simulate``) -> ``estimate``
(``expected_ttft``) -> ``outdir`` -> ``cli``; ``retention`` (fixed TTL vs renewable lease over
conversations, pure) stands apart.
"""
from __future__ import annotations

from kvtune.sim import presets
from kvtune.sim.calibrate import SimInput, from_fit, sim_inputs
from kvtune.sim.config import (DecodeModel, Dist, Overheads, PrefillModel, ReuseSettings,
                               SimConfig, TransferModel, WorkloadSpec)
from kvtune.sim.estimate import Calibrated, best_mode, calibrate, expected_ttft, ttft_per_mode
from kvtune.sim.result import REQUEST_COLUMNS, SimResult, TtftEstimate, simulate
from kvtune.sim.timeline import RequestTimeline, Retention, Timeline
from kvtune.sim.workload import Arrival, Traffic

__all__ = [
    "Arrival", "Calibrated", "DecodeModel", "Dist", "Overheads", "PrefillModel",
    "REQUEST_COLUMNS", "RequestTimeline", "Retention", "ReuseSettings", "SimConfig", "SimInput",
    "SimResult", "Timeline", "Traffic", "TransferModel", "TtftEstimate", "WorkloadSpec",
    "best_mode", "calibrate", "expected_ttft", "from_fit", "presets", "sim_inputs", "simulate",
    "ttft_per_mode",
]
