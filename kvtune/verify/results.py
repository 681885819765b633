"""What ``kvtune verify`` measured: frozen dataclasses with units in the field names, and their
JSON form (``verify.json``, :data:`RESULT_FORMAT`). :func:`result_from_json` reads it back, so the
tune report, the notebook and the tests read the same file."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvtune.errors import ConfigError
from kvtune.verify.configs import VerifyConfig
from kvtune.verify.predictions import ModePrediction, PredictionCheck, ReusePrediction
from kvtune.verify.stats import CrossoverEstimate, PairedChange, QuantileEstimate

RESULT_FORMAT: Final = "kvtune.verify/1"
RESULT_FILE: Final = "verify.json"
PAGE_FILE: Final = "verify.html"
MAX_RESULT_BYTES: Final = 64 * 1024 * 1024
TTFT_BASIS_DECODE: Final = "decode_first_step"
"""TTFT measured to the decode's first step: the router's ``kv.request`` began -> the decode's
``kv.decode_start`` ended (the request scheduled for its first token, its KV in place). Every
mode's KV path is inside it, as in the simulator's TTFT (less the answer's hop back)."""
TTFT_BASIS_ROUTER: Final = "router"
"""TTFT as the router saw it (``kv.ttft_ms``): for a non-streamed request, the prefill's answer,
before any KV reached the decode."""


@dataclass(frozen=True)
class RequestMeasurement:
    """One request of the replayed workload under one configuration."""

    conversation_id: str
    turn: int
    prompt_tokens: int
    ttft_ms: float | None
    """On the configuration's ``ttft_basis``: request in at the router -> the decode scheduled the
    request's first decode step (all its KV in place), from the router's and the decode's spans;
    else the router's ``kv.ttft_ms``."""
    latency_ms: float
    ok: bool
    error: str = ""
    offered_tokens: int | None = None
    """History the router offered the prefill back from the decode that retained it
    (``kv.reuse.remote_tokens`` of its ``kv.request`` span; None: not traced)."""
    router_ttft_ms: float | None = None
    """The router's ``kv.ttft_ms`` (non-streamed: the prefill's answer), beside ``ttft_ms`` when
    that is measured to the decode's first step."""
    prefill_cached_tokens: int | None = None
    """Prompt tokens the prefill did not compute (``kv.cached_tokens`` of its ``kv.prefill``
    span: its own prefix cache's hits plus any history pulled back; None: not traced)."""
    start: int = 0
    """Which start of the configuration's deployment served it (0, 1, ...: each configuration
    is measured over one or more starts, in alternating order with the others)."""

    @property
    def turn_key(self) -> str:
        """The turn of the workload (the same in every start)."""
        return f"{self.conversation_id}#{self.turn}"

    @property
    def key(self) -> str:
        """Matches the same request under another configuration, in the same start."""
        return self.turn_key if self.start == 0 else f"{self.turn_key}@{self.start}"


@dataclass(frozen=True)
class MemorySample:
    t_s: float
    """Seconds since the configuration's replay started."""
    decode_kv_usage_pct: float
    """vLLM's ``vllm:kv_cache_usage_perc`` on the decode instance(s), 0..100."""


@dataclass(frozen=True)
class ConfigResult:
    config: VerifyConfig
    requests: tuple[RequestMeasurement, ...]
    ttft_p50: QuantileEstimate | None
    ttft_p99: QuantileEstimate | None
    turn2plus_prompt_tokens: int
    """Prompt tokens of every turn after a conversation's first (what reuse could serve)."""
    reused_tokens: int | None
    """Prompt tokens the prefill loaded through the KV connector during the replay (its
    ``external_kv_transfer`` counter): history pulled back from the decode. None: not readable."""
    reuse_captured_share: float | None
    """``reused_tokens / turn2plus_prompt_tokens``."""
    memory: tuple[MemorySample, ...]
    decode_kv_usage_mean_pct: float | None
    decode_kv_usage_max_pct: float | None
    decode_kv_blocks_total: int | None
    """The decode's KV blocks (``num_gpu_blocks`` of ``vllm:cache_config_info``), when shown."""
    wall_s: float
    ttft_basis: str = TTFT_BASIS_ROUTER
    """What ``ttft_ms`` measures: :data:`TTFT_BASIS_DECODE` or :data:`TTFT_BASIS_ROUTER`."""

    @property
    def n_failed(self) -> int:
        return sum(not r.ok for r in self.requests)

    starts: int = 1
    """Starts of the deployment the requests came from."""

    def ttft_by_key(self) -> dict[str, float]:
        return {r.key: r.ttft_ms for r in self.requests if r.ok and r.ttft_ms is not None}

    def start_by_key(self) -> dict[str, int]:
        return {r.key: r.start for r in self.requests}


@dataclass(frozen=True)
class Comparison:
    baseline: str
    candidate: str
    p50: PairedChange | None
    p99: PairedChange | None
    verdict: str


@dataclass(frozen=True)
class CrossoverPoint:
    history_tokens: int
    reuse: str
    """``"on"`` (the router offered the history back; threshold 1: pulled) or ``"off"`` (offered
    none: recomputed)."""
    ttft_ms: float
    offered_tokens: int | None = None
    """History the router offered back for this turn (None: not traced, or an older file)."""
    prefill_cached_tokens: int | None = None
    """Prompt tokens the prefill did not compute for this turn (its own cache's hits plus any
    history pulled back; None: not traced, or an older file)."""


@dataclass(frozen=True)
class CrossoverResult:
    points: tuple[CrossoverPoint, ...]
    estimate: CrossoverEstimate
    recommended_threshold_tokens: float | None
    recommended_range_tokens: tuple[float, float] | None
    predicted_break_even_tokens: float | None
    inside_range: bool | None
    """Whether the measured crossover lies inside the recommended range (None: not comparable)."""
    local_hits: int = 0
    """Reuse-off turns left out: the prefill's own cache held a block or more of the history
    (it did not lack it, as the sweep needs)."""
    not_offered: int = 0
    """Reuse-on turns left out: the router offered no history (it had expired)."""
    deployment: str = ""
    """Where the sweep ran (a deployment of its own, or after a configuration's replay)."""
    unresolved_tokens: tuple[int, ...] = ()
    """Lengths whose difference stayed unresolved at the repeats allowed."""


@dataclass(frozen=True)
class VerifyResult:
    format: str
    created_utc: str
    kvtune_version: str
    target: str
    workload: str
    configs: tuple[ConfigResult, ...]
    comparisons: tuple[Comparison, ...]
    crossover: CrossoverResult | None = None
    predictions: PredictionCheck | None = None
    """The recommendation's predictions against these measurements (``kvtune.verify.predictions``);
    None without a recommendation."""


def to_json(result: VerifyResult) -> dict[str, Any]:
    return _plain(dataclasses.asdict(result))


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, float) and v != v:
        return None
    return v


