"""Did kvtune's predictions come true? The recommendation's expected TTFT p50 per mode and its
predicted share of reuse captured, set against what ``kvtune verify`` measured.

- **Per mode**: each measured configuration whose mode the recommendation priced (pull, push, or
  bidirectional at the recommended threshold and TTL: the settings the prediction assumed) gives
  measured p50 / predicted p50 - 1; within :data:`P50_TOLERANCE_SHARE` counts as held.
- **Ranking**: every pair of measured modes whose measured p50 intervals do not overlap must be
  ranked by the predictions in the measured order (one configuration per mode, the first
  measured); the mode kvtune ranks first is shown beside the measured fastest.
- **Reuse captured**: for the bidirectional configuration at the recommended settings, the history
  the router offered back from the decode that still held it (``kv.reuse.remote_tokens`` of its
  request spans) over the history of the turns that could be reused (turns after the first whose
  history reaches the threshold), against ``ttl.evidence.captured_share`` (the share of such
  history whose next turn comes within the router's TTL); within :data:`REUSE_TOLERANCE_POINTS`.
  What the prefill then pulls is less where its own prefix cache holds the history already
  (``reused_tokens``, from its counters, shown beside it).

The predictions describe the traffic kvtune was tuned on: they are comparable when the replayed
workload has the same shape (``kvtune verify --workload tune`` replays the embedded default's).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from kvtune.vllm_pd import MODES

if TYPE_CHECKING:  # results.py holds a PredictionCheck: no run-time import back
    from kvtune.local.workload import ConversationPlan
    from kvtune.verify.results import ConfigResult

P50_TOLERANCE_SHARE: Final = 0.10
"""A mode's measured p50 within 10% of its prediction counts as held."""
REUSE_TOLERANCE_POINTS: Final = 10.0
"""Measured share of reuse captured within 10 percentage points of the prediction."""


@dataclass(frozen=True)
class ModePrediction:
    config: str
    mode: str
    model: str
    """What predicted it: ``kvtune.sim`` or ``analytic`` (the recommendation's choice model)."""
    predicted_p50_ms: float
    measured_p50_ms: float | None
    measured_p50_ci_ms: tuple[float, float] | None
    error_share: float | None
    """measured / predicted - 1 (None: nothing measured)."""
    held: bool | None
    basis: str = "router"
    """The measured TTFT's basis (``ConfigResult.ttft_basis``: ``kvtune.verify.results``'
    ``TTFT_BASIS_*``)."""
    answer_hop_ms: float = 0.0
    """Taken off the recommendation's p50 to give ``predicted_p50_ms`` when the measurement
    ends at the decode's first step: the simulator's TTFT also carries the first token back to
    the client (``overheads.hop_ms``), which that measurement does not."""


@dataclass(frozen=True)
class ReusePrediction:
    config: str
    threshold_tokens: int | None
    ttl_s: float | None
    predicted_share: float
    reusable_history_tokens: int
    """History (prompt minus the turn's new tokens) of the later turns at or over the threshold."""
    offered_tokens: int | None
    """Of that history, what the router offered back (None: its spans carry no offers)."""
    reused_tokens: int | None
    """Tokens the prefill pulled back (its external-KV counter): the offered history its own
    prefix cache lacked."""
    measured_share: float | None
    """``offered_tokens / reusable_history_tokens``."""
    error_points: float | None
    held: bool | None


