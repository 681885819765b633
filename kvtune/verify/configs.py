"""The configurations ``kvtune verify`` compares, and where they come from.

A :class:`VerifyConfig` is what changes between runs: the mode, ``kv_recompute_threshold`` and
``decoder_kv_blocks_ttl`` (None: vLLM's default). :func:`load_config` takes, by the spec's form:

- ``defaults``: vLLM's defaults (NIXL pull; ``bidirectional_kv_xfer`` is off by default);
- ``defaults:bidirectional``: bidirectional on with vLLM's default threshold and TTL;
- a ``kvtune tune`` output directory, its ``configs/`` directory, or a ``recommendation.json``:
  kvtune's recommendation (the values the exported files hold);
- a ``--kv-transfer-config`` JSON file (the prefill's or decode's, as ``kvtune export`` writes);
- a YAML/JSON file ``{name, mode, kv_recompute_threshold, decoder_kv_blocks_ttl}``.

``NAME=SPEC`` names the configuration (else the name comes from the spec).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvtune import safe_yaml
from kvtune.errors import ConfigError
from kvtune.vllm_pd import (BIDIRECTIONAL_KV_XFER, DECODER_KV_BLOCKS_TTL, KV_CONNECTOR,
                            KV_CONNECTOR_EXTRA_CONFIG, KV_RECOMPUTE_THRESHOLD, MODES)

DEFAULTS: Final = "defaults"
DEFAULTS_BIDIRECTIONAL: Final = "defaults:bidirectional"
RECOMMENDED: Final = "recommended"
RECOMMENDATION_FILE: Final = "recommendation.json"
KV_CONFIG_FILE: Final = "prefill.kv-transfer-config.json"
MAX_CONFIG_BYTES: Final = 1024 * 1024
CONFIG_KEYS: Final = frozenset({"name", "mode", "kv_recompute_threshold", "decoder_kv_blocks_ttl"})


@dataclass(frozen=True)
class VerifyConfig:
    """One configuration to replay the workload under."""

    name: str
    mode: str
    recompute_threshold_tokens: int | None = None
    """``kv_recompute_threshold``; None leaves vLLM's default (64)."""
    ttl_s: float | None = None
    """``decoder_kv_blocks_ttl``; None leaves vLLM's default (480 s)."""
    source: str = ""
    """Where it came from (shown in the result)."""

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name) or len(self.name) > 64:
            raise ConfigError(f"verify config {self.source or self.name!r}: field 'name': expected "
                              f"1..64 characters without spaces, got {self.name!r}")
        if self.mode not in MODES:
            raise ConfigError(f"verify config {self.name!r} ({self.source}): field 'mode': "
                              f"expected one of {MODES}, got {self.mode!r}")
        t = self.recompute_threshold_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise ConfigError(f"verify config {self.name!r} ({self.source}): field "
                              f"'kv_recompute_threshold': expected an integer >= 0, got {t!r}")
        if self.ttl_s is not None and not (isinstance(self.ttl_s, (int, float))
                                           and math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ConfigError(f"verify config {self.name!r} ({self.source}): field "
                              f"'decoder_kv_blocks_ttl': expected a positive number of seconds, "
                              f"got {self.ttl_s!r}")
        if self.mode != "bidirectional" and (t is not None or self.ttl_s is not None):
            # Only bidirectional reuse reads them; vLLM's push connector refuses bidirectional.
            object.__setattr__(self, "recompute_threshold_tokens", None)
            object.__setattr__(self, "ttl_s", None)

    def pair_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`kvtune.local.LocalPair` for this configuration."""
        return {"mode": self.mode, "recompute_threshold": self.recompute_threshold_tokens,
                "ttl_s": self.ttl_s}

    def kv_extra_config(self) -> dict[str, Any]:
        """The ``kv_connector_extra_config`` entries this configuration sets (for restarting a
        cluster's instances)."""
        out: dict[str, Any] = {}
        if self.mode == "bidirectional":
            out[BIDIRECTIONAL_KV_XFER] = True
        if self.recompute_threshold_tokens is not None:
            out[KV_RECOMPUTE_THRESHOLD] = self.recompute_threshold_tokens
        if self.ttl_s is not None:
            out[DECODER_KV_BLOCKS_TTL] = self.ttl_s
        return out


def vllm_defaults(name: str = DEFAULTS) -> VerifyConfig:
    return VerifyConfig(name, "pull", source="vLLM defaults (NIXL pull, bidirectional_kv_xfer off)")


def vllm_defaults_bidirectional(name: str = "defaults-bidirectional") -> VerifyConfig:
    return VerifyConfig(name, "bidirectional",
                        source="vLLM defaults with bidirectional_kv_xfer on "
                               "(threshold 64, TTL 480 s)")


def load_config(spec: str) -> VerifyConfig:
    """A configuration from a spec (see the module doc); ``NAME=SPEC`` names it."""
    named = "=" in spec and not Path(spec).exists()
    name, _, rest = spec.partition("=") if named else ("", "", spec)
    rest = rest.strip()
    if rest == DEFAULTS:
        return vllm_defaults(name or DEFAULTS)
    if rest == DEFAULTS_BIDIRECTIONAL:
        return vllm_defaults_bidirectional(name or "defaults-bidirectional")
    path = Path(rest)
    if path.is_dir():
        for cand in (path / "configs" / RECOMMENDATION_FILE, path / RECOMMENDATION_FILE):
            if cand.is_file():
                return from_recommendation(cand, name=name or RECOMMENDED)
        raise ConfigError(f"verify config {path}: a directory without {RECOMMENDATION_FILE} "
                          f"(expected a kvtune tune output directory or its configs/)")
    if not path.is_file():
        raise ConfigError(f"verify config {spec!r}: expected {DEFAULTS!r}, "
                          f"{DEFAULTS_BIDIRECTIONAL!r}, a tune output directory, a "
                          f"recommendation.json, a kv-transfer-config JSON or a YAML/JSON config "
                          f"file; no such file or directory")
    data = _read(path)
    if isinstance(data, dict) and "recommendations" in data:
        return from_recommendation(path, name=name or RECOMMENDED, data=data)
    if isinstance(data, dict) and KV_CONNECTOR in data:
        return from_kv_transfer_config(data, name=name or path.stem.split(".")[0],
                                       source=str(path))
    if isinstance(data, dict):
        unknown = set(data) - CONFIG_KEYS
        if unknown:
            raise ConfigError(f"verify config {path}: unknown keys {sorted(unknown)}; expected "
                              f"some of {sorted(CONFIG_KEYS)} (or a recommendation.json / "
                              f"kv-transfer-config)")
        if "mode" not in data:
            raise ConfigError(f"verify config {path}: field 'mode': expected one of {MODES}")
        return VerifyConfig(name or str(data.get("name") or path.stem), str(data["mode"]),
                            _int_or_none(data.get("kv_recompute_threshold"), path,
                                         "kv_recompute_threshold"),
                            _float_or_none(data.get("decoder_kv_blocks_ttl"), path,
                                           "decoder_kv_blocks_ttl"), source=str(path))
    raise ConfigError(f"verify config {path}: expected a mapping at top level, "
                      f"got {type(data).__name__}")


def from_recommendation(path: Path, *, name: str = RECOMMENDED,
                        data: dict[str, Any] | None = None) -> VerifyConfig:
    """kvtune's recommendation as the exported files hold it (``never`` -> always recompute)."""
    mode, t, ttl = _recommended(path, data if data is not None else _read(path))
    return VerifyConfig(name, mode, t, ttl, source=str(path))


def _recommended(where: Any, data: Any) -> tuple[str, int | None, float | None]:
    """(mode, threshold tokens, TTL s or None) of a ``recommendation.json``'s ``recommendations``
    as the exported files hold them (``never`` -> :data:`NEVER_THRESHOLD_TOKENS`)."""
    from kvtune.export.files import NEVER_THRESHOLD_TOKENS

    recs = data.get("recommendations") if isinstance(data, dict) else None
    if not isinstance(recs, dict):
        raise ConfigError(f"{where}: field 'recommendations': expected the object kvtune export "
                          f"writes")

    def value(key: str) -> Any:
        item = recs.get(key)
        if not isinstance(item, dict) or "value" not in item:
            raise ConfigError(f"{where}: field 'recommendations.{key}.value': expected a value")
        return item["value"]
    mode, threshold = value("mode"), value("kv_recompute_threshold")
    ttl = value("decoder_kv_blocks_ttl")
    t = NEVER_THRESHOLD_TOKENS if threshold == "never" else _int_or_none(
        threshold, where, "recommendations.kv_recompute_threshold.value")
    ttl_f = _float_or_none(ttl, where, "recommendations.decoder_kv_blocks_ttl.value")
    return str(mode), t, ttl_f if ttl_f else None


def from_kv_transfer_config(data: dict[str, Any], *, name: str, source: str) -> VerifyConfig:
    extra = data.get(KV_CONNECTOR_EXTRA_CONFIG) or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"{source}: field 'kv_connector_extra_config': expected an object")
    connector = str(data.get(KV_CONNECTOR, ""))
    mode = ("push" if "Push" in connector else
            "bidirectional" if extra.get(BIDIRECTIONAL_KV_XFER) else "pull")
    return VerifyConfig(name, mode,
                        _int_or_none(extra.get(KV_RECOMPUTE_THRESHOLD), source,
                                     "kv_connector_extra_config.kv_recompute_threshold"),
                        _float_or_none(extra.get(DECODER_KV_BLOCKS_TTL), source,
                                       "kv_connector_extra_config.decoder_kv_blocks_ttl"),
                        source=source)


def _read(path: Path) -> Any:
    from kvtune import safe_yaml

    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"verify config {path}: larger than {MAX_CONFIG_BYTES} bytes")
    text = path.read_text(errors="replace")
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ConfigError(f"verify config {path}: expected JSON: {exc}"[:500]) from None
    # aliases bounded, messages truncated: a 380-byte alias bomb fails at once
    return safe_yaml.load(text, source=f"verify config {path}")


