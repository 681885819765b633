"""``expected_ttft``: the what-if the mode recommendation asks — the same traffic played through
push, pull and bidirectional on a deployment calibrated with the user's own fits."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import pandas as pd

from kvtune.analysis.fit import FloorFit
from kvtune.analysis.hops import RouterHops
from kvtune.analysis.path import PathCosts
from kvtune.analysis.prefill import PrefillCost
from kvtune.analysis.workload import Workload
from kvtune.errors import SimError
from kvtune.sim.calibrate import (FLOOR_FIT_FIELDS, PREFILL_FIT_FIELDS, SimInput, from_fit,
                                  from_inputs, mode_inputs, prefill_model, sim_inputs)
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


ModeChanges = Mapping[Mode, Mapping[str, Mapping[str, Any]]]
"""Per mode: part -> field -> value (:meth:`SimConfig.with_` changes) played in that mode only."""


@dataclass(frozen=True)
class Calibrated:
    """The deployment :func:`expected_ttft` plays, and the source of each of its numbers;
    ``mode_changes``: what the trace measured apart for a mode, played in that mode only (its
    :class:`SimInput` entries carry the mode)."""

    config: SimConfig
    inputs: tuple[SimInput, ...]
    mode_changes: ModeChanges = field(default_factory=dict)

    def config_for(self, mode: Mode | str) -> SimConfig:
        """The config played in ``mode``: :attr:`config` with that mode's changes."""
        m = sim_mode(mode, "Calibrated.config_for: mode")
        changes = {k: dict(v) for k, v in (self.mode_changes.get(m) or {}).items()}
        return self.config.with_(mode=m, **changes)


def calibrate(traffic: Traffic, floor_fit: FloorFit | None = None,
              prefill_cost: PrefillCost | None = None, *, base: SimConfig | None = None,
              max_requests: int = DEFAULT_MAX_REQUESTS, seed: int = 0,
              prefix_caching: bool | None = None, ttl_s: float | None = None,
              threshold_tokens: int | None = None, bytes_per_token: float | None = None,
              descriptors_per_token: float | None = None, fit_source: str = "floor fit",
              prefix_caching_source: str = "setting", first_step_ms: float | None = None,
              first_step_source: str = "measured", hops: RouterHops | None = None,
              hops_source: str = "measured", path: Mapping[str, PathCosts] | None = None,
              main_mode: str | None = None, path_source: str = "measured",
              mode_prefill: Mapping[str, PrefillCost] | None = None,
              block_tokens: int | None = None, block_tokens_source: str = "measured",
              loop_per_descriptor_us: float | None = None, loop_source: str = "measured",
              **config_changes: Any) -> Calibrated:
    """The config :func:`expected_ttft` simulates (see there), with :func:`sim_inputs` naming
    which numbers came from the fits, the workload or the settings and which from the preset.

    As traced, each replacing the preset's where given: ``hops`` the router's hop, intake and
    per-kilotoken costs (``kvtune.analysis.hops``); ``path`` per mode the engines' intakes and
    push's handover and notification (``kvtune.analysis.path``): ``main_mode``'s (else the first
    mode's) for every mode, each other mode's for itself; ``mode_prefill`` per mode its own
    prefill cost (``prefill_cost`` stays the rest's); ``block_tokens`` the engines' KV block
    size (prefix caches hit whole blocks, transfers move them); ``loop_per_descriptor_us`` the
    engine loop's inline work per READ descriptor, on the decode (pull) and the prefill (reverse
    pulls) alike."""
    if max_requests < 1:
        raise SimError(f"expected_ttft: max_requests: expected >= 1, got {max_requests!r}")
    cfg = with_traffic(traffic, base, max_requests)
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
    if loop_per_descriptor_us is not None:
        loop = float(loop_per_descriptor_us)
        cfg = cfg.with_(decode={"loop_per_descriptor_us": loop}, prefill={"loop_per_descriptor_us": loop})
        sources.update({"decode.loop_per_descriptor_us": loop_source,
                        "prefill.loop_per_descriptor_us": loop_source})
    if block_tokens is not None:
        cfg = cfg.with_(transfer={"block_tokens": max(1, int(block_tokens))})
        if cfg.reverse_transfer is not None:
            cfg = cfg.with_(reverse_transfer={"block_tokens": max(1, int(block_tokens))})
        sources["transfer.block_tokens"] = block_tokens_source
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
    if hops is not None:
        overheads = {k: float(v) for k, v in (
            ("hop_ms", hops.hop_ms), ("router_ms", hops.router_ms),
            ("tokenize_per_kilotoken_ms", hops.tokenize_per_kilotoken_ms if hops.hop_ms is not None else None),
            ("handoff_per_kilotoken_ms", hops.handoff_per_kilotoken_ms if hops.hop_ms is not None else None))
            if v is not None}
        if overheads:
            cfg = cfg.with_(overheads=overheads)
            sources.update({f"overheads.{k}": hops_source for k in overheads})
    per_mode: dict[Mode, dict[str, dict[str, Any]]] = {}
    mode_sources: dict[Mode, dict[str, str]] = {}
    if path:
        main = main_mode if main_mode in path else next(iter(path))
        for name, changes in _path_changes(path[main]).items():
            cfg = cfg.with_(**{name: changes})
            sources.update({f"{name}.{k}": f"{path_source} ({main} requests)" for k in changes})
        for m, costs in path.items():
            mode = _serving_mode(m)
            if m == main or mode is None:
                continue
            for name, changes in _path_changes(costs).items():
                per_mode.setdefault(mode, {}).setdefault(name, {}).update(changes)
                mode_sources.setdefault(mode, {}).update(
                    {f"{name}.{k}": f"{path_source} ({m} requests)" for k in changes})
    for m, cost in (mode_prefill or {}).items():
        mode = _serving_mode(m)
        if mode is None:
            continue
        pm = prefill_model(cost, cfg.prefill)
        changes = {k: getattr(pm, k) for k in ("base_ms", "per_token_ms", "per_token_prefix_us")}
        per_mode.setdefault(mode, {})["prefill"] = changes
        mode_sources.setdefault(mode, {}).update(
            {f"prefill.{k}": f"measured: prefill fit of the {m} requests" for k in changes})
    inputs = sim_inputs(cfg, sources)
    for mode, changes in per_mode.items():
        inputs += mode_inputs(cfg, mode, changes, mode_sources.get(mode, {}))
    return Calibrated(cfg, inputs, per_mode)