@dataclass(frozen=True)
class PredictionCheck:
    p50_tolerance_share: float
    reuse_tolerance_points: float
    modes: tuple[ModePrediction, ...]
    ranked_first: str | None
    """The mode kvtune recommends."""
    measured_best: str | None
    """Among the measured modes, the one with the lowest p50."""
    ranking_held: bool | None
    """Whether every pair of measured modes told apart (intervals not overlapping) is predicted
    in the measured order (None: no such pair)."""
    reuse: ReusePrediction | None
    ranked_pairs: tuple[tuple[str, str, bool], ...] = ()
    """(measured faster, measured slower, predicted in that order) per pair told apart."""

    def lines(self) -> list[str]:
        """Plain-text summary (CLI, page)."""
        out = []
        for m in self.modes:
            meas = "not measured" if m.measured_p50_ms is None else (
                f"measured {m.measured_p50_ms:.1f} ms ({m.error_share:+.0%}: "
                f"{'within' if m.held else 'outside'} {self.p50_tolerance_share:.0%})")
            hop = (f" (its TTFT less the {m.answer_hop_ms:.1f} ms hop back: measured to the "
                   f"decode's first step)" if m.answer_hop_ms else "")
            out.append(f"{m.mode} ({m.config}): predicted p50 {m.predicted_p50_ms:.1f} ms "
                       f"[{m.model}]{hop}, {meas}")
        if self.ranked_first is not None:
            pairs = "; ".join(f"{a} < {b}: {'predicted so' if ok else 'predicted the other way'}"
                              for a, b, ok in self.ranked_pairs)
            out.append(f"kvtune ranks {self.ranked_first} first; lowest measured p50: "
                       f"{self.measured_best or 'n/a'}; modes told apart by their measured "
                       f"intervals: {pairs or 'none'}"
                       + ("" if self.ranking_held is None else
                          f" (ranking {'holds' if self.ranking_held else 'does not hold'})"))
        r = self.reuse
        if r is not None:
            meas = "not measured" if r.measured_share is None else (
                f"measured {r.measured_share:.0%} ({r.offered_tokens} of "
                f"{r.reusable_history_tokens} reusable history tokens offered back, "
                f"{r.reused_tokens} pulled; {r.error_points:+.0f} points: "
                f"{'within' if r.held else 'outside'} {self.reuse_tolerance_points:.0f})")
            out.append(f"reuse captured at TTL {r.ttl_s:g} s ({r.config}): predicted "
                       f"{r.predicted_share:.0%}, {meas}")
        return out


def _get(d: Any, *path: str) -> Any:
    for k in path:
        d = d.get(k) if isinstance(d, Mapping) else None
    return d


def _rec_item(rec: Mapping[str, Any], key: str, short: str) -> Mapping[str, Any]:
    item = _get(rec, "recommendations", key)
    if not isinstance(item, Mapping):
        item = rec.get(short)
    return item if isinstance(item, Mapping) else {}


def _matches_recommended(cfg: ConfigResult, threshold: Any, ttl: Any) -> bool:
    c = cfg.config
    if c.mode != "bidirectional":
        return True
    return (isinstance(threshold, (int, float)) and c.recompute_threshold_tokens == int(threshold)
            and isinstance(ttl, (int, float)) and c.ttl_s is not None
            and abs(c.ttl_s - float(ttl)) < 1e-9)


def reusable_history(cfg: ConfigResult, plans: Sequence[ConversationPlan], *,
                     threshold_tokens: float) -> tuple[int, int | None]:
    """(history tokens, of which offered back) of the later turns that succeeded and whose
    history (prompt minus the turn's new user tokens) reaches ``threshold_tokens``; offered is
    None when no request carries the router's offer."""
    new = {f"{p.conversation_id}#{t.turn}": len(t.user_tokens) for p in plans for t in p.turns}
    total, offered, seen = 0, 0, False
    for r in cfg.requests:
        if r.turn <= 1 or not r.ok or r.turn_key not in new:
            continue
        history = r.prompt_tokens - new[r.turn_key]
        if history >= threshold_tokens:
            total += history
            if r.offered_tokens is not None:
                seen = True
                offered += min(r.offered_tokens, history)
    return total, offered if seen else None


def answer_hop_ms(evidence: Mapping[str, Any]) -> float:
    """The simulator's hop that carries the first token back (``overheads.hop_ms`` of the mode
    evidence's ``sim_inputs``); 0 for the analytic model or when not listed."""
    if str(evidence.get("model") or "") != "kvtune.sim":
        return 0.0
    for item in evidence.get("sim_inputs") or ():
        if isinstance(item, Mapping) and item.get("name") == "overheads.hop_ms" \
                and isinstance(item.get("value"), (int, float)):
            return float(item["value"])
    return 0.0


