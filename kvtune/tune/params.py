"""The notebooks' parameters: names, types, defaults, and validation with clear errors."""
from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from typing import Any

from kvtune.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Param:
    name: str
    type: type
    default: Any
    help: str


PARAMETERS: tuple[Param, ...] = (
    Param("traces", str, "", "trace source: OTLP-JSON file/dir/glob or tempo+http(s)://HOST:PORT?q=..."),
    Param("fabric", str, "local", "fabric name shown in figures and recorded in recommendation.json"),
    Param("model", str, "", "geometry: a preset name (e.g. qwen3-32b) or a local HF config.json; "
                            "empty = infer bytes per token from the spans"),
    Param("model_name", str, "", "model name or path for `vllm serve` in the exported files; "
                                 "empty = kv.model from the spans (else the placeholder MODEL)"),
    Param("tp_size", int, 1, "tensor-parallel size (bytes per token are per rank)"),
    Param("hbm_budget_gb", float, 1.0, "decode memory you allow for retained KV (GB)"),
    Param("nominal_gbps", float, 0.0, "the link's nominal rate for the efficiency plot (0 = unknown)"),
    Param("early_decode_ok", bool, True, "may the router choose the decode instance up front (push)?"),
    Param("out_dir", str, "out/tune", "where configs and recommendation.json are written"),
    Param("seed", int, 0, "seed for bootstrap intervals and simulation"),
    Param("tuning_json", str, "", "the tuning `kvtune tune` computed once (its tuning.json) for "
                                  "the notebooks to draw; empty = each notebook computes it"),
)
BY_NAME = {p.name: p for p in PARAMETERS}
TRACE_SCHEMES = ("tempo+http://", "tempo+https://")


def defaults() -> dict[str, Any]:
    return {p.name: p.default for p in PARAMETERS}


def coerce(name: str, value: Any) -> Any:
    """Coerce a CLI/YAML value to the parameter's type; a wrong type raises ConfigError naming it."""
    p = BY_NAME.get(name)
    if p is None:
        return value
    if p.type is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"parameter {name!r}: expected true/false, got {value!r}")
    if p.type in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"parameter {name!r}: expected {p.type.__name__}, got {value!r}")
        try:
            out = p.type(value)
        except (TypeError, ValueError):
            raise ConfigError(f"parameter {name!r}: expected {p.type.__name__}, got {value!r}") from None
        if p.type is int and isinstance(value, float) and value != int(value):
            raise ConfigError(f"parameter {name!r}: expected an integer, got {value!r}")
        return out
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"parameter {name!r}: expected a string, got {value!r}")
    return value


def validate(params: dict[str, Any]) -> dict[str, Any]:
    """Full parameter set (defaults filled in), types coerced, the trace source checked.

    Unknown parameters are warned about (papermill's convention), not silently accepted."""
    out = defaults()
    for name, value in params.items():
        if name not in BY_NAME:
            log.warning("unknown parameter %r (known: %s); passed through", name,
                        ", ".join(BY_NAME))
            out[name] = value
            continue
        out[name] = coerce(name, value)
    check_source(out["traces"])
    if out["tuning_json"] and not os.path.isfile(out["tuning_json"]):
        raise ConfigError(f"parameter 'tuning_json': no such file: {out['tuning_json']!r} "
                          f"(a tuning.json written by `kvtune tune`, or empty)")
    for name in ("tp_size",):
        if out[name] < 1:
            raise ConfigError(f"parameter {name!r}: expected >= 1, got {out[name]!r}")
    for name in ("hbm_budget_gb",):
        if out[name] <= 0:
            raise ConfigError(f"parameter {name!r}: expected > 0, got {out[name]!r}")
    return out


def check_source(source: str) -> None:
    """Raise ConfigError when ``source`` is neither an existing path/glob nor a known URL scheme."""
    if not source:
        return
    if "://" in source:
        if not source.startswith(TRACE_SCHEMES):
            raise ConfigError(f"parameter 'traces': unknown source scheme in {source!r}; expected a "
                              f"file, directory or glob, or one of {', '.join(TRACE_SCHEMES)}")
        return
    for part in source.split(","):
        if not (os.path.exists(part) or glob.glob(part)):
            raise ConfigError(f"parameter 'traces': no such file, directory or glob: {part!r}")