def recalibrate(inputs: Iterable[SimInput], traffic: Traffic, *,
                max_requests: int = DEFAULT_MAX_REQUESTS) -> Calibrated:
    """The deployment a recommendation simulated, from its ``sim_inputs``
    (:func:`kvtune.sim.calibrate.from_inputs`), playing ``traffic`` (the list names the traffic
    but cannot replay it: pass the workload it was read from)."""
    listed = tuple(inputs)
    cfg, per_mode = from_inputs(listed, base=with_traffic(traffic, max_requests=max_requests))
    return Calibrated(cfg, listed, per_mode)


def _serving_mode(value: str) -> Mode | None:
    try:
        return sim_mode(value)
    except SimError:
        return None


def _path_changes(costs: PathCosts) -> dict[str, dict[str, float]]:
    """The :class:`SimConfig` parts a mode's :class:`PathCosts` set (what it measured)."""
    over = {k: float(v) for k, v in (("prefill_intake_ms", costs.prefill_intake_ms),
                                     ("decode_intake_ms", costs.decode_intake_ms),
                                     ("handover_ms", costs.handover_ms)) if v is not None}
    out: dict[str, dict[str, float]] = {"overheads": over} if over else {}
    if costs.notify_ms is not None:
        out["transfer"] = {"notify_ms": float(costs.notify_ms)}
    if costs.first_step_ms is not None:  # the step that emits the first token after the KV
        out["decode"] = {"step_base_ms": float(costs.first_step_ms)}
    return out


def ttft_per_mode(config: SimConfig | Calibrated,
                  modes: Iterable[Mode | str] = PD_MODES) -> dict[Mode, TtftEstimate]:
    """TTFT of ``config``'s traffic played in each mode (a :class:`Calibrated` plays each mode
    with what the trace measured for it)."""
    chosen = [sim_mode(m, "expected_ttft: modes") for m in modes]
    if isinstance(config, Calibrated):
        return {m: simulate(config.config_for(m)).ttft() for m in chosen}
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


def with_traffic(source: Traffic, base: SimConfig | None = None,
                 max_requests: int = DEFAULT_MAX_REQUESTS) -> SimConfig:
    """``base`` (default: the public preset) playing ``source``'s traffic, cut (or, for a measured
    summary, extended) to about ``max_requests`` requests: the config :func:`calibrate` starts
    from. A :class:`SimConfig` brings its own deployment."""
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
    # a measured summary's shape, played for about max_requests requests however short the
    # trace was: a p50 over a short trace's few dozen draws moves by 10-20% from seed to seed
    spec = spec_from_workload(source)
    spec = replace(spec, duration_s=max(spec.duration_s, max_requests / spec.qps))
    return replace(base, workload=_cut_spec(spec, max_requests), requests=None)


def _cut_spec(spec: WorkloadSpec, max_requests: int) -> WorkloadSpec:
    if spec.users > 0:
        return spec
    duration = min(spec.duration_s, max(MIN_DURATION_S, max_requests / spec.qps))
    return replace(spec, duration_s=duration)


def _cut_frame(df: pd.DataFrame, max_requests: int) -> pd.DataFrame:
    return df.sort_values("arrival_s", kind="stable").head(max_requests)
