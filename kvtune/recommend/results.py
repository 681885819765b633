"""Frozen results of the recommendations: each value with its range, evidence and assumptions."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvtune.analysis.fit import FloorFit
from kvtune.recommend.evidence import Evidence, JsonEvidence, plain

NEVER: str = "never"
"""Threshold value when pulling remote KV never beats recomputing it on this traffic."""
MODE_NAME: str = "mode"
"""The mode recommendation's name (its key in ``recommendation.json`` beside vLLM's two keys)."""


@dataclass(frozen=True)
class Recommendation:
    """One recommended setting. ``value`` is a number, a mode name, or :data:`NEVER`; ``evidence``
    the typed why (``kvtune.recommend.evidence``)."""

    name: str
    value: Any
    range: tuple[Any, Any]
    unit: str
    evidence: Evidence
    assumptions: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": plain(self.value), "range": plain(self.range),
                "unit": self.unit, "evidence": plain(self.evidence),
                "assumptions": list(self.assumptions)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recommendation:
        """The inverse of :meth:`as_dict` (JSON's lists become tuples where the type has one)."""
        return cls(d["name"], d["value"], tuple(d["range"]), d["unit"],
                   JsonEvidence(d["evidence"]), tuple(d["assumptions"]))


@dataclass(frozen=True)
class Finding:
    """Something the user should know (readiness, data quality, an edge case)."""

    code: str
    severity: Literal["info", "warning"]
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "severity": self.severity, "message": self.message,
                "evidence": plain(self.evidence)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        return cls(d["code"], d["severity"], d["message"], dict(d["evidence"]))


@dataclass(frozen=True)
class Tuning:
    """Everything ``kvtune recommend`` concludes from one trace."""

    threshold: Recommendation
    ttl: Recommendation
    mode: Recommendation
    findings: tuple[Finding, ...]
    fit: FloorFit | None
    source: str
    span_count: int
    extra: dict[str, Any] = field(default_factory=dict)
    """Further evidence (workload summary, prefill cost, transfer counts, router TTL)."""
    retention: dict[str, Any] | None = None
    """Fixed TTL against the renewable lease (``RetentionAdvice.as_dict()``,
    :mod:`kvtune.recommend.retention`); None when not compared (see the findings)."""

    def as_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold.as_dict(), "ttl": self.ttl.as_dict(),
                "mode": self.mode.as_dict(), "findings": [f.as_dict() for f in self.findings],
                "fit": plain(self.fit) if self.fit is not None else None,
                "source": self.source, "span_count": self.span_count, "extra": plain(self.extra),
                "retention": plain(self.retention) if self.retention is not None else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tuning:
        """The inverse of :meth:`as_dict`: ``Tuning.from_dict(t.as_dict()).as_dict() ==
        t.as_dict()``. A missing field raises KeyError (`kvtune.recommend.saved` names the file)."""
        return cls(Recommendation.from_dict(d["threshold"]), Recommendation.from_dict(d["ttl"]),
                   Recommendation.from_dict(d["mode"]),
                   tuple(Finding.from_dict(f) for f in d["findings"]),
                   FloorFit.from_dict(d["fit"]) if d["fit"] is not None else None,
                   d["source"], d["span_count"], dict(d["extra"]),
                dict(d["retention"]) if d.get("retention") is not None else None)
