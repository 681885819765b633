"""The top of the report: the three values with ranges, why, how sure, and how to apply them.

Built from ``recommendation.json`` (what the tune notebook exported), so the page says exactly
what the files say. Numbers go through :mod:`kvtune.tune.numbers`.
"""
from __future__ import annotations

import html
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune.recommend.results import MODE_NAME, NEVER
from kvtune.tune.numbers import fmt_num, fmt_share, fmt_value
from kvtune.recommend.retention import POLICY_FIXED_TTL, POLICY_LEASE
from kvtune.vllm_pd import DECODER_KV_BLOCKS_TTL, KV_RECOMPUTE_THRESHOLD

THRESHOLD = KV_RECOMPUTE_THRESHOLD
TTL = DECODER_KV_BLOCKS_TTL
MODE = MODE_NAME
GOOD_R2 = 0.9
"""A floor fit with R^2 at or above this explains transfer time well (below: say it is weak)."""
MIN_TRANSFERS = 30
"""Fewer fitted transfers than this make the intervals wide; the page says so."""
LAB_KEY = "lab"
"""Key of ``recommendation.json`` naming the lab regime kvtune's own spans were made in
(``kvtune.tune.run`` writes it; ``{"regime": "fleet", "why": "..."}``)."""
VERIFY_KEY = "verification"
"""Key of ``recommendation.json`` that a verification run fills (see :class:`Verification`)."""


@dataclass(frozen=True)
class ValueCard:
    """One recommended value as the page shows it (texts already rounded)."""

    name: str
    value_text: str
    unit: str
    range_text: str
    why: str
    exact_text: str = ""
    """What the config files hold when the rounded value differs (``"523 in the config files"``)."""


@dataclass(frozen=True)
class Verification:
    """Whether a measured run confirmed the values. Filled from ``recommendation.json``'s
    ``verification`` object by ``kvtune verify --tune-dir`` (:mod:`kvtune.verify.tune_link`):
    ``{"status": "verified: faster than defaults", "ttft_p50_change_pct": -12.0, "detail": "..."}``."""

    status: str
    ttft_p50_change_pct: float | None = None
    detail: str = ""

    @classmethod
    def from_json(cls, data: Any) -> Verification:
        if not isinstance(data, Mapping) or not data.get("status"):
            return cls("not verified", None, "kvtune verify has not been run on these values; "
                                             "they rest on the traced runs and kvtune's cost model only")
        pct = data.get("ttft_p50_change_pct")
        return cls(str(data["status"]), float(pct) if isinstance(pct, (int, float)) else None,
                   str(data.get("detail") or ""))

    def text(self) -> str:
        out = f"Verification: {self.status}"
        if self.ttft_p50_change_pct is not None:
            word = "lower" if self.ttft_p50_change_pct < 0 else "higher"
            out += (f", TTFT p50 {fmt_num(abs(self.ttft_p50_change_pct), 3)}% {word} than under "
                    f"vLLM's defaults")
        return out + (f" — {self.detail}" if self.detail else "")


@dataclass(frozen=True)
class Headline:
    model: str
    model_source: str
    model_known: bool
    cards: tuple[ValueCard, ...]
    confidence: tuple[str, ...]
    verification: Verification
    commands: tuple[str, ...]
    findings: tuple[dict[str, Any], ...]


def _evidence(rec: Mapping[str, Any], name: str) -> dict[str, Any]:
    return dict((rec.get("recommendations", {}).get(name) or {}).get("evidence") or {})


def _threshold_card(r: Mapping[str, Any]) -> ValueCard:
    value, rng, ev = r.get("value"), list(r.get("range") or (None, None)), r.get("evidence") or {}
    v, lo, hi = fmt_value(value, rng[0], rng[1])
    if value == NEVER:
        why = ("Pulling history back never costs less than recomputing it on this traffic "
               f"(longest history {fmt_num(ev.get('max_context_tokens'))} tokens): always "
               "recompute, bidirectional transfer off.")
        return ValueCard(THRESHOLD, "never", "(always recompute)", f"range {lo} – {hi}", why)
    be, pull = ev.get("break_even_tokens"), ev.get("pull_ms_at_break_even")
    if be is not None and pull is not None:
        why = (f"Pulling about {v} tokens of history back costs {fmt_num(pull)} ms, as much as "
               f"recomputing them: longer histories are pulled, shorter ones recomputed.")
    else:
        why = "Break-even between pulling history back and recomputing it."
    return ValueCard(THRESHOLD, v, "tokens", f"range {lo} – {hi} tokens", why,
                     _exact(value, v))


def _exact(value: Any, shown: str) -> str:
    written = fmt_num(value, 4) if isinstance(value, (int, float)) else str(value)
    return "" if written == shown else f"{written} in the config files"


