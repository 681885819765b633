"""The measured cost of prefilling: how long computing R new tokens takes after a prefix of L.

Model (causal attention: new token ``i`` attends to ``L + i`` tokens)::

    ms = base_ms + R * per_token_ms + (R * L + R^2 / 2) / 1000 * per_token_prefix_us / 1000

``per_token_prefix_us`` is the attention term: microseconds per new token per 1000 tokens of
context. Fitted robustly (Huber on relative residuals, as the floor fit) from kvtune's ``kv.prefill``
spans (``kv.computed_tokens``, ``kv.cached_tokens``) or, failing those, vLLM's own ``llm_request``
spans (``gen_ai.latency.time_in_model_prefill`` seconds, ``gen_ai.usage.prompt_tokens``; those do
not say how much of the prompt was cached, so L = 0 and R = the whole prompt: prefix-cache hits make
that source overstate R). Every term is constrained non-negative.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvtune import spans as sc
from kvtune.analysis.fit import robust_irls
from kvtune.errors import AnalysisError

VLLM_REQUEST_SPAN = "llm_request"
"""Span name of vLLM's own per-request OpenTelemetry span (vllm/v1/engine/output_processor.py)."""
VLLM_PREFILL_TIME_S = "gen_ai.latency.time_in_model_prefill"
"""vLLM's attribute (vllm/tracing/utils.py): seconds spent in model prefill."""
VLLM_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
"""vLLM's attribute: prompt length in tokens."""
MIN_DISTINCT_LENGTHS = 3
"""Distinct computed-token counts needed to separate the per-token and attention terms."""


@dataclass(frozen=True)
class PrefillCost:
    """Fitted prefill cost (see module doc). ``source`` names the spans it came from."""

    per_token_ms: float
    per_token_prefix_us: float
    base_ms: float
    n_observations: int
    r2: float = float("nan")
    source: str = ""
    max_tokens_observed: int = 0
    per_token_ci_ms: tuple[float, float] | None = None
    """95% interval of ``per_token_ms`` (None: not estimated)."""
    per_token_prefix_ci_us: tuple[float, float] | None = None
    """95% interval of ``per_token_prefix_us``."""

    def predict_ms(self, new_tokens: float, prefix_tokens: float = 0) -> float:
        """Time to compute ``new_tokens`` tokens after ``prefix_tokens`` already-present ones."""
        attn = (new_tokens * prefix_tokens + new_tokens ** 2 / 2.0) / 1000.0
        return max(self.base_ms + new_tokens * self.per_token_ms
                   + attn * self.per_token_prefix_us / 1e3, 0.0)

    def recompute_ms(self, history_tokens: float) -> float:
        """Extra prefill time of recomputing a ``history_tokens`` prefix instead of having it: the
        base cost and the new tokens' own cost cancel out (attention of later tokens on the history
        is paid either way)."""
        r = float(history_tokens)
        return r * self.per_token_ms + (r ** 2 / 2.0) / 1000.0 * self.per_token_prefix_us / 1e3

    def as_dict(self) -> dict:
        return {"per_token_ms": self.per_token_ms, "per_token_prefix_us": self.per_token_prefix_us,
                "base_ms": self.base_ms, "n_observations": self.n_observations, "r2": self.r2,
                "source": self.source, "max_tokens_observed": self.max_tokens_observed,
                "per_token_ci_ms": self.per_token_ci_ms,
                "per_token_prefix_ci_us": self.per_token_prefix_ci_us}


