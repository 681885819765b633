"""The evidence behind each recommendation, as typed frozen dataclasses.

Each serialises (``as_dict``) to the same JSON object ``recommendation.json`` has always carried
under ``recommendations.<name>.evidence``; fields marked ``omit_none`` are left out of the JSON
when they are ``None`` (they only exist in some cases, e.g. the break-even costs when there is a
break-even). Readers in Python use the attributes; readers of the JSON the keys, which are the
field names.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from kvtune.sim.calibrate import SimInput

OMIT_NONE = {"omit_none": True}
"""Field metadata: leave the key out of the JSON when the value is None."""


def plain(value: Any) -> Any:
    """JSON-safe copy: tuples -> lists, NaN/inf -> None, objects with ``as_dict`` -> dicts."""
    if hasattr(value, "as_dict"):
        return plain(value.as_dict())
    if isinstance(value, dict):
        return {str(getattr(k, "value", k)): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalar
        return plain(value.item())
    return value


def evidence_dict(obj: Any) -> dict[str, Any]:
    """The JSON object of an evidence dataclass: its fields in order, ``omit_none`` ones left out
    when None."""
    assert is_dataclass(obj)
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value is None and f.metadata.get("omit_none"):
            continue
        out[f.name] = plain(value)
    return out


@dataclass(frozen=True)
class ThresholdEvidence:
    """Why ``kv_recompute_threshold`` is what it is (``kvtune.recommend.threshold``)."""

    break_even_tokens: float | None
    """Tokens of history at which pulling costs what recomputing does; None: never."""
    floor_ms: float
    bandwidth_gbps: float
    per_descriptor_us: float | None
    bytes_per_token: float
    descriptors_per_token: float
    wire_ms_per_token: float
    prefill_per_token_ms: float
    prefill_per_token_prefix_us: float
    max_context_tokens: int
    fit_r2: float
    fit_n_transfers: int
    prefill_n_observations: int
    pull_ms_at_break_even: float | None = field(default=None, metadata=OMIT_NONE)
    recompute_ms_at_break_even: float | None = field(default=None, metadata=OMIT_NONE)
    prefill_per_token_ci_ms: tuple[float, float] | None = None
    """95% interval of the prefill fit's per-token term (None: not known)."""
    prefill_per_token_prefix_ci_us: tuple[float, float] | None = None
    break_even_range_fabric_tokens: tuple[float | None, float | None] | None = None
    """Break-even over the fabric fit's intervals alone (prefill at its fitted value)."""
    break_even_range_prefill_tokens: tuple[float | None, float | None] | None = None
    """Break-even over the prefill fit's intervals alone (fabric at its fitted value)."""
    pickup_ms: float | None = field(default=None, metadata=OMIT_NONE)
    """Added to the fabric floor: a pulled-back history's wait from its READ done to the engine's
    next step picking the request up (None: not measured, not priced)."""
    pickup_ci_ms: tuple[float, float] | None = field(default=None, metadata=OMIT_NONE)
    pickup_source: str | None = field(default=None, metadata=OMIT_NONE)

    def as_dict(self) -> dict[str, Any]:
        return evidence_dict(self)


@dataclass(frozen=True)
class TtlEvidence:
    """Why ``decoder_kv_blocks_ttl`` is what it is (``kvtune.recommend.ttl``). Without gaps between
    turns only the first fields and ``router_*`` / ``captured_share`` are set."""

    n_gaps: int
    hbm_budget_gb: float
    bytes_per_token: float
    threshold_tokens: float
    duration_s: float
    peak_to_mean: float
    gap_s_p50: float | None = field(default=None, metadata=OMIT_NONE)
    gap_s_p90: float | None = field(default=None, metadata=OMIT_NONE)
    gap_s_max: float | None = field(default=None, metadata=OMIT_NONE)
    uncapped_ttl_s: float | None = field(default=None, metadata=OMIT_NONE)
    memory_cap_ttl_s: float | None = None
    """The largest TTL the HBM budget allows; None when the budget does not cap it (left out of
    the JSON when there are no gaps)."""
    retained_gb_at_ttl: float | None = field(default=None, metadata=OMIT_NONE)
    captured_share: float = 0.0
    captured_share_uncapped: float | None = field(default=None, metadata=OMIT_NONE)
    router_decoder_ttl_s: int | None = None
    router_margin_s: float | None = None
    router_params_ttl_s: float | None = field(default=None, metadata=OMIT_NONE)

    def as_dict(self) -> dict[str, Any]:
        out = evidence_dict(self)
        if self.n_gaps == 0:
            out.pop("memory_cap_ttl_s", None)
        return out


@dataclass(frozen=True)
class TtftMs:
    """Expected TTFT of one mode, ms."""

    p50: float
    p99: float

    def as_dict(self) -> dict[str, Any]:
        return {"p50": plain(self.p50), "p99": plain(self.p99)}