def write(result: VerifyResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(to_json(result), indent=1))
    tmp.replace(path)
    return path


def read(path: str | Path) -> VerifyResult:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"verify result {path}: no such file")
    if path.stat().st_size > MAX_RESULT_BYTES:
        raise ConfigError(f"verify result {path}: larger than {MAX_RESULT_BYTES} bytes")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"verify result {path}: expected JSON: {exc}") from None
    return result_from_json(data, source=str(path))


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object for {cls.__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in data.items() if k in names})
    except TypeError as exc:
        raise ConfigError(f"{where}: {cls.__name__}: {exc}") from None


def _tuple_fields(obj: Any, **names: Any) -> Any:
    return dataclasses.replace(obj, **{k: tuple(v) if isinstance(v, list) else v
                                       for k, v in names.items()})


def result_from_json(data: Any, *, source: str = "verify result") -> VerifyResult:
    if not isinstance(data, dict) or data.get("format") != RESULT_FORMAT:
        raise ConfigError(f"{source}: field 'format': expected {RESULT_FORMAT!r}, got "
                          f"{data.get('format') if isinstance(data, dict) else data!r}"[:300])
    configs = []
    for i, c in enumerate(data.get("configs") or []):
        w = f"{source}: configs[{i}]"
        if not isinstance(c, dict):
            raise ConfigError(f"{w}: expected an object")
        q = {k: _build(QuantileEstimate, c[k], f"{w}.{k}") if c.get(k) is not None else None
             for k in ("ttft_p50", "ttft_p99")}
        configs.append(_build(ConfigResult, {
            **c, **q, "config": _build(VerifyConfig, c.get("config"), f"{w}.config"),
            "requests": tuple(_build(RequestMeasurement, r, f"{w}.requests")
                              for r in c.get("requests") or []),
            "memory": tuple(_build(MemorySample, m, f"{w}.memory") for m in c.get("memory") or [])},
            w))
    comps = []
    for i, c in enumerate(data.get("comparisons") or []):
        w = f"{source}: comparisons[{i}]"
        if not isinstance(c, dict):
            raise ConfigError(f"{w}: expected an object")
        comps.append(_build(Comparison, {
            **c, **{k: _build(PairedChange, c[k], f"{w}.{k}") if c.get(k) is not None else None
                    for k in ("p50", "p99")}}, w))
    cross = None
    if data.get("crossover") is not None:
        cd, w = data["crossover"], f"{source}: crossover"
        if not isinstance(cd, dict):
            raise ConfigError(f"{w}: expected an object")
        est = _tuple_fields(_build(CrossoverEstimate, cd.get("estimate"), f"{w}.estimate"),
                            lengths_tokens=cd["estimate"].get("lengths_tokens", ()),
                            diff_p50_ms=cd["estimate"].get("diff_p50_ms", ()))
        rng = cd.get("recommended_range_tokens")
        cross = _build(CrossoverResult, {
            **cd, "estimate": est, "unresolved_tokens": tuple(cd.get("unresolved_tokens") or ()),
            "points": tuple(_build(CrossoverPoint, p, f"{w}.points")
                            for p in cd.get("points") or []),
            "recommended_range_tokens": tuple(rng) if isinstance(rng, list) else rng}, w)
    preds = None
    if data.get("predictions") is not None:
        pd_, w = data["predictions"], f"{source}: predictions"
        if not isinstance(pd_, dict):
            raise ConfigError(f"{w}: expected an object")
        modes = tuple(
            _build(ModePrediction, {**m, "measured_p50_ci_ms": tuple(m["measured_p50_ci_ms"])
                                    if isinstance(m, dict) and isinstance(
                                        m.get("measured_p50_ci_ms"), list)
                                    else (m.get("measured_p50_ci_ms") if isinstance(m, dict)
                                          else None)}, f"{w}.modes")
            for m in pd_.get("modes") or [])
        reuse = (_build(ReusePrediction, pd_["reuse"], f"{w}.reuse")
                 if pd_.get("reuse") is not None else None)
        pairs = tuple(tuple(x) for x in pd_.get("ranked_pairs") or ()
                      if isinstance(x, list) and len(x) == 3)
        preds = _build(PredictionCheck, {**pd_, "modes": modes, "reuse": reuse,
                                         "ranked_pairs": pairs}, w)
    return _build(VerifyResult, {**data, "configs": tuple(configs), "comparisons": tuple(comps),
                                 "crossover": cross, "predictions": preds}, source)