def _observations(spans: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    name = spans["name"].astype("object")
    pre = spans[(name == sc.SpanName.PREFILL.value).to_numpy(dtype=bool)]
    if not pre.empty and sc.COMPUTED_TOKENS in pre.columns:
        computed = pre[sc.COMPUTED_TOKENS].astype("Float64")
        cached = pre[sc.CACHED_TOKENS].astype("Float64") if sc.CACHED_TOKENS in pre else None
        if sc.PROMPT_TOKENS in pre.columns and cached is not None:
            computed = computed.fillna(pre[sc.PROMPT_TOKENS].astype("Float64") - cached)
        cached = cached.fillna(0.0) if cached is not None else pd.Series(0.0, index=pre.index)
        ok = computed.notna() & (pre["status"].astype("object") != "ERROR")
        ok = ok.to_numpy(dtype=bool)
        if ok.any():
            return (computed[ok].to_numpy(dtype=float), cached[ok].to_numpy(dtype=float),
                    pre["duration_ms"].to_numpy(dtype=float)[ok], sc.SpanName.PREFILL.value)
    vll = spans[(name == VLLM_REQUEST_SPAN).to_numpy(dtype=bool)]
    r, ms = [], []
    for attrs in vll["attrs"] if "attrs" in vll else ():
        if not isinstance(attrs, dict):
            continue
        t, n = attrs.get(VLLM_PREFILL_TIME_S), attrs.get(VLLM_PROMPT_TOKENS)
        if t is None or n is None:
            continue
        try:
            r.append(float(n))
            ms.append(float(t) * 1e3)
        except (TypeError, ValueError):
            continue
    if not r:
        raise AnalysisError(
            f"prefill_cost: no prefill observations: need {sc.SpanName.PREFILL.value} spans with "
            f"{sc.COMPUTED_TOKENS} (or {sc.PROMPT_TOKENS} and {sc.CACHED_TOKENS}), or vLLM "
            f"{VLLM_REQUEST_SPAN} spans with {VLLM_PREFILL_TIME_S} and {VLLM_PROMPT_TOKENS}; got "
            f"{len(pre)} {sc.SpanName.PREFILL.value} and {len(vll)} {VLLM_REQUEST_SPAN} span(s)")
    return np.asarray(r), np.zeros(len(r)), np.asarray(ms), VLLM_REQUEST_SPAN


def prefill_cost(spans: pd.DataFrame) -> PrefillCost:
    """Fit :class:`PrefillCost` from the spans (see module doc). Raises :class:`AnalysisError` with
    no prefill observations or fewer than ``MIN_DISTINCT_LENGTHS`` distinct lengths."""
    if "name" not in spans.columns:
        raise AnalysisError("prefill_cost: spans frame has no 'name' column; expected the shape of "
                            "kvtune.traces.load")
    r, prefix, ms, source = _observations(spans)
    keep = (r > 0) & np.isfinite(ms) & (ms >= 0)
    r, prefix, ms = r[keep], prefix[keep], ms[keep]
    n_len = len(np.unique(r))
    if n_len < MIN_DISTINCT_LENGTHS:
        raise AnalysisError(
            f"prefill_cost: {len(r)} prefill observation(s) from {source} spans at {n_len} distinct "
            f"computed-token count(s) {sorted(set(r.astype(int).tolist()))[:5]}; need >= "
            f"{MIN_DISTINCT_LENGTHS} distinct lengths: send {MIN_DISTINCT_LENGTHS - n_len} more "
            f"prompt length(s), e.g. 4x and 16x the longest")
    attn = (r * prefix + r ** 2 / 2.0) / 1000.0
    x = np.column_stack([np.ones_like(r), r, attn])
    # Costs are non-negative: drop the most negative term and refit until none is (active set).
    active = [0, 1, 2]
    while True:
        b_act, w = robust_irls(x[:, active], ms)
        if b_act.min() >= 0 or len(active) == 1:
            break
        active.pop(int(np.argmin(b_act)))
    beta = np.zeros(3)
    beta[active] = b_act
    if beta[1] <= 0 and beta[2] <= 0:
        raise AnalysisError(
            f"prefill_cost: prefill time does not grow with tokens in {len(r)} {source} "
            f"observation(s) ({int(r.min())}..{int(r.max())} tokens): the token counts do not "
            f"describe the work done (prefix-cache hits in vLLM llm_request spans?); use "
            f"{sc.SpanName.PREFILL.value} spans with {sc.COMPUTED_TOKENS}")
    fitted = x @ beta
    ybar = float(np.sum(w * ms) / np.sum(w))
    ss_tot = float(np.sum(w * (ms - ybar) ** 2))
    r2 = 1.0 - float(np.sum(w * (ms - fitted) ** 2)) / ss_tot if ss_tot > 0 else 0.0
    half = _half_widths(x, ms, beta, w, active)
    return PrefillCost(per_token_ms=float(beta[1]), per_token_prefix_us=float(beta[2]) * 1e3,
                       base_ms=float(beta[0]), n_observations=int(len(r)), r2=r2, source=source,
                       max_tokens_observed=int(np.max(r + prefix)),
                       per_token_ci_ms=_interval(beta[1], half[1]),
                       per_token_prefix_ci_us=_interval(beta[2] * 1e3, half[2] * 1e3))


Z_95 = 1.96
"""Normal quantile of a two-sided 95% interval."""


def _half_widths(x: np.ndarray, y: np.ndarray, beta: np.ndarray, w: np.ndarray,
                 active: list[int]) -> np.ndarray:
    """95% half-widths of the coefficients from the robust fit's final weighted least squares on
    relative residuals (weights ``w / fitted^2``): ``Z_95 * sqrt(diag(s^2 (X'WX)^-1))``. Terms
    fixed at 0 by the non-negativity constraint get 0; too few points give NaN."""
    out = np.zeros(x.shape[1])
    fitted = np.maximum(x @ beta, 1e-9)
    xa = x[:, active]
    dof = float(np.sum(w > 0)) - len(active)
    if dof <= 0:
        out[active] = np.nan
        return out
    rel = (y - fitted) / fitted
    s2 = float(np.sum(w * rel ** 2)) / dof
    ww = w / fitted ** 2
    try:
        cov = s2 * np.linalg.inv(xa.T @ (xa * ww[:, None]))
    except np.linalg.LinAlgError:
        out[active] = np.nan
        return out
    out[active] = Z_95 * np.sqrt(np.clip(np.diag(cov), 0.0, None))
    return out


def _interval(value: float, half: float) -> tuple[float, float] | None:
    """(value - half, value + half), clipped at 0 (a cost); None when ``half`` is not known."""
    if not np.isfinite(half):
        return None
    return (max(0.0, float(value - half)), float(value + half))


@dataclass(frozen=True)
class LocalPrefixHits:
    """What the prefills' own prefix caches held for later turns: ``kv.cached_tokens`` of each
    later turn's ``kv.prefill`` span minus the history pulled back from a decode for it
    (reverse transfers' ``kv.tokens``)."""

    later_turns: int
    """Later turns (turn >= 2) with a ``kv.prefill`` span carrying ``kv.cached_tokens``."""
    turns_with_local_hits: int
    local_tokens: int

    @property
    def prefix_caching(self) -> bool | None:
        """Whether the prefills cache prefixes (None: no later turn to tell by)."""
        return None if self.later_turns == 0 else self.turns_with_local_hits > 0


def local_prefix_hits(spans: pd.DataFrame, transfers: pd.DataFrame) -> LocalPrefixHits:
    """The prefills' local prefix hits on later turns (see :class:`LocalPrefixHits`);
    ``transfers`` is ``kvtune.analysis.transfers(spans)``."""
    need = {sc.CONVERSATION_ID, sc.TURN, sc.CACHED_TOKENS}
    if spans.empty or not need <= set(spans.columns):
        return LocalPrefixHits(0, 0, 0)
    pre = spans[(spans["name"].astype("object") == sc.SpanName.PREFILL.value).to_numpy(dtype=bool)]
    pre = pre[(pre[sc.TURN].astype("Float64") >= 2).fillna(False).to_numpy(dtype=bool)
              & pre[sc.CACHED_TOKENS].notna().to_numpy(dtype=bool)
              & pre[sc.CONVERSATION_ID].notna().to_numpy(dtype=bool)]
    if pre.empty:
        return LocalPrefixHits(0, 0, 0)
    pulled: dict[tuple[str, int], float] = {}
    if not transfers.empty and {"direction", "conversation_id", "turn", "tokens"} <= set(
            transfers.columns):
        rev = transfers[(transfers["direction"].astype("object")
                         == sc.Direction.REVERSE.value).to_numpy(dtype=bool)]
        for conv, turn, tok in zip(rev["conversation_id"], rev["turn"], rev["tokens"]):
            if pd.notna(conv) and pd.notna(turn) and pd.notna(tok):
                key = (str(conv), int(turn))
                pulled[key] = pulled.get(key, 0.0) + float(tok)
    local = [max(0.0, float(c) - pulled.get((str(conv), int(t)), 0.0))
             for conv, t, c in zip(pre[sc.CONVERSATION_ID], pre[sc.TURN], pre[sc.CACHED_TOKENS])]
    return LocalPrefixHits(len(local), sum(v > 0 for v in local), int(sum(local)))
