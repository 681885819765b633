"""``expected_ttft``: the what-if the mode recommendation asks — the same traffic played through
push, pull and bidirectional on a deployment calibrated with the user's own fits."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal

import pandas as pd

from kvtune.analysis.fit import FloorFit
from kvtune.analysis.prefill import PrefillCost
from kvtune.analysis.workload import Workload
from kvtune.errors import SimError
from kvtune.sim.calibrate import FLOOR_FIT_FIELDS, PREFILL_FIT_FIELDS, SimInput, from_fit, sim_inputs
from kvtune.sim.config import Mode, SimConfig, WorkloadSpec, sim_mode
from kvtune.sim.presets import public_h200_qwen3_32b
from kvtune.sim.result import TtftEstimate, simulate
from kvtune.sim.workload import requests_frame, spec_from_workload
from kvtune.spans import PD_MODES

DEFAULT_MAX_REQUESTS = 1200
"""Requests simulated per mode by default: enough for a stable p50 and a rough p99 while the
three modes together stay well under two seconds."""
MIN_DURATION_S = 20.0

Traffic = Workload | WorkloadSpec | pd.DataFrame | SimConfig
"""What :func:`expected_ttft` plays: a measured workload summary, a synthetic spec, a replay
table (``arrival_s, prompt_tokens, output_tokens`` [, ``conversation_id, turn``]) or a full
config (its own traffic)."""
Statistic = Literal["p50_ms", "p90_ms", "p99_ms", "mean_ms"]


@dataclass(frozen=True)
class Calibrated:
    """The deployment :func:`expected_ttft` plays, and the source of each of its numbers."""

    config: SimConfig
    inputs: tuple[SimInput, ...]


def calibrate(traffic: Traffic, floor_fit: FloorFit | None = None,
              prefill_cost: PrefillCost | None = None, *, base: SimConfig | None = None,
              max_requests: int = DEFAULT_MAX_REQUESTS, seed: int = 0,
              prefix_caching: bool | None = None, ttl_s: float | None = None,
              threshold_tokens: int | None = None, bytes_per_token: float | None = None,
              descriptors_per_token: float | None = None, fit_source: str = "floor fit",
              prefix_caching_source: str = "setting", first_step_ms: float | None = None,
              first_step_source: str = "measured", hop_ms: float | None = None,
              router_ms: float | None = None, hops_source: str = "measured",
              **config_changes: Any) -> Calibrated:
    """The config :func:`expected_ttft` simulates (see there), with :func:`sim_inputs` naming
    which numbers came from the fits, the workload or the settings and which from the preset.
    ``hop_ms`` / ``router_ms`` (None: the preset's) are one router <-> instance hop and the
    router's intake, as traced (``kvtune.analysis.hops``)."""
    if max_requests < 1:
        raise SimError(f"expected_ttft: max_requests: expected >= 1, got {max_requests!r}")
    cfg = _config(traffic, base, max_requests)
    sources: dict[str, str] = {"workload": (
        "given: SimConfig" if isinstance(traffic, SimConfig) else
        "given: replay table" if isinstance(traffic, pd.DataFrame) else
        "given: WorkloadSpec" if isinstance(traffic, WorkloadSpec) else
        "measured: trace workload summary (kvtune.analysis.workload)")}
    if floor_fit is not None or prefill_cost is not None:
        cfg = from_fit(floor_fit, prefill_cost, base=cfg)
        if floor_fit is not None:
            sources.update({k: f"measured: {fit_source}" for k in FLOOR_FIT_FIELDS})
            sources["reverse_transfer"] = "same as transfer (measured)"
        if prefill_cost is not None:
            sources.update({k: "measured: prefill fit" for k in PREFILL_FIT_FIELDS})
    reuse: dict[str, Any] = {}
    if prefix_caching is not None:
        reuse["prefix_caching"] = bool(prefix_caching)
        sources["reuse.prefix_caching"] = prefix_caching_source
    if ttl_s is not None:
        reuse["ttl_s"] = float(ttl_s)
        sources["reuse.ttl_s"] = "setting: recommended decoder_kv_blocks_ttl"
    if threshold_tokens is not None:
        reuse["threshold_tokens"] = int(threshold_tokens)
        sources["reuse.threshold_tokens"] = "setting: recommended kv_recompute_threshold"
    if reuse:
        config_changes["reuse"] = reuse

    for key in config_changes:
        sources.setdefault(key, "setting")
    geometry: dict[str, Any] = {}
    if bytes_per_token is not None:
        geometry["kv_bytes_per_token"] = max(1, int(round(bytes_per_token)))
        sources["transfer.kv_bytes_per_token"] = "measured: kv.bytes / kv.tokens"
    if descriptors_per_token is not None:
        geometry["descriptors_per_block"] = max(1, int(round(descriptors_per_token * cfg.transfer.block_tokens)))
        sources["transfer.descriptors_per_block"] = "measured: kv.descriptors / kv.tokens"
    if geometry:
        config_changes["transfer"] = geometry
        if cfg.reverse_transfer is not None:
            config_changes["reverse_transfer"] = geometry
    cfg = cfg.with_(seed=seed, **config_changes)
    if first_step_ms is not None:  # the step that emits a request's first token after its KV
        cfg = cfg.with_(decode={"step_base_ms": float(first_step_ms)})
        sources["decode.step_base_ms"] = first_step_source
    overheads = {k: float(v) for k, v in (("hop_ms", hop_ms), ("router_ms", router_ms))
                 if v is not None}
    if overheads:
        cfg = cfg.with_(overheads=overheads)
        sources.update({f"overheads.{k}": hops_source for k in overheads})
    return Calibrated(cfg, sim_inputs(cfg, sources))


def ttft_per_mode(config: SimConfig, modes: Iterable[Mode | str] = PD_MODES) -> dict[Mode, TtftEstimate]:
    """TTFT of ``config``'s traffic played in each mode."""
    chosen = [sim_mode(m, "expected_ttft: modes") for m in modes]
    return {m: simulate(replace(config, mode=m)).ttft() for m in chosen}


def expected_ttft(traffic: Traffic, floor_fit: FloorFit | None = None,
                  prefill_cost: PrefillCost | None = None, *,
                  modes: Iterable[Mode | str] = PD_MODES, base: SimConfig | None = None,
                  max_requests: int = DEFAULT_MAX_REQUESTS, seed: int = 0,
                  prefix_caching: bool | None = None, ttl_s: float | None = None,
                  threshold_tokens: int | None = None, bytes_per_token: float | None = None,
                  descriptors_per_token: float | None = None,
                  **config_changes: Any) -> dict[Mode, TtftEstimate]:
    """TTFT per mode for one traffic, from one deployment model.

    ``traffic``: a ``kvtune.analysis.Workload`` summary, a :class:`WorkloadSpec`, a replay
    DataFrame (``arrival_s, prompt_tokens, output_tokens`` [, ``conversation_id, turn``]) or a full
    :class:`SimConfig`. ``floor_fit`` / ``prefill_cost`` calibrate the fabric and the prefill
    (:func:`kvtune.sim.calibrate.from_fit`); whatever they leave open comes from ``base``
    (default: the public H200 preset). The traffic is cut to about ``max_requests`` requests so the
    answer stays quick. ``prefix_caching``, ``ttl_s``, ``threshold_tokens`` override the reuse
    settings; ``bytes_per_token`` / ``descriptors_per_token`` the model's KV geometry (per rank, as
    in ``kv.bytes``); other keyword arguments are :meth:`SimConfig.with_` changes. Keys of the
    answer are ``kvtune.spans.Mode`` members.
    """
    chosen = [sim_mode(m, "expected_ttft: modes") for m in modes]
    cal = calibrate(traffic, floor_fit, prefill_cost, base=base, max_requests=max_requests,
                    seed=seed, prefix_caching=prefix_caching, ttl_s=ttl_s,
                    threshold_tokens=threshold_tokens, bytes_per_token=bytes_per_token,
                    descriptors_per_token=descriptors_per_token, **config_changes)
    return ttft_per_mode(cal.config, chosen)


def best_mode(estimates: dict[Mode, TtftEstimate], *, by: Statistic = "p50_ms") -> Mode:
    """The mode with the lowest ``by`` (``p50_ms``, ``p90_ms``, ``p99_ms`` or ``mean_ms``)."""
    usable = {m: getattr(e, by) for m, e in estimates.items() if not math.isnan(getattr(e, by))}
    if not usable:
        raise SimError("best_mode: no estimate has a finite value")
    return min(usable, key=lambda m: (usable[m], str(getattr(m, "value", m))))


def _config(source: Traffic, base: SimConfig | None, max_requests: int) -> SimConfig:
    if isinstance(source, SimConfig):
        cfg = source
        if cfg.requests is not None:
            return replace(cfg, requests=_cut_frame(requests_frame(cfg.requests), max_requests))
        return replace(cfg, workload=_cut_spec(cfg.workload, max_requests))
    if base is None:
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