@dataclass(frozen=True)
class ModeEvidence:
    """Why the transfer mode is what it is (``kvtune.recommend.mode``). ``expected_ttft_ms`` is
    what the choice used (``model``); ``analytic_ttft_ms`` the analytic model's view, kept beside
    it; ``sim_inputs`` every number the simulator played, with its source."""

    model: str
    excluded: Mapping[str, str]
    expected_ttft_ms: Mapping[str, TtftMs] | None = field(default=None, metadata=OMIT_NONE)
    analytic_ttft_ms: Mapping[str, TtftMs] | None = field(default=None, metadata=OMIT_NONE)
    allowed: tuple[str, ...] | None = field(default=None, metadata=OMIT_NONE)
    multi_turn_share: float | None = field(default=None, metadata=OMIT_NONE)
    prompt_tokens_p50: float | None = field(default=None, metadata=OMIT_NONE)
    qps: float | None = field(default=None, metadata=OMIT_NONE)
    early_decode_ok: bool | None = field(default=None, metadata=OMIT_NONE)
    prefill_utilisation_pull: float | None = field(default=None, metadata=OMIT_NONE)
    reused_share_bidirectional: float | None = field(default=None, metadata=OMIT_NONE)
    analytic_best: str | None = field(default=None, metadata=OMIT_NONE)
    """The mode the analytic model alone would pick (same rule, same allowed modes)."""
    simulated_best: str | None = field(default=None, metadata=OMIT_NONE)
    """The mode the simulator alone would pick; None when it did not run."""
    models_agree: bool | None = field(default=None, metadata=OMIT_NONE)
    sim_inputs: tuple[SimInput, ...] | None = field(default=None, metadata=OMIT_NONE)
    simulated_ttft_ms: Mapping[str, TtftMs] | None = field(default=None, metadata=OMIT_NONE)
    """The simulator's own TTFT per mode, where measurements changed ``expected_ttft_ms``."""
    ttft_sources: Mapping[str, str] | None = field(default=None, metadata=OMIT_NONE)
    """Per mode, where its ``expected_ttft_ms`` came from (measured, or the simulator scaled)."""
    sim_scale: float | None = field(default=None, metadata=OMIT_NONE)
    """Measured / simulated TTFT (to the decode's first step) of the traced main mode: what the
    simulated modes were multiplied by."""

    def as_dict(self) -> dict[str, Any]:
        return evidence_dict(self)


@dataclass(frozen=True)
class LeaseEvidence:
    """Why ``kv_lease_duration`` is what it is (``kvtune.recommend.prefill_lease``): the prefill's
    holds of finished requests' blocks (``kvtune.analysis.prefill_lease``)."""

    n_holds: int
    n_read: int
    n_expired: int
    n_released: int
    n_near_expiry: int
    lease_s_in_force: float
    quantile: float
    headroom: float
    read_delay_s_p50: float | None = field(default=None, metadata=OMIT_NONE)
    read_delay_s_p99: float | None = field(default=None, metadata=OMIT_NONE)
    read_delay_s_max: float | None = field(default=None, metadata=OMIT_NONE)
    read_margin_s_min: float | None = field(default=None, metadata=OMIT_NONE)
    read_renewals: int = 0
    source: str = ""

    def as_dict(self) -> dict[str, Any]:
        return evidence_dict(self)


Evidence = ThresholdEvidence | TtlEvidence | ModeEvidence | LeaseEvidence


class JsonEvidence(Mapping):
    """Evidence read back from JSON (a saved tuning, ``kvtune.recommend.saved``): the same keys as
    the dataclass's JSON, readable by attribute too (``ev.router_params_ttl_s``, nested
    ``ev.expected_ttft_ms["pull"].p50``), so code written for the typed evidence draws a saved
    tuning unchanged. ``as_dict()`` gives the JSON back."""

    __slots__ = ("_d",)

    def __init__(self, d: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_d", dict(d))

    @staticmethod
    def wrap(value: Any) -> Any:
        if isinstance(value, Mapping):
            return JsonEvidence(value)
        if isinstance(value, list):
            return tuple(JsonEvidence.wrap(v) for v in value)
        return value

    def __getattr__(self, name: str) -> Any:
        try:
            return JsonEvidence.wrap(self._d[name])
        except KeyError:
            if name.startswith("__"):
                raise AttributeError(name) from None
            return None  # an omit_none field that was None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("JsonEvidence is read-only")

    def __getitem__(self, key: str) -> Any:
        return JsonEvidence.wrap(self._d[key])

    def __iter__(self):
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def as_dict(self) -> dict[str, Any]:
        return plain(self._d)

    def __repr__(self) -> str:
        return f"JsonEvidence({self._d!r})"
