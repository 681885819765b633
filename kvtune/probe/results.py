"""The probe's results: per-point latency percentiles and the floor/bandwidth summary."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvtune.probe.tracing import TransferRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class PointStats:
    """One sweep point (op, layout, tokens): latency percentiles over the measured iterations.

    ``p*_ms`` are of the critical time (descriptor setup + RDMA), the quantity the floor fit models;
    ``rdma_p50_ms`` is post -> completion alone; ``gbps_p50`` is bytes over ``rdma_p50_ms``.
    """

    op: str
    layout: str
    tokens: int
    blocks: int
    bytes: int
    descriptors: int
    nixl_descriptors: int | None
    iterations: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    rdma_p50_ms: float
    setup_p50_ms: float
    nixl_xfer_p50_us: float | None
    gbps_p50: float

    @classmethod
    def from_records(cls, records: list[TransferRecord]) -> "PointStats":
        r0 = records[0]
        crit = np.array([r.critical_ms for r in records])
        rdma = np.array([r.rdma_ms for r in records])
        setup = np.array([r.setup_ms for r in records])
        p50, p90, p99 = (float(x) for x in np.percentile(crit, PERCENTILES))
        xfer = [r.nixl_xfer_us for r in records if r.nixl_xfer_us is not None]
        rdma50 = float(np.median(rdma))
        return cls(r0.op, r0.layout, r0.tokens, r0.blocks, r0.bytes, r0.descriptors,
                   r0.nixl_descriptors, len(records), p50, p90, p99, rdma50,
                   float(np.median(setup)), float(np.median(xfer)) if xfer else None,
                   r0.bytes * 8 / (rdma50 * 1e6) if rdma50 > 0 else math.inf)


@dataclass(frozen=True)
class OpFit:
    """Floor fit of one operation (READ or WRITE) over all its sweep points; ``error`` says why
    there is no fit (``fit`` is then None)."""

    op: str
    fit: object | None  # kvtune.analysis.FloorFit
    error: str = ""


@dataclass(frozen=True)
class ProbeSummary:
    """What one probe run measured. The headline fields come from the first op's fit (READ by
    default, vLLM's pull); ``fits`` holds one per op. Bandwidth in Gbit/s (1e9 bit/s)."""

    op: str
    floor_ms: float | None
    floor_ci_ms: tuple[float, float] | None
    bandwidth_gbps: float | None
    bandwidth_ci_gbps: tuple[float, float] | None
    per_descriptor_us: float | None
    per_descriptor_ci_us: tuple[float, float] | None
    fits: tuple[OpFit, ...]
    points: tuple[PointStats, ...]
    model: dict
    fabric: str
    backend: str
    peer: str
    nixl_version: str
    ucx_tls: str
    n_transfers: int
    notifications_received: int
    verified_transfers: int
    duration_s: float
    warnings: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict:
        d = asdict(self)
        d["fits"] = [{"op": f.op, "error": f.error,
                      "fit": f.fit.as_dict() if f.fit is not None else None} for f in self.fits]
        return _jsonable(d)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.as_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    def table(self) -> str:
        """A plain-text table of the points and the fits."""
        head = (f"{'op':<5} {'layout':<9} {'tokens':>7} {'bytes':>12} {'descs':>7} "
                f"{'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'setup ms':>9} {'Gb/s':>8}")
        lines = [f"kvtune probe: model {self.model.get('name')} ({self.model.get('bytes_per_token')} "
                 f"B/token/rank, tp {self.model.get('tp_size')}), fabric {self.fabric!r}, backend "
                 f"{self.backend}, peer {self.peer}", head, "-" * len(head)]
        for p in self.points:
            lines.append(f"{p.op:<5} {p.layout:<9} {p.tokens:>7} {p.bytes:>12} {p.descriptors:>7} "
                         f"{p.p50_ms:>9.3f} {p.p90_ms:>9.3f} {p.p99_ms:>9.3f} {p.setup_p50_ms:>9.3f} "
                         f"{p.gbps_p50:>8.2f}")
        lines.append("")
        for f in self.fits:
            if f.fit is None:
                lines.append(f"{f.op}: no fit: {f.error}")
                continue
            fit = f.fit
            desc = ("not identifiable (descriptors constant or in step with bytes)"
                    if fit.per_descriptor_us is None else
                    f"{fit.per_descriptor_us:.3f} us [{fit.per_descriptor_ci_us[0]:.3f}, "
                    f"{fit.per_descriptor_ci_us[1]:.3f}]")
            lines.append(f"{f.op}: floor {fit.floor_ms:.4f} ms [{fit.floor_ci_ms[0]:.4f}, "
                         f"{fit.floor_ci_ms[1]:.4f}], bandwidth {fit.bandwidth_gbps:.2f} Gb/s "
                         f"[{fit.bandwidth_ci_gbps[0]:.2f}, {fit.bandwidth_ci_gbps[1]:.2f}], "
                         f"per descriptor {desc}, r2 {fit.r2:.3f}")
        for w in self.warnings:
            lines.append(f"WARNING: {w}")
        return "\n".join(lines)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, np.generic):
        return obj.item()
    return obj
