"""A simulator deployment calibrated with measured fits, and where each of its numbers came from.

:func:`from_fit` puts a fabric fit (``kvtune.analysis.FloorFit``) and a prefill cost
(``kvtune.analysis.PrefillCost``) into a base deployment (default: the public H200 preset);
:func:`sim_inputs` lists every number the simulator then plays with its source, so advice built
on the simulator can say which values were measured and which were taken from the preset.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

from kvtune.analysis.fit import FloorFit
from kvtune.analysis.prefill import PrefillCost
from kvtune.errors import SimError
from kvtune.sim.config import Dist, Mode, PrefillModel, SimConfig, sim_mode
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
    ``value``, and its ``source`` (``"measured: ..."``, ``"preset <name>"``, ``"setting: ..."``);
    ``mode``: the P/D mode it was played in where the trace measured that mode apart (None: every
    mode without one of its own)."""

    name: str
    value: float | int | bool | str | None
    source: str
    mode: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "value": self.value, "source": self.source}
        if self.mode is not None:
            out["mode"] = self.mode
        return out


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
        cfg = replace(cfg, prefill=prefill_model(prefill_cost, cfg.prefill))
    if mode is not None:
        changes["mode"] = mode
    return cfg.with_(**changes) if changes else cfg


def prefill_model(prefill_cost: PrefillCost, base: PrefillModel) -> PrefillModel:
    """``base`` with ``prefill_cost``'s fitted terms (its batching and engine-loop costs kept)."""
    return replace(base, base_ms=float(getattr(prefill_cost, "base_ms", 0.0) or 0.0),
                   per_token_ms=_number(prefill_cost, "per_token_ms", "prefill_cost"),
                   per_token_prefix_us=float(getattr(prefill_cost, "per_token_prefix_us", 0.0) or 0.0))


def mode_inputs(config: SimConfig, mode: Mode, changes: Mapping[str, Mapping[str, Any]],
                sources: Mapping[str, str]) -> tuple[SimInput, ...]:
    """The numbers ``changes`` (part -> field -> value, as :meth:`SimConfig.with_` takes them)
    set for ``mode`` on top of ``config``, each with ``sources[part.field]`` and the mode."""
    out = []
    for part, values in changes.items():
        for name, value in values.items():
            key = f"{part}.{name}"
            out.append(SimInput(key, value, sources.get(key, "measured"), mode.value))
    return tuple(out)


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


def from_inputs(inputs: Sequence[SimInput | Mapping[str, Any]], *, base: SimConfig | None = None
                ) -> tuple[SimConfig, dict[Mode, dict[str, dict[str, Any]]]]:
    """The deployment a list of :class:`SimInput` (or their ``as_dict`` form, as a
    recommendation's ``sim_inputs`` holds them) describes: ``base`` (default: the public preset)
    with every cost-model number and the topology set, and per mode the numbers listed for that
    mode (part -> field -> value, :meth:`SimConfig.with_` changes). The traffic is not in the
    list in replayable form: it stays ``base``'s."""
    cfg = base if base is not None else public_h200_qwen3_32b()
    changes: dict[str, dict[str, Any]] = {}
    per_mode: dict[Mode, dict[str, dict[str, Any]]] = {}
    top: dict[str, Any] = {}
    for item in inputs:
        d = item.as_dict() if isinstance(item, SimInput) else dict(item)
        name, value, mode = str(d.get("name", "")), d.get("value"), d.get("mode")
        part, _, fname = name.partition(".")
        if name in TOPOLOGY_FIELDS and isinstance(value, int):
            top[name] = value
            continue
        if part not in MODEL_PARTS or not fname or value is None:
            continue
        if not hasattr(getattr(cfg, part) or cfg.transfer, fname):
            raise SimError(f"sim input {name!r}: {part} has no field {fname!r}")
        target = changes if mode is None else per_mode.setdefault(sim_mode(mode, f"sim input {name!r}: mode"), {})
        target.setdefault(part, {})[fname] = value
    rev = changes.pop("reverse_transfer", None)
    cfg = cfg.with_(**changes, **top)
    if rev:
        cfg = replace(cfg, reverse_transfer=replace(cfg.reverse_transfer or cfg.transfer, **rev))
    return cfg, per_mode


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
