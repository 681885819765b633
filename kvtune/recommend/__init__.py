"""From measurements to settings: ``kv_recompute_threshold``, ``decoder_kv_blocks_ttl`` and the
transfer mode, each a frozen :class:`Recommendation` with its range, evidence and assumptions."""
from __future__ import annotations

from kvtune.recommend.evidence import ModeEvidence, ThresholdEvidence, TtftMs, TtlEvidence
from kvtune.recommend.results import NEVER, Finding, Recommendation, Tuning
from kvtune.recommend.tuning import DEFAULT_HBM_BUDGET_GB, recommend

__all__ = ["DEFAULT_HBM_BUDGET_GB", "NEVER", "Finding", "ModeEvidence", "Recommendation", "ThresholdEvidence",
           "TtftMs", "TtlEvidence", "Tuning", "recommend"]