def _retention_text(ret: Mapping[str, Any] | None) -> str:
    """The TTL card's sentence on fixed TTL vs the renewable lease (``retention`` in
    ``recommendation.json``); empty when not compared."""
    if not ret:
        return ""
    bs, cs = ret.get("block_s") or {}, ret.get("captured_share") or {}
    ttl_bs, lease_bs = bs.get(POLICY_FIXED_TTL), bs.get(POLICY_LEASE)
    if ret.get("policy") == POLICY_LEASE:
        return (f" Renewable lease recommended: renewed every {fmt_num(ret.get('renew_every_s'))} s "
                f"for {fmt_num(ret.get('lease_s'))} s while the conversation is live, it keeps "
                f"{fmt_share(cs.get(POLICY_LEASE))} of that history for {fmt_num(lease_bs)} block-s "
                f"against the fixed TTL's {fmt_num(ttl_bs)}.")
    return (f" A renewable lease would hold {fmt_num(lease_bs)} block-s against the fixed TTL's "
            f"{fmt_num(ttl_bs)}: the fixed TTL stays ({(ret.get('evidence') or {}).get('why')}).")


def _ttl_card(r: Mapping[str, Any], retention: Mapping[str, Any] | None = None) -> ValueCard:
    value, rng, ev = r.get("value"), list(r.get("range") or (None, None)), r.get("evidence") or {}
    v, lo, hi = fmt_value(value, rng[0], rng[1])
    if ev.get("captured_share") is not None and ev.get("retained_gb_at_ttl") is not None:
        why = (f"Keeps {fmt_share(ev['captured_share'])} of reusable next-turn history (gaps p50 "
               f"{fmt_num(ev.get('gap_s_p50'))} s, p90 {fmt_num(ev.get('gap_s_p90'))} s) for about "
               f"{fmt_num(ev['retained_gb_at_ttl'])} GB of decode memory (budget "
               f"{fmt_num(ev.get('hbm_budget_gb'))} GB); the router forgets after "
               f"{fmt_num(ev.get('router_params_ttl_s'))} s.")
    else:
        why = "No conversation in the trace came back for a second turn: nothing is worth keeping."
    return ValueCard(TTL, v, "s", f"range {lo} – {hi} s", why + _retention_text(retention),
                     _exact(value, v))


def _mode_card(r: Mapping[str, Any]) -> ValueCard:
    value, rng, ev = str(r.get("value")), list(r.get("range") or (None, None)), r.get("evidence") or {}
    runner = str(rng[1]) if len(rng) > 1 and rng[1] else value
    ttft = ev.get("expected_ttft_ms") or {}
    if value in ttft and runner in ttft and runner != value:
        why = (f"Expected TTFT p50 {fmt_num(ttft[value].get('p50'))} ms (p99 "
               f"{fmt_num(ttft[value].get('p99'))} ms) against {fmt_num(ttft[runner].get('p50'))} ms "
               f"for {runner} ({ev.get('model', 'model')} on the traced workload).")
    elif ev.get("excluded"):
        why = "The other modes do not apply here: " + "; ".join(
            f"{m}: {reason}" for m, reason in ev["excluded"].items()) + "."
    else:
        why = "Pull is the default when nothing beats it by a clear margin."
    range_text = f"runner-up: {runner}" if runner != value else "no other mode applies"
    return ValueCard(MODE, value, "", range_text, why)


def _confidence(rec: Mapping[str, Any]) -> tuple[str, ...]:
    lines = []
    lab = rec.get(LAB_KEY)
    if isinstance(lab, Mapping) and lab.get("regime"):
        lines.append(f"Measured on this machine's lab in its {lab['regime']} regime: "
                     f"{lab.get('why') or ''}.")
    fq, fit = rec.get("fit_quality") or {}, rec.get("fit") or {}
    if fq:
        r2, n = fq.get("r2"), fq.get("n_transfers")
        quality = ("good" if isinstance(r2, (int, float)) and r2 >= GOOD_R2 else "weak")
        few = (" — few transfers, wide intervals" if isinstance(n, int) and n < MIN_TRANSFERS
               else "")
        line = (f"Fabric fit: {quality} (R² {fmt_num(r2)}) on {fmt_num(n)} transfers, "
                f"{fmt_num(fq.get('n_sizes'))} sizes, {fmt_num(fq.get('n_outliers'))} outliers "
                f"left out{few}.")
        if fit.get("floor_ms") is not None:
            f_ci = fit.get("floor_ci_ms") or (None, None)
            b_ci = fit.get("bandwidth_ci_gbps") or (None, None)
            line += (f" Floor {fmt_num(fit['floor_ms'])} ms ({fmt_num(f_ci[0])} – "
                     f"{fmt_num(f_ci[1])}), bandwidth {fmt_num(fit.get('bandwidth_gbps'))} Gbit/s "
                     f"({fmt_num(b_ci[0])} – {fmt_num(b_ci[1])}), 95% intervals.")
        lines.append(line)
    else:
        lines.append("Fabric fit: none (too few transfer sizes); the threshold is a fallback.")
    te = _evidence(rec, THRESHOLD)
    if te.get("prefill_n_observations") is not None:
        lines.append(f"Prefill cost from {fmt_num(te['prefill_n_observations'])} prefills; "
                     f"{fmt_num(rec.get('span_count'))} spans in all.")
    tt = _evidence(rec, TTL)
    if tt.get("n_gaps") is not None:
        lines.append(f"Reuse from {fmt_num(tt['n_gaps'])} gaps between turns.")
    return tuple(lines)


