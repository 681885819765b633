"""The prefill's lease on a finished request's blocks (vLLM's ``kv_lease_duration``), measured.

A pull prefill holds a finished request's KV blocks until the decode's READ completes, for
``kv_lease_duration`` seconds (default 30), renewed by the decode's heartbeats (every lease/6, each
extending the expiry to at least now + 2/3 of the lease). The prefill's forward ``kv.notify``
carries how each hold went (``kv.prefill_lease.*``, :mod:`kvtune.connectors.worker`): how long the
blocks were held (prefill finished -> read completed), the lease in force, the renewals, the margin
left before the (renewed) expiry, and the outcome: read, expired (vLLM freed the blocks before any
read) or released at shutdown. :func:`prefill_lease_holds` summarises them per trace set.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvtune import spans as sc

NEAR_EXPIRY_SHARE = 0.2
"""A read is near expiry when less than this share of the lease in force was left."""


@dataclass(frozen=True)
class PrefillLeaseHolds:
    """The prefill holds of one trace set (``kv.prefill_lease.*`` on the prefills' ``kv.notify``)."""

    n_holds: int
    n_read: int
    n_expired: int
    n_released: int
    lease_s: float
    """The ``kv_lease_duration`` in force (the largest seen, if several)."""
    read_delays_s: tuple[float, ...]
    """Prefill finished -> read completed, for each hold that was read, ascending."""
    read_margins_s: tuple[float, ...]
    """Seconds left before the (renewed) expiry when each read completed (same order as
    ``read_delays_s``)."""
    read_renewals: int
    """Heartbeat renewals the read holds received, summed."""
    near_margin_s: float
    """Reads with less than this left are near expiry (``NEAR_EXPIRY_SHARE`` x lease)."""

    @property
    def n_near_expiry(self) -> int:
        return int(sum(1 for m in self.read_margins_s if m < self.near_margin_s))

    def delay_quantile_s(self, q: float) -> float | None:
        """The ``q`` quantile of the read delays (None without reads)."""
        return float(np.quantile(self.read_delays_s, q)) if self.read_delays_s else None

    def as_dict(self) -> dict[str, object]:
        d = self.read_delays_s
        return {"n_holds": self.n_holds, "n_read": self.n_read, "n_expired": self.n_expired,
                "n_released": self.n_released, "lease_s": self.lease_s,
                "n_near_expiry": self.n_near_expiry, "near_margin_s": self.near_margin_s,
                "read_renewals": self.read_renewals,
                "read_delay_s_p50": self.delay_quantile_s(0.5),
                "read_delay_s_p90": self.delay_quantile_s(0.9),
                "read_delay_s_p99": self.delay_quantile_s(0.99),
                "read_delay_s_max": max(d) if d else None,
                "read_margin_s_min": min(self.read_margins_s) if self.read_margins_s else None}


def prefill_lease_holds(spans: pd.DataFrame) -> PrefillLeaseHolds | None:
    """The holds in ``spans`` (a spans frame, ``docs/contracts.md``); None when no span carries
    ``kv.prefill_lease.outcome`` (an older kvtune, push mode, or no pull prefill traced)."""
    if sc.PREFILL_LEASE_OUTCOME not in spans.columns or spans.empty:
        return None
    outcome = spans[sc.PREFILL_LEASE_OUTCOME].astype("object")
    keep = ((spans["name"].astype("object") == sc.SpanName.NOTIFY.value) & outcome.notna())
    h = spans[keep.to_numpy(dtype=bool)]
    if h.empty:
        return None
    out = h[sc.PREFILL_LEASE_OUTCOME].astype(str)
    leases = pd.to_numeric(h[sc.PREFILL_LEASE_S], errors="coerce").dropna()
    lease_s = float(leases.max()) if len(leases) else float("nan")
    reads = h[(out == sc.PrefillLeaseOutcome.READ.value).to_numpy(dtype=bool)]
    delay = pd.to_numeric(reads[sc.PREFILL_LEASE_HELD_S], errors="coerce").to_numpy(dtype=float)
    margin = pd.to_numeric(reads[sc.PREFILL_LEASE_MARGIN_S], errors="coerce").to_numpy(dtype=float)
    ok = np.isfinite(delay)
    order = np.argsort(delay[ok], kind="stable")
    renewals = pd.to_numeric(reads[sc.PREFILL_LEASE_RENEWALS], errors="coerce").fillna(0)
    return PrefillLeaseHolds(
        n_holds=int(len(h)), n_read=int(len(reads)),
        n_expired=int((out == sc.PrefillLeaseOutcome.EXPIRED.value).sum()),
        n_released=int((out == sc.PrefillLeaseOutcome.RELEASED.value).sum()),
        lease_s=lease_s,
        read_delays_s=tuple(float(x) for x in delay[ok][order]),
        read_margins_s=tuple(float(x) for x in np.nan_to_num(margin[ok][order], nan=np.inf)),
        read_renewals=int(renewals.sum()),
        near_margin_s=NEAR_EXPIRY_SHARE * lease_s if np.isfinite(lease_s) else 0.0)
