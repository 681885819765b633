"""``kv_lease_duration``: how long a pull prefill holds a finished request's blocks for the READ.

vLLM frees the blocks when the lease runs out unread (the decode's READ then fails and the request
is recomputed); the decode's heartbeats (every lease/6) extend it by 2/3 of the lease while the
request waits. Too short a lease loses reads that come late; too long a one keeps the blocks of
requests nobody will read (a decode gone, a client that left). The recommendation is the
:data:`QUANTILE` of the measured prefill-to-read delays times :data:`HEADROOM`, in whole seconds
(vLLM takes an int) within [:data:`MIN_S`, :data:`MAX_S`]; when any lease expired it is never below
the lease in force (an expired hold's true delay is unknown). Without holds there is none.
"""
from __future__ import annotations

import math

from kvtune.analysis.prefill_lease import PrefillLeaseHolds
from kvtune.recommend.evidence import LeaseEvidence
from kvtune.recommend.results import Finding, Recommendation
from kvtune.vllm_pd import DEFAULT_KV_LEASE_DURATION_S, KV_LEASE_DURATION

NAME = KV_LEASE_DURATION
UNIT = "s"
QUANTILE = 0.99
HEADROOM = 1.5
MIN_S = 6
"""The decode heartbeats every lease // 6 seconds: below 6 that is every step."""
MAX_S = 600
SOURCE = ("measured: kv.prefill_lease.held_s on the prefills' kv.notify (prefill finished -> "
          "the decode's READ completed)")


def _bounded(seconds: float) -> int:
    return int(min(MAX_S, max(MIN_S, math.ceil(seconds))))


def recommend_lease(holds: PrefillLeaseHolds | None) -> tuple[Recommendation | None, list[Finding]]:
    """The recommended ``kv_lease_duration`` (None without measured reads) and the findings on
    reads near or after the lease's expiry."""
    findings: list[Finding] = []
    if holds is None:
        return None, findings
    lease = holds.lease_s if math.isfinite(holds.lease_s) else float(DEFAULT_KV_LEASE_DURATION_S)
    summary = holds.as_dict()
    if holds.n_expired:
        findings.append(Finding(
            "prefill_lease_expired", "warning",
            f"{holds.n_expired} of {holds.n_holds} prefill hold(s) expired before the decode read "
            f"them (kv_lease_duration {lease:g} s): vLLM freed the blocks and those requests were "
            f"recomputed or failed; a longer kv_lease_duration keeps them",
            {**summary, "kv_lease_duration_s": lease}))
    if holds.n_near_expiry:
        findings.append(Finding(
            "prefill_lease_near_expiry", "warning",
            f"{holds.n_near_expiry} of {holds.n_read} read(s) completed with less than "
            f"{holds.near_margin_s:g} s of the prefill's lease left (kv_lease_duration {lease:g} s, "
            f"min margin {min(holds.read_margins_s):.2f} s): a little more delay and they expire",
            {**summary, "kv_lease_duration_s": lease}))
    if not holds.read_delays_s:
        return None, findings
    q = holds.delay_quantile_s(QUANTILE) or 0.0
    value = _bounded(q * HEADROOM)
    if holds.n_expired:
        value = max(value, _bounded(lease))
    lo = _bounded((holds.delay_quantile_s(0.9) or 0.0) * HEADROOM)
    hi = _bounded(max(holds.read_delays_s) * HEADROOM)
    evidence = LeaseEvidence(
        n_holds=holds.n_holds, n_read=holds.n_read, n_expired=holds.n_expired,
        n_released=holds.n_released, n_near_expiry=holds.n_near_expiry, lease_s_in_force=lease,
        quantile=QUANTILE, headroom=HEADROOM, read_delay_s_p50=holds.delay_quantile_s(0.5),
        read_delay_s_p99=q, read_delay_s_max=max(holds.read_delays_s),
        read_margin_s_min=min(holds.read_margins_s) if holds.read_margins_s else None,
        read_renewals=holds.read_renewals, source=SOURCE)
    assumptions = (
        f"the lease covers the p{QUANTILE * 100:g} prefill-to-read delay x {HEADROOM:g}, "
        f"in whole seconds within [{MIN_S}, {MAX_S}]",
        "an expired hold's delay is unknown (no read came): with any, the lease is not lowered",
        "heartbeats extend a waiting request's lease; the delay measured includes that time",
        "future prefill-to-read delays look like the traced ones",
    )
    return Recommendation(NAME, value, (min(lo, value), max(hi, value)), UNIT, evidence,
                          assumptions), findings
