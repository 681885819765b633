"""``expected_ttft``: the what-if the mode recommendation asks — the same traffic played through
push, pull and bidirectional on a deployment calibrated with the user's own fits."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pandas as pd

from kvtune.errors import SimError
from kvtune.sim.config import MODES, SimConfig, WorkloadSpec
from kvtune.sim.result import TtftEstimate, simulate
from kvtune.sim.workload import requests_frame, spec_from_workload

DEFAULT_MAX_REQUESTS = 1200
"""Requests simulated per mode by default: enough for a stable p50 and a rough p99 while the
three modes together stay well under two seconds."""
MIN_DURATION_S = 20.0


def expected_ttft(workload_or_config: Any, floor_fit: Any = None, prefill_cost: Any = None, *,
                  modes: tuple[str, ...] | list[str] = MODES, base: SimConfig | None = None,
                  max_requests: int = DEFAULT_MAX_REQUESTS, seed: int = 0,
                  prefix_caching: bool | None = None, ttl_s: float | None = None,
                  threshold_tokens: int | None = None, bytes_per_token: float | None = None,
                  descriptors_per_token: float | None = None,
                  **config_changes: Any) -> dict[str, TtftEstimate]:
    """TTFT per mode for one traffic, from one deployment model.

    ``workload_or_config``: a ``kvtune.analysis.Workload`` summary (or any object with its fields),
    a :class:`WorkloadSpec`, a replay DataFrame (``arrival_s, prompt_tokens, output_tokens``
    [, ``conversation_id, turn``]) or a full :class:`SimConfig`. ``floor_fit`` / ``prefill_cost``
    calibrate the fabric and the prefill (``SimConfig.from_fit``); whatever they leave open comes
    from ``base`` (default: the public H200 preset). The traffic is cut to about ``max_requests``
    requests so the answer stays quick. ``prefix_caching``, ``ttl_s``, ``threshold_tokens`` override
    the reuse settings; ``bytes_per_token`` / ``descriptors_per_token`` the model's KV geometry
    (per rank, as in ``kv.bytes``); other keyword arguments are :meth:`SimConfig.with_` changes.
    """
    for m in modes:
        if m not in MODES:
            raise SimError(f"expected_ttft: modes: expected a subset of {MODES}, got {m!r}")
    if max_requests < 1:
        raise SimError(f"expected_ttft: max_requests: expected >= 1, got {max_requests!r}")
    cfg = _config(workload_or_config, base, max_requests)
    if floor_fit is not None or prefill_cost is not None:
        cfg = SimConfig.from_fit(floor_fit, prefill_cost, base=cfg)
    reuse: dict[str, Any] = {}
    if prefix_caching is not None:
        reuse["prefix_caching"] = bool(prefix_caching)
    if ttl_s is not None:
        reuse["ttl_s"] = float(ttl_s)
    if threshold_tokens is not None:
        reuse["threshold_tokens"] = int(threshold_tokens)
    if reuse:
        config_changes["reuse"] = reuse
    geometry: dict[str, Any] = {}
    if bytes_per_token is not None:
        geometry["kv_bytes_per_token"] = max(1, int(round(bytes_per_token)))
    if descriptors_per_token is not None:
        geometry["descriptors_per_block"] = max(1, int(round(descriptors_per_token * cfg.transfer.block_tokens)))
    if geometry:
        config_changes["transfer"] = geometry
        if cfg.reverse_transfer is not None:
            config_changes["reverse_transfer"] = geometry
    cfg = cfg.with_(seed=seed, **config_changes)
    return {m: simulate(replace(cfg, mode=m)).ttft() for m in modes}


def best_mode(estimates: dict[str, TtftEstimate], *, by: str = "p50_ms") -> str:
    """The mode with the lowest ``by`` (``p50_ms``, ``p90_ms``, ``p99_ms`` or ``mean_ms``)."""
    usable = {m: getattr(e, by) for m, e in estimates.items() if not math.isnan(getattr(e, by))}
    if not usable:
        raise SimError("best_mode: no estimate has a finite value")
    return min(usable, key=lambda m: (usable[m], m))


def _config(source: Any, base: SimConfig | None, max_requests: int) -> SimConfig:
    if isinstance(source, SimConfig):
        cfg = source
        if cfg.requests is not None:
            return replace(cfg, requests=_cut_frame(requests_frame(cfg.requests), max_requests))
        return replace(cfg, workload=_cut_spec(cfg.workload, max_requests))
    if base is None:
        from kvtune.sim.presets import public_h200_qwen3_32b
        base = public_h200_qwen3_32b()
    if isinstance(source, pd.DataFrame):
        return replace(base, requests=_cut_frame(requests_frame(source), max_requests))
    if isinstance(source, WorkloadSpec):
        return replace(base, workload=_cut_spec(source, max_requests), requests=None)
    return replace(base, workload=_cut_spec(spec_from_workload(source), max_requests), requests=None)


def _cut_spec(spec: WorkloadSpec, max_requests: int) -> WorkloadSpec:
    if spec.users > 0:
        return spec
    duration = min(spec.duration_s, max(MIN_DURATION_S, max_requests / spec.qps))
    return replace(spec, duration_s=duration)


def _cut_frame(df: pd.DataFrame, max_requests: int) -> pd.DataFrame:
    return df.sort_values("arrival_s", kind="stable").head(max_requests)
