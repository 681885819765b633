"""The fabric probe: real NIXL transfers of KV-shaped data between an initiator and a target, in
two processes, with spans in the kvtune convention and a floor/bandwidth fit of the results."""
from __future__ import annotations

from kvtune.probe.results import OpFit, PointStats, ProbeSummary
from kvtune.probe.sweep import ProbeConfig, compare_fabrics, default_tokens, run_probe

__all__ = ["OpFit", "PointStats", "ProbeConfig", "ProbeSummary", "compare_fabrics", "default_tokens",
           "run_probe"]