def _int_or_none(v: Any, where: Any, field: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v != int(v) or v < 0:
        raise ConfigError(f"verify config {where}: field {field!r}: expected a finite integer "
                          f">= 0, got {safe_yaml.shown(v)}")
    return int(v)


def _float_or_none(v: Any, where: Any, field: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ConfigError(f"verify config {where}: field {field!r}: expected a number of "
                          f"seconds >= 0, got {safe_yaml.shown(v)}")
    return float(v)


def effective_settings(config: VerifyConfig) -> tuple[str, int | None, float | None]:
    """(mode, threshold, TTL) as the engines run them: vLLM's defaults in place of None, and
    neither value in a mode that does not read them."""
    from kvtune.vllm_pd import (DEFAULT_DECODER_KV_BLOCKS_TTL_S,
                                DEFAULT_KV_RECOMPUTE_THRESHOLD_TOKENS)

    if config.mode != "bidirectional":
        return config.mode, None, None
    t = config.recompute_threshold_tokens
    ttl = config.ttl_s
    return (config.mode, DEFAULT_KV_RECOMPUTE_THRESHOLD_TOKENS if t is None else t,
            float(DEFAULT_DECODER_KV_BLOCKS_TTL_S if ttl is None else ttl))


def same_settings(a: VerifyConfig, b: VerifyConfig) -> bool:
    """Whether ``a`` and ``b`` run the engines the same way (two names for one configuration:
    measuring one against the other verifies nothing)."""
    return effective_settings(a) == effective_settings(b)


RUNNER_UP: Final = "runner-up"


def runner_up(recommendation: dict[str, Any], name: str = RUNNER_UP) -> VerifyConfig | None:
    """The mode the recommendation ranks second (``recommendations.mode.range[1]``), at the
    recommended threshold and TTL where it reads them; None when it names none."""
    mode, t, ttl = _recommended("the recommendation's runner-up", recommendation)
    rng = ((recommendation.get("recommendations") or {}).get("mode") or {}).get("range")
    second = rng[1] if isinstance(rng, (list, tuple)) and len(rng) > 1 else None
    if not isinstance(second, str) or second not in MODES or second == mode:
        return None
    bidi = second == "bidirectional"
    return VerifyConfig(name, second, t if bidi else None, ttl if bidi else None,
                        source=f"the runner-up mode of the recommendation ({second}"
                               + (", recommended threshold and TTL)" if bidi else ")"))


def per_mode(recommendation: dict[str, Any], have: list[VerifyConfig]) -> list[VerifyConfig]:
    """One configuration per mode the recommendation priced (pull, push, bidirectional at the
    recommended threshold and TTL, as its predictions assume), leaving out the modes ``have``
    already covers with those settings (e.g. ``defaults`` is pull)."""
    _, t, ttl = _recommended("verify --modes: the recommendation", recommendation)
    wanted = [VerifyConfig(m, m, t if m == "bidirectional" else None,
                           ttl if m == "bidirectional" else None,
                           source="kvtune verify --modes (recommended threshold and TTL)")
              for m in MODES]
    covered = {(c.mode, c.recompute_threshold_tokens, c.ttl_s) for c in have}
    names = {c.name for c in have}
    return [w for w in wanted if (w.mode, w.recompute_threshold_tokens, w.ttl_s) not in covered
            and w.name not in names]
