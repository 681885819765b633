"""``run_probe``: sweep KV-shaped transfers over token counts, ops and layouts; fit the floor."""
from __future__ import annotations

import logging
import os
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvtune import spans as S
from kvtune.errors import AnalysisError, ConfigError, ProbeError
from kvtune.geometry import KvGeometry, parse_layout, preset
from kvtune.probe import tracing
from kvtune.probe.agent import DEFAULT_BACKEND, nixl_version
from kvtune.probe.channel import connect, parse_hostport
from kvtune.probe.initiator import DEFAULT_XFER_TIMEOUT_S, InitiatorSession
from kvtune.probe.results import OpFit, PointStats, ProbeSummary
from kvtune.probe.target import spawn_local_target

logger = logging.getLogger(__name__)

DEFAULT_MIN_TOKENS = 16
DEFAULT_MAX_TOKENS = 32768
DEFAULT_MAX_MEM_MB = 1024
"""Default cap on the probe buffer of each side (the sweep's largest point must fit)."""
TARGET_SPANS_FILE = "probe-target.jsonl"
INITIATOR_SPANS_FILE = "probe-initiator.jsonl"


def default_tokens(min_tokens: int = DEFAULT_MIN_TOKENS, max_tokens: int = DEFAULT_MAX_TOKENS) -> tuple[int, ...]:
    """Token counts doubling from ``min_tokens`` to ``max_tokens``."""
    out, t = [], min_tokens
    while t <= max_tokens:
        out.append(t)
        t *= 2
    return tuple(out)