def _commands(rec: Mapping[str, Any], configs_rel: str) -> tuple[str, ...]:
    c = configs_rel.rstrip("/")
    cmds = [f"# prefill host\nmapfile -t A < {c}/prefill.vllm-serve.args; vllm serve \"${{A[@]}}\"",
            f"# decode host\nmapfile -t A < {c}/decode.vllm-serve.args; vllm serve \"${{A[@]}}\"",
            f"# router (replace PREFILL_HOST / DECODE_HOST in router.yaml first)\n"
            f"kvtune router --config {c}/router.yaml"]
    if str((rec.get("written") or {}).get("mode")) == "push":
        cmds[0] = cmds[0].replace("mapfile", "export VLLM_NIXL_SIDE_CHANNEL_PORT=5600  # = kv_port "
                                  "in router.yaml\nmapfile", 1)
    return tuple(cmds)


def build(rec: Mapping[str, Any], *, configs_rel: str = "configs") -> Headline:
    """The headline of ``recommendation.json`` (as a dict); ``configs_rel`` is the configs
    directory as the commands should name it (relative to the report)."""
    from kvtune.export.model import PLACEHOLDER

    recs = rec.get("recommendations") or {}
    missing = [k for k in (THRESHOLD, TTL, MODE) if k not in recs]
    if missing:
        from kvtune.errors import ConfigError
        raise ConfigError(f"recommendation.json: 'recommendations' lacks {missing}; expected the "
                          f"three recommendations kvtune export writes")
    model = str(rec.get("model") or PLACEHOLDER)
    return Headline(
        model=model, model_source=str(rec.get("model_source") or ""),
        model_known=model != PLACEHOLDER,
        cards=(_threshold_card(recs[THRESHOLD]), _ttl_card(recs[TTL], rec.get("retention")), _mode_card(recs[MODE])),
        confidence=_confidence(rec), verification=Verification.from_json(rec.get(VERIFY_KEY)),
        commands=_commands(rec, configs_rel), findings=tuple(rec.get("findings") or ()))


HEADLINE_CSS = (
    ".cards{display:flex;gap:12px;margin:8px 0}"
    ".card{flex:1;border:1px solid #ccc;border-radius:6px;padding:8px 12px;background:#fff}"
    ".card h3{margin:0;font-size:.95em;font-family:monospace;color:#333}"
    ".card .value{font-size:2em;font-weight:bold;margin:2px 0}"
    ".card .unit{font-size:.5em;font-weight:normal;color:#555;margin-left:.3em}"
    ".card .range{color:#444}.card .exact{font-size:.85em;color:#666}.card .why{font-size:.9em;margin:4px 0 0}"
    ".sure{margin:6px 0;padding:4px 12px;background:#f6f6f6;border-radius:6px}"
    ".sure p{margin:3px 0}.verification{font-weight:bold}"
    ".verification.not-verified{color:#92400e}"
    "pre.cmd{background:#1e1e1e;color:#eee;padding:6px 10px;border-radius:4px;margin:4px 0;"
    "white-space:pre-wrap}"
    ".model-unknown{color:#b91c1c;font-weight:bold}"
)


def render(h: Headline) -> str:
    """The headline as HTML (cards, how sure, apply)."""
    e = html.escape
    cards = "".join(
        f'<div class="card" id="rec-{e(c.name)}"><h3>{e(c.name)}</h3>'
        f'<div class="value">{e(c.value_text)}<span class="unit">{e(c.unit)}</span></div>'
        f'<div class="range">{e(c.range_text)}'
        + (f' <span class="exact">({e(c.exact_text)})</span>' if c.exact_text else "")
        + f'</div><p class="why">{e(c.why)}</p></div>'
        for c in h.cards)
    vclass = "verification" + (" not-verified" if h.verification.status.startswith("not ") else "")
    sure = "".join(f"<p>{e(line)}</p>" for line in h.confidence)
    model = (f'<b>Model:</b> <code>{e(h.model)}</code> <span class="model-src">({e(h.model_source)})</span>'
             if h.model_known else
             f'<span class="model-unknown">Model name unknown: the args files say '
             f'<code>{e(h.model)}</code>; replace it, or run again with --model NAME.</span> '
             f'<span class="model-src">({e(h.model_source)})</span>')
    cmds = "".join(f'<pre class="cmd">{e(c)}</pre>' for c in h.commands)
    return (f'<section id="headline"><div class="cards">{cards}</div>'
            f'<div class="sure" id="how-sure"><p id="verification" class="{vclass}">'
            f'{e(h.verification.text())}</p>{sure}</div>'
            f'<section id="apply"><h2>Apply</h2><p>{model}</p>{cmds}</section></section>')


def configs_relative(report_path: Path, configs_dir: Path) -> str:
    """``configs_dir`` as seen from the report's directory (relative when it can be)."""
    try:
        return os.path.relpath(configs_dir, report_path.parent)
    except ValueError:  # another drive
        return str(configs_dir)
