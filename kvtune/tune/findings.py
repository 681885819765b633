"""Findings as readable HTML: severity, the whole message, the evidence behind a disclosure.

The same HTML goes into ``report.html`` and, through :class:`FindingsView`, into the notebooks; a
message is never cut (the old plotly table clipped them mid-sentence). Numbers in messages with
more than 4 significant digits are rounded (`kvtune.tune.numbers.readable_text`); the exact
values stay in ``recommendation.json``.
"""
from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtune.tune.numbers import fmt_num, readable_text

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
"""Findings are listed most severe first; unknown severities last."""
MAX_EVIDENCE_ITEMS = 50
"""Evidence entries shown per finding (the rest are counted, not dropped silently)."""
MAX_NESTING = 4
"""Nested evidence deeper than this is shown as text (evidence is data from a trace)."""

FINDINGS_CSS = (
    ".findings{list-style:none;padding:0;margin:0}"
    ".finding{border-left:4px solid #888;background:#fafafa;margin:4px 0;padding:4px 8px}"
    ".finding.warning{border-color:#d97706;background:#fff8eb}"
    ".finding.error{border-color:#dc2626;background:#fef2f2}"
    ".finding.info{border-color:#2563eb;background:#f3f7ff}"
    ".finding summary{cursor:pointer;white-space:normal;overflow-wrap:anywhere}"
    ".finding .sev{font-weight:bold;text-transform:uppercase;font-size:.8em;margin-right:.5em}"
    ".finding code{margin-right:.5em;color:#555}"
    ".finding table.evidence{margin:4px 0 4px 1.5em;font-size:.9em}"
)


def _as_dict(f: Any) -> dict[str, Any]:
    if isinstance(f, Mapping):
        return dict(f)
    if hasattr(f, "as_dict"):
        return f.as_dict()
    raise TypeError(f"a finding: expected a mapping or a Finding, got {type(f).__name__}")


def sorted_findings(findings: Iterable[Any]) -> list[dict[str, Any]]:
    """Findings as dicts, most severe first (stable within a severity)."""
    items = [_as_dict(f) for f in findings]
    return sorted(items, key=lambda f: SEVERITY_ORDER.get(str(f.get("severity")), 9))


def evidence_rows(evidence: Any, prefix: str = "", depth: int = 0) -> list[tuple[str, str]]:
    """``(key, text)`` rows of a finding's evidence: nested keys joined with dots, numbers
    rounded by :func:`~kvtune.tune.numbers.fmt_num`."""
    rows: list[tuple[str, str]] = []
    if isinstance(evidence, Mapping) and depth < MAX_NESTING:
        for k, v in evidence.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, Mapping) and v and depth + 1 < MAX_NESTING:
                rows += evidence_rows(v, key, depth + 1)
            else:
                rows.append((key, value_text(v)))
        return rows
    return [(prefix or "value", value_text(evidence))]


def value_text(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ", ".join(value_text(x) for x in v) if v else "(none)"
    if isinstance(v, Mapping):
        return "; ".join(f"{k}: {value_text(x)}" for k, x in v.items()) if v else "(none)"
    if isinstance(v, str):
        return readable_text(v)
    return fmt_num(v)


def findings_html(findings: Sequence[Any]) -> str:
    """An HTML list, one ``<details>`` per finding: the summary holds the severity, code and the
    whole message; opening it shows the evidence table."""
    items = sorted_findings(findings)
    if not items:
        return '<p class="no-findings">No findings: nothing in the trace needs your attention.</p>'
    out = ['<ul class="findings">']
    for f in items:
        sev = str(f.get("severity") or "info")
        code = str(f.get("code") or "")
        msg = readable_text(str(f.get("message") or ""))
        rows = evidence_rows(f.get("evidence") or {})
        more = len(rows) - MAX_EVIDENCE_ITEMS
        body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                       for k, v in rows[:MAX_EVIDENCE_ITEMS])
        if more > 0:
            body += f'<tr><td colspan="2">({more} more entries in recommendation.json)</td></tr>'
        evidence = (f'<table class="evidence">{body}</table>' if rows else
                    '<p class="evidence">No evidence recorded.</p>')
        out.append(f'<li><details class="finding {html.escape(sev)}" data-code="{html.escape(code)}">'
                   f'<summary><span class="sev">{html.escape(sev)}</span>'
                   f'<code>{html.escape(code)}</code><span class="msg">{html.escape(msg)}</span>'
                   f'</summary>{evidence}</details></li>')
    out.append("</ul>")
    return "".join(out)


@dataclass(frozen=True)
class FindingsView:
    """Findings for a notebook cell: the cell's value renders as :func:`findings_html`."""

    findings: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, tuning: Any) -> FindingsView:
        return cls(tuple(_as_dict(f) for f in tuning.findings))

    def _repr_html_(self) -> str:
        return f"<style>{FINDINGS_CSS}</style>" + findings_html(self.findings)

    def __repr__(self) -> str:
        lines = [f"[{f.get('severity')}] {f.get('code')}: {f.get('message')}"
                 for f in sorted_findings(self.findings)]
        return "\n".join(lines) or "no findings"