@dataclass(frozen=True)
class ProbeConfig:
    """What to sweep and where. ``peer`` None starts a target in a spawned child on this host.

    ``tokens`` None sweeps :func:`default_tokens` within ``max_mem_mb``; explicit ``tokens`` that do
    not fit are an error. ``spans_dir``: where a locally spawned target writes its spans (the
    initiator's go to the caller's tracer provider; the CLI sets one up in the same directory).
    """

    geometry: KvGeometry = field(default_factory=lambda: preset("qwen3-32b"))
    tokens: tuple[int, ...] | None = None
    ops: tuple[str, ...] = ("READ", "WRITE")
    layouts: tuple[str, ...] = (S.Layout.PER_BLOCK.value,)
    iters: int = 20
    warmup: int = 3
    peer: str | None = None
    backend: str = DEFAULT_BACKEND
    fabric: str = ""
    max_mem_mb: int = DEFAULT_MAX_MEM_MB
    spans: bool = True
    spans_dir: Path | None = None
    verify: bool = True
    xfer_timeout_s: float = DEFAULT_XFER_TIMEOUT_S
    n_boot: int = 200
    seed: int = 0
    progress: bool = True

    def validated(self) -> "ProbeConfig":
        """Checks every field; raises ``ConfigError`` naming the field and what was expected."""
        ops = tuple(str(o).upper() for o in self.ops)
        for o in ops:
            if o not in {x.value for x in S.NixlOp}:
                raise ConfigError(f"ops: expected READ and/or WRITE, got {o!r}")
        if not ops:
            raise ConfigError("ops: expected at least one of READ, WRITE")
        layouts = tuple(parse_layout(x).value for x in self.layouts)
        if not layouts:
            raise ConfigError("layouts: expected at least one of per_block, merged")
        for name in ("iters", "max_mem_mb"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}: expected an integer >= 1, got {v!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError(f"warmup: expected an integer >= 0, got {self.warmup!r}")
        if not self.xfer_timeout_s > 0:
            raise ConfigError(f"xfer_timeout_s: expected > 0 seconds, got {self.xfer_timeout_s!r}")
        if self.peer is not None:
            parse_hostport(self.peer)
        cap = self.max_mem_mb << 20
        g = self.geometry
        if self.tokens is None:
            tokens = tuple(t for t in default_tokens() if g.transfer_bytes(t) <= cap)
            if not tokens:
                raise ConfigError(f"max_mem_mb: {self.max_mem_mb} MiB holds no sweep point; "
                                  f"{DEFAULT_MIN_TOKENS} tokens of {g.name or 'this model'} need "
                                  f"{g.transfer_bytes(DEFAULT_MIN_TOKENS) / 2**20:.1f} MiB")
        else:
            tokens = tuple(sorted(set(self.tokens)))
            if not tokens:
                raise ConfigError("tokens: expected at least one token count")
            for t in tokens:
                if not isinstance(t, int) or t < 1:
                    raise ConfigError(f"tokens: expected integers >= 1, got {t!r}")
            if g.transfer_bytes(tokens[-1]) > cap:
                raise ConfigError(f"tokens: {tokens[-1]} tokens need {g.transfer_bytes(tokens[-1]) / 2**20:.1f} "
                                  f"MiB per side, above max_mem_mb={self.max_mem_mb}")
        fabric = self.fabric or default_fabric_name(self.backend, self.peer)
        return ProbeConfig(g, tokens, ops, layouts, self.iters, self.warmup, self.peer, self.backend,
                           fabric, self.max_mem_mb, self.spans, self.spans_dir, self.verify,
                           self.xfer_timeout_s, self.n_boot, self.seed, self.progress)


def default_fabric_name(backend: str, peer: str | None) -> str:
    """``<backend>-<UCX_TLS or auto>-<local|remote>``, e.g. ``ucx-tcp-local``."""
    tls = os.environ.get("UCX_TLS", "auto").replace(",", "+") if backend == "UCX" else "default"
    return f"{backend.lower()}-{tls}-{'local' if peer is None else 'remote'}"


def run_probe(config: ProbeConfig, *, tracer=None) -> ProbeSummary:
    """Run the sweep against ``config.peer`` (or a target in a child process) and fit the floor.

    Spans go to ``tracer`` or, when None, to the global provider's ``kvtune.probe`` tracer
    (nothing is recorded when ``config.spans`` is False).
    """
    cfg = config.validated()
    started = time.monotonic()
    g = cfg.geometry
    capacity_blocks = g.blocks(cfg.tokens[-1])
    tracer = (tracer or tracing.get_tracer()) if cfg.spans else None
    local = None
    if cfg.peer is None:
        spans_path = None
        if cfg.spans and cfg.spans_dir is not None:
            Path(cfg.spans_dir).mkdir(parents=True, exist_ok=True)
            spans_path = Path(cfg.spans_dir) / TARGET_SPANS_FILE
        local = spawn_local_target(backend=cfg.backend,
                                   max_mem_mb=max(cfg.max_mem_mb, g.buffer_bytes(capacity_blocks) >> 20) + 1,
                                   fabric=cfg.fabric, spans_path=spans_path)
        host, port = local.host, local.port
    else:
        host, port = parse_hostport(cfg.peer)
    peer = f"{host}:{port}"
    run_id = uuid.uuid4().hex[:8]
    rng = random.Random(cfg.seed)
    records: list[tracing.TransferRecord] = []
    points: list[PointStats] = []
    verified = 0
    warnings: list[str] = []
    try:
        alive = local.alive if local is not None else None
        channel = connect(host, port)
        with InitiatorSession(channel, g, capacity_blocks, backend=cfg.backend, fabric=cfg.fabric,
                              tracer=tracer, xfer_timeout_s=cfg.xfer_timeout_s,
                              target_alive=alive) as session:
            total = len(cfg.ops) * len(cfg.layouts) * len(cfg.tokens) * (cfg.warmup + cfg.iters)
            bar = tqdm(total=total, desc=f"probe {cfg.fabric}", unit="xfer", disable=not cfg.progress,
                       leave=False)
            try:
                for op in cfg.ops:
                    for layout in cfg.layouts:
                        block = _sweep_block(session, cfg, op, layout, run_id, rng, bar)
                        verified += block.verified
                        tracing.emit_transfers(tracer, session.info, block.records)
                        measured = [r for r in block.records if not r.warmup]
                        records.extend(measured)
                        for tokens in cfg.tokens:
                            points.append(PointStats.from_records(
                                [r for r in measured if r.tokens == tokens]))
            finally:
                bar.close()
            expected = session.transfers_posted
            received = session.notifications_seen(expected)
            if received != expected:
                warnings.append(f"the target received {received} completion notifications for "
                                f"{expected} transfers")
            target_nixl = str(session.target_info.get("nixl_version", ""))
    finally:
        if local is not None:
            local.stop()
    fits = tuple(_fit(op, [r for r in records if r.op == op], cfg) for op in cfg.ops)
    head = fits[0].fit
    if target_nixl and target_nixl != nixl_version():
        warnings.append(f"NIXL versions differ: initiator {nixl_version()}, target {target_nixl}")
    return ProbeSummary(
        op=fits[0].op,
        floor_ms=head.floor_ms if head else None,
        floor_ci_ms=head.floor_ci_ms if head else None,
        bandwidth_gbps=head.bandwidth_gbps if head else None,
        bandwidth_ci_gbps=head.bandwidth_ci_gbps if head else None,
        per_descriptor_us=head.per_descriptor_us if head else None,
        per_descriptor_ci_us=head.per_descriptor_ci_us if head else None,
        fits=fits, points=tuple(points), model=g.as_dict(), fabric=cfg.fabric, backend=cfg.backend,
        peer=peer if cfg.peer is not None else f"local ({peer})", nixl_version=nixl_version(),
        ucx_tls=os.environ.get("UCX_TLS", ""), n_transfers=expected,
        notifications_received=received, verified_transfers=verified,
        duration_s=time.monotonic() - started, warnings=tuple(warnings))


@dataclass
class _Block:
    records: list[tracing.TransferRecord]
    verified: int


def _sweep_block(session: InitiatorSession, cfg: ProbeConfig, op: str, layout: str, run_id: str,
                 rng: random.Random, bar) -> _Block:
    """All sizes of one (op, layout), interleaved: each round does every size once, in a shuffled
    order, so a burst of noise on a shared host spreads over all sizes instead of sinking one."""
    prepared = [session.prepare(t, layout) for t in cfg.tokens]
    records: list[tracing.TransferRecord] = []
    verified = 0
    try:
        if cfg.verify:
            for point in {id(p): p for p in (prepared[0], prepared[-1])}.values():
                records.append(session.verify(op, point, seed=cfg.seed + point.tokens, run_id=run_id))
                verified += 1
        for i in range(cfg.warmup + cfg.iters):
            warm = i < cfg.warmup
            order = list(prepared)
            rng.shuffle(order)
            for point in order:
                records.append(session.transfer(op, point, iteration=i if warm else i - cfg.warmup,
                                                warmup=warm, run_id=run_id))
            bar.update(len(order))
    finally:
        for point in prepared:
            session.release(point)
    return _Block(records, verified)


def _fit(op: str, records: Sequence[tracing.TransferRecord], cfg: ProbeConfig) -> OpFit:
    from kvtune.analysis import fit_floor_points
    try:
        fit = fit_floor_points([r.bytes for r in records], [r.descriptors for r in records],
                               [r.critical_ms for r in records], n_boot=cfg.n_boot, seed=cfg.seed,
                               source=f"probe {cfg.fabric} {op}")
    except AnalysisError as exc:
        return OpFit(op, None, str(exc))
    return OpFit(op, fit)


def run_and_write(config: ProbeConfig, *, json_path: str | Path | None = None) -> ProbeSummary:
    """:func:`run_probe` with the initiator's spans written to ``config.spans_dir`` (when set and
    ``config.spans``) and the summary to ``json_path``."""
    tel = None
    if config.spans and config.spans_dir is not None:
        try:
            from kvtune import telemetry
            Path(config.spans_dir).mkdir(parents=True, exist_ok=True)
            tel = telemetry.setup("probe", json_path=Path(config.spans_dir) / INITIATOR_SPANS_FILE)
        except Exception:  # telemetry never breaks the probe
            logger.warning("kvtune probe: span output unavailable; continuing", exc_info=True)
    try:
        summary = run_probe(config, tracer=tel.tracer if tel is not None else None)
    finally:
        if tel is not None:
            tel.shutdown()
    if json_path is not None:
        summary.to_json(json_path)
    return summary
