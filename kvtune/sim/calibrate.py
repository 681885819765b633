"""A simulator deployment calibrated with measured fits, and where each of its numbers came from.

:func:`from_fit` puts a fabric fit (``kvtune.analysis.FloorFit``) and a prefill cost
(``kvtune.analysis.PrefillCost``) into a base deployment (default: the public H200 preset);
:func:`sim_inputs` lists every number the simulator then plays with its source, so advice built
on the simulator can say which values were measured and which were taken from the preset.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

from kvtune.analysis.fit import FloorFit
from kvtune.analysis.prefill import PrefillCost
from kvtune.errors import SimError
from kvtune.sim.config import Dist, Mode, PrefillModel, SimConfig
from kvtune.sim.presets import public_h200_qwen3_32b

MODEL_PARTS: tuple[str, ...] = ("prefill", "decode", "transfer", "reverse_transfer", "overheads",
                                "reuse")
"""The cost-model and setting parts of a :class:`SimConfig` that :func:`sim_inputs` lists."""
TOPOLOGY_FIELDS: tuple[str, ...] = ("prefill_instances", "decode_instances")
FLOOR_FIT_FIELDS: tuple[str, ...] = ("transfer.floor_ms", "transfer.bandwidth_gbps",
                                     "transfer.per_descriptor_us")
PREFILL_FIT_FIELDS: tuple[str, ...] = ("prefill.base_ms", "prefill.per_token_ms",
                                       "prefill.per_token_prefix_us")


@dataclass(frozen=True)
class SimInput:
    """One number the simulator played: ``name`` (``part.field``, e.g. ``transfer.floor_ms``), its
    ``value``, and its ``source`` (``"measured: ..."``, ``"preset <name>"``, ``"setting: ..."``)."""

    name: str
    value: float | int | bool | str | None
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "source": self.source}


def from_fit(floor_fit: FloorFit | None, prefill_cost: PrefillCost | None, *,
             base: SimConfig | None = None, mode: Mode | str | None = None,
             **changes: Any) -> SimConfig:
    """Calibrate a config from a measured fabric fit and prefill cost.

    ``floor_fit`` gives ``floor_ms, bandwidth_gbps`` and ``per_descriptor_us`` (None: 0);
    ``prefill_cost`` gives ``per_token_ms, per_token_prefix_us, base_ms``. Either may be ``None``
    to keep ``base``'s model. Everything else (decode, overheads, model geometry) comes from
    ``base`` (default: the public H200 preset) and ``changes`` (:meth:`SimConfig.with_`).
    """
    cfg = base if base is not None else public_h200_qwen3_32b()
    if floor_fit is not None:
        fl = _number(floor_fit, "floor_ms", "floor_fit")
        bw = _number(floor_fit, "bandwidth_gbps", "floor_fit")
        pd = getattr(floor_fit, "per_descriptor_us", None)
        tm = replace(cfg.transfer, floor_ms=fl, bandwidth_gbps=bw,
                     per_descriptor_us=float(pd) if pd is not None else 0.0)
        cfg = replace(cfg, transfer=tm, reverse_transfer=None)
    if prefill_cost is not None:
        pm = PrefillModel(
            base_ms=float(getattr(prefill_cost, "base_ms", 0.0) or 0.0),
            per_token_ms=_number(prefill_cost, "per_token_ms", "prefill_cost"),
            per_token_prefix_us=float(getattr(prefill_cost, "per_token_prefix_us", 0.0) or 0.0),
            parallel_requests=cfg.prefill.parallel_requests)
        cfg = replace(cfg, prefill=pm)
    if mode is not None:
        changes["mode"] = mode
    return cfg.with_(**changes) if changes else cfg


def sim_inputs(config: SimConfig, sources: Mapping[str, str]) -> tuple[SimInput, ...]:
    """Every cost-model number and setting of ``config`` (:data:`MODEL_PARTS`, the topology) with
    its source: ``sources[name]`` when given (``name`` = ``part.field``, or ``part`` for all its
    fields), else the preset the config was built from (``config.name``)."""
    preset = f"preset {config.name or 'default'}"
    out: list[SimInput] = []
    for part in MODEL_PARTS:
        obj = getattr(config, part)
        if obj is None:  # reverse transfers cost what forward ones do
            out.append(SimInput(part, None, "same as transfer"))
            continue
        assert is_dataclass(obj)
        for f in fields(obj):
            name = f"{part}.{f.name}"
            value = getattr(obj, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            out.append(SimInput(name, value, sources.get(name, sources.get(part, preset))))
    for name in TOPOLOGY_FIELDS:
        out.append(SimInput(name, getattr(config, name), sources.get(name, preset)))
    if config.requests is not None:
        out.append(SimInput("requests", f"{len(config.requests)} replayed requests",
                            sources.get("requests", sources.get("workload", "given"))))
    else:
        for f in fields(config.workload):
            name = f"workload.{f.name}"
            out.append(SimInput(name, _shown(getattr(config.workload, f.name)),
                                sources.get(name, sources.get("workload", preset))))
    return tuple(out)


def _shown(value: object) -> float | int | bool | str:
    """A workload field as one JSON value: numbers as they are, a distribution as text."""
    if isinstance(value, Dist):
        if value.kind == "empirical":
            return f"empirical ({len(value.params)} values, mean {value.mean():.4g})"
        return f"{value.kind}:{','.join(f'{p:g}' for p in value.params)}"
    assert isinstance(value, (float, int, bool, str))
    return value


def _number(obj: object, name: str, what: str) -> float:
    value = getattr(obj, name, None)
    try:
        value = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SimError(f"{what}.{name}: expected a number, got {value!r}") from None
    if not math.isfinite(value) or value < 0:
        raise SimError(f"{what}.{name}: expected a finite non-negative number, got {value!r}")
    return value