def check(recommendation: Mapping[str, Any], measured: Sequence[ConfigResult],
          plans: Sequence[ConversationPlan]) -> PredictionCheck | None:
    """The check of ``recommendation.json``'s predictions against ``measured`` (None when the
    recommendation holds no per-mode prediction)."""
    mode_item = _rec_item(recommendation, "mode", "mode")
    ev = mode_item.get("evidence") if isinstance(mode_item.get("evidence"), Mapping) else {}
    expected = ev.get("expected_ttft_ms") if isinstance(ev.get("expected_ttft_ms"), Mapping) else {}
    model = str(ev.get("model") or "kvtune.sim")
    thr = _rec_item(recommendation, "kv_recompute_threshold", "threshold").get("value")
    ttl_item = _rec_item(recommendation, "decoder_kv_blocks_ttl", "ttl")
    ttl = ttl_item.get("value")
    if not expected:
        return None
    from kvtune.verify.results import TTFT_BASIS_DECODE, TTFT_BASIS_ROUTER  # (it imports us)

    modes: list[ModePrediction] = []
    best: dict[str, float] = {}
    hop = answer_hop_ms(ev)
    for mode in MODES:
        pred = _get(expected, mode, "p50")
        if not isinstance(pred, (int, float)):
            continue
        cfg = next((c for c in measured if c.config.mode == mode
                    and _matches_recommended(c, thr, ttl)), None)
        basis = cfg.ttft_basis if cfg is not None else TTFT_BASIS_ROUTER
        off = hop if basis == TTFT_BASIS_DECODE else 0.0
        pred = float(pred) - off
        p50 = cfg.ttft_p50 if cfg is not None else None
        value = p50.value_ms if p50 is not None else None
        err = value / pred - 1.0 if value is not None and pred > 0 else None
        modes.append(ModePrediction(
            config=cfg.config.name if cfg is not None else "", mode=mode, model=model,
            predicted_p50_ms=pred, measured_p50_ms=value,
            measured_p50_ci_ms=(p50.low_ms, p50.high_ms) if p50 is not None else None,
            error_share=err, held=None if err is None else abs(err) <= P50_TOLERANCE_SHARE,
            basis=basis, answer_hop_ms=off))
        if value is not None:
            best[mode] = value
    first = mode_item.get("value")
    measured_best = min(best, key=best.__getitem__) if best else None
    pairs = ranked_pairs(modes)
    ranking = None if not pairs else all(ok for _, _, ok in pairs)
    reuse = None
    share = _get(ttl_item, "evidence", "captured_share")
    bidi = next((c for c in measured if c.config.mode == "bidirectional"
                 and _matches_recommended(c, thr, ttl)), None)
    if isinstance(share, (int, float)) and bidi is not None and isinstance(thr, (int, float)):
        denom, offered = reusable_history(bidi, plans, threshold_tokens=float(thr))
        got = min(1.0, offered / denom) if offered is not None and denom > 0 else None
        pts = 100.0 * (got - float(share)) if got is not None else None
        reuse = ReusePrediction(
            config=bidi.config.name, threshold_tokens=bidi.config.recompute_threshold_tokens,
            ttl_s=bidi.config.ttl_s, predicted_share=float(share),
            reusable_history_tokens=denom, offered_tokens=offered,
            reused_tokens=bidi.reused_tokens, measured_share=got, error_points=pts,
            held=None if pts is None else abs(pts) <= REUSE_TOLERANCE_POINTS)
    return PredictionCheck(P50_TOLERANCE_SHARE, REUSE_TOLERANCE_POINTS, tuple(modes),
                           first if isinstance(first, str) else None, measured_best, ranking,
                           reuse, pairs)


def ranked_pairs(modes: Sequence[ModePrediction]) -> tuple[tuple[str, str, bool], ...]:
    """Per pair of measured modes whose p50 intervals do not overlap: (faster, slower, whether
    the predictions put them in that order)."""
    got = [m for m in modes if m.measured_p50_ms is not None and m.measured_p50_ci_ms]
    out = []
    for i, a in enumerate(got):
        for b in got[i + 1:]:
            fast, slow = (a, b) if a.measured_p50_ms < b.measured_p50_ms else (b, a)
            if fast.measured_p50_ci_ms[1] < slow.measured_p50_ci_ms[0]:
                out.append((fast.mode, slow.mode, fast.predicted_p50_ms < slow.predicted_p50_ms))
    return tuple(out)
