"""``run_probe``: sweep KV-shaped transfers over token counts, ops and layouts; fit the floor."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry import trace
from tqdm import tqdm

from kvtune import spans as S
from kvtune.errors import AnalysisError, ConfigError
from kvtune.geometry import KvGeometry, parse_layout, preset
from kvtune.probe import tracing
from kvtune.probe.agent import DEFAULT_BACKEND, nixl_version
from kvtune.probe.channel import parse_hostport
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


def default_tokens(min_tokens: int = DEFAULT_MIN_TOKENS,
                   max_tokens: int = DEFAULT_MAX_TOKENS) -> tuple[int, ...]:
    """Token counts doubling from ``min_tokens`` to ``max_tokens``."""
    out, t = [], min_tokens
    while t <= max_tokens:
        out.append(t)
        t *= 2
    return tuple(out)


@dataclass(frozen=True)
class ProbeConfig:
    """What to sweep and where. ``peer`` None starts a target in a child process on this host.

    ``tokens`` None sweeps :func:`default_tokens` within ``max_mem_mb``; explicit ``tokens`` that do
    not fit are an error. ``spans_dir``: where a local target (child process) writes its spans (the
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
    target_prefix: tuple[str, ...] = ()
    """Command prefix the local target (``peer`` None) starts under, e.g. ``ip netns exec NS`` to
    probe a shaped link (``kvtune.local.fabric.ShapedLink.probe_settings``)."""
    target_bind: str = "127.0.0.1"
    """Address the local target binds (its side of a shaped link)."""
    fabric_env: tuple[tuple[str, str], ...] = ()
    """Environment of both sides' NIXL agents (``UCX_TLS``, ``UCX_NET_DEVICES``) in
    :func:`run_probe`; ``""`` unsets a variable."""
    target_env: tuple[tuple[str, str], ...] = ()
    """Environment for the local target only, on top of the fabric's (its UCX device, say)."""

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
                need_mib = g.transfer_bytes(tokens[-1]) / 2**20
                raise ConfigError(f"tokens: {tokens[-1]} tokens need {need_mib:.1f} "
                                  f"MiB per side, above max_mem_mb={self.max_mem_mb}")
        fabric = self.fabric or default_fabric_name(self.backend, self.peer)
        return dataclasses.replace(self, tokens=tokens, ops=ops, layouts=layouts, fabric=fabric)


def default_fabric_name(backend: str, peer: str | None) -> str:
    """``<backend>-<UCX_TLS or auto>-<local|remote>``, e.g. ``ucx-tcp-local``."""
    tls = os.environ.get("UCX_TLS", "auto").replace(",", "+") if backend == "UCX" else "default"
    return f"{backend.lower()}-{tls}-{'local' if peer is None else 'remote'}"


def run_probe(config: ProbeConfig, *, tracer=None, flush: Callable[[], object] | None = None) -> ProbeSummary:
    """Run the sweep against ``config.peer`` (or a target in a child process) and fit the floor.

    Spans go to ``tracer`` or, when None, to the global provider's ``kvtune.probe`` tracer
    (nothing is recorded when ``config.spans`` is False). They are made after each block of
    transfers and then ``flush`` is called (default: the global SDK provider's ``force_flush``;
    pass ``Telemetry.force_flush`` with your own tracer), so exporting spans never runs in a
    background thread while a transfer is being timed (it would compete for the GIL).
    """
    cfg = config.validated()
    return _run(cfg, {cfg.fabric: dict(cfg.fabric_env)}, tracer, flush)[cfg.fabric]


def compare_fabrics(config: ProbeConfig, fabrics: Mapping[str, Mapping[str, str]], *,
                    tracer=None, flush: Callable[[], object] | None = None) -> dict[str, ProbeSummary]:
    """Probe several local fabrics in one run: ``fabrics`` maps a fabric name to the environment
    (e.g. ``{"UCX_TLS": "tcp"}``; ``""`` unsets a variable) its initiator agent and its target
    process get. One target process per fabric, one initiator process; every round interleaves
    the fabrics in a shuffled order, so a change of load on a shared host hits all of them alike
    and the comparison stays fair."""
    if config.peer is not None:
        raise ConfigError("compare_fabrics: peer: expected None (each fabric gets a local target)")
    if not fabrics:
        raise ConfigError("compare_fabrics: fabrics: expected at least one name -> environment")
    cfg = config.validated()
    return _run(cfg, {name: dict(env) for name, env in fabrics.items()}, tracer, flush)


@contextlib.contextmanager
def _environ(env: Mapping[str, str]):
    """``os.environ`` with ``env`` applied (``""`` removes a variable) while NIXL/UCX read it
    (UCX reads its configuration when each agent's backend is created)."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v == "":
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class _Fabric:
    name: str
    session: InitiatorSession
    peer: str
    ucx_tls: str
    records: list[tracing.TransferRecord] = field(default_factory=list)
    verified: int = 0


def _run(cfg: ProbeConfig, fabrics: dict[str, dict[str, str]], tracer,
         flush: Callable[[], object] | None) -> dict[str, ProbeSummary]:
    started = time.monotonic()
    g = cfg.geometry
    capacity_blocks = g.blocks(cfg.tokens[-1])
    if cfg.spans and tracer is None:
        tracer = tracing.get_tracer()
        flush = flush or getattr(trace.get_tracer_provider(), "force_flush", None)
    elif not cfg.spans:
        tracer = flush = None
    run_id = uuid.uuid4().hex[:8]
    rng = random.Random(cfg.seed)
    opened: list[_Fabric] = []
    local_targets: list = []
    try:
        for name, env in fabrics.items():
            local = None
            if cfg.peer is None:
                spans_path = None
                if cfg.spans and cfg.spans_dir is not None:
                    Path(cfg.spans_dir).mkdir(parents=True, exist_ok=True)
                    suffix = "" if len(fabrics) == 1 else f"-{_safe(name)}"
                    spans_path = Path(cfg.spans_dir) / TARGET_SPANS_FILE.replace(".jsonl", f"{suffix}.jsonl")
                local = spawn_local_target(
                    backend=cfg.backend, fabric=name, spans_path=spans_path,
                    env={**env, **dict(cfg.target_env)}, bind=cfg.target_bind,
                    launch_prefix=cfg.target_prefix,
                    max_mem_mb=max(cfg.max_mem_mb, g.buffer_bytes(capacity_blocks) >> 20) + 1)
                local_targets.append(local)
                host, port = local.host, local.port
            else:
                host, port = parse_hostport(cfg.peer)
            with _environ(env):
                ucx_tls = os.environ.get("UCX_TLS", "")
                session = InitiatorSession((host, port), g, capacity_blocks, backend=cfg.backend,
                                           fabric=name, tracer=tracer, xfer_timeout_s=cfg.xfer_timeout_s,
                                           target_alive=local.alive if local is not None else None)
            peer = f"{host}:{port}" if cfg.peer is not None else f"local ({host}:{port})"
            opened.append(_Fabric(name, session, peer, ucx_tls))
        per_fabric = len(cfg.ops) * len(cfg.layouts) * len(cfg.tokens) * (cfg.warmup + cfg.iters)
        bar = tqdm(total=per_fabric * len(opened), unit="xfer", disable=not cfg.progress, leave=False,
                   desc=f"probe {', '.join(fabrics)}")
        try:
            for op in cfg.ops:
                for layout in cfg.layouts:
                    _sweep_block(opened, cfg, op, layout, run_id, rng, bar, tracer)
                    tracing.flush_quietly(flush)
        finally:
            bar.close()
        results = {}
        for f in opened:
            expected = f.session.transfers_posted
            received = f.session.notifications_seen(expected)
            results[f.name] = _summary(cfg, f, expected, received, time.monotonic() - started)
        return results
    finally:
        for f in opened:
            f.session.close()
        for local in local_targets:
            local.stop()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "fabric"


def _summary(cfg: ProbeConfig, f: _Fabric, expected: int, received: int,
             duration_s: float) -> ProbeSummary:
    warnings = []
    if received != expected:
        warnings.append(f"the target received {received} completion notifications for "
                        f"{expected} transfers")
    target_nixl = str(f.session.target_info.get("nixl_version", ""))
    if target_nixl and target_nixl != nixl_version():
        warnings.append(f"NIXL versions differ: initiator {nixl_version()}, target {target_nixl}")
    measured = [r for r in f.records if not r.warmup]
    keys = sorted(set((r.op, r.layout, r.tokens) for r in measured),
                  key=lambda k: (cfg.ops.index(k[0]), cfg.layouts.index(k[1]), k[2]))
    points = tuple(PointStats.from_records([r for r in measured if (r.op, r.layout, r.tokens) == k])
                   for k in keys)
    fits = tuple(_fit(op, [r for r in measured if r.op == op], cfg, f.name) for op in cfg.ops)
    head = fits[0].fit
    return ProbeSummary(
        op=fits[0].op,
        floor_ms=head.floor_ms if head else None,
        floor_ci_ms=head.floor_ci_ms if head else None,
        bandwidth_gbps=head.bandwidth_gbps if head else None,
        bandwidth_ci_gbps=head.bandwidth_ci_gbps if head else None,
        per_descriptor_us=head.per_descriptor_us if head else None,
        per_descriptor_ci_us=head.per_descriptor_ci_us if head else None,
        fits=fits, points=points, model=cfg.geometry.as_dict(), fabric=f.name, backend=cfg.backend,
        peer=f.peer, nixl_version=nixl_version(), ucx_tls=f.ucx_tls, n_transfers=expected,
        notifications_received=received, verified_transfers=f.verified, duration_s=duration_s,
        warnings=tuple(warnings))


def _sweep_block(fabrics: list[_Fabric], cfg: ProbeConfig, op: str, layout: str, run_id: str,
                 rng: random.Random, bar, tracer) -> None:
    """All sizes of one (op, layout) on every fabric, interleaved: each round does every size of
    every fabric once, in a shuffled order, so a burst of noise on a shared host spreads over all
    sizes and fabrics instead of sinking one."""
    prepared = {f.name: [f.session.prepare(t, layout) for t in cfg.tokens] for f in fabrics}
    start = {f.name: len(f.records) for f in fabrics}
    try:
        if cfg.verify:
            for f in fabrics:
                pts = prepared[f.name]
                for point in {id(p): p for p in (pts[0], pts[-1])}.values():
                    f.records.append(f.session.verify(op, point, seed=cfg.seed + point.tokens,
                                                      run_id=run_id))
                    f.verified += 1
        for i in range(cfg.warmup + cfg.iters):
            warm = i < cfg.warmup
            order = [(f, p) for f in fabrics for p in prepared[f.name]]
            rng.shuffle(order)
            for f, point in order:
                f.records.append(f.session.transfer(op, point, iteration=i if warm else i - cfg.warmup,
                                                    warmup=warm, run_id=run_id))
            bar.update(len(order))
    finally:
        for f in fabrics:
            for point in prepared[f.name]:
                f.session.release(point)
            tracing.emit_transfers(tracer, f.session.info, f.records[start[f.name]:])


def _fit(op: str, records: Sequence[tracing.TransferRecord], cfg: ProbeConfig, fabric: str) -> OpFit:
    from kvtune.analysis import fit_floor_points
    try:
        fit = fit_floor_points([r.bytes for r in records], [r.descriptors for r in records],
                               [r.critical_ms for r in records], n_boot=cfg.n_boot, seed=cfg.seed,
                               source=f"probe {fabric} {op}")
    except AnalysisError as exc:
        return OpFit(op, None, str(exc))
    return OpFit(op, fit)


def run_and_write(config: ProbeConfig, *, json_path: str | Path | None = None) -> ProbeSummary:
    """:func:`run_probe` with the initiator's spans exported by ``kvtune.telemetry`` (to
    ``config.spans_dir`` when set, and wherever the ``OTEL_*``/``KVTUNE_SPANS_DIR`` variables say)
    when ``config.spans``, and the summary written to ``json_path``."""
    tel = None
    if config.spans:
        try:
            from kvtune import telemetry
            json_path_spans = None
            if config.spans_dir is not None:
                Path(config.spans_dir).mkdir(parents=True, exist_ok=True)
                json_path_spans = Path(config.spans_dir) / INITIATOR_SPANS_FILE
            tel = telemetry.setup("probe", json_path=json_path_spans)
        except Exception:  # telemetry never breaks the probe
            logger.warning("kvtune probe: span output unavailable; continuing", exc_info=True)
    try:
        summary = run_probe(config, tracer=tel.tracer if tel is not None else None,
                            flush=tel.force_flush if tel is not None else None)
    finally:
        if tel is not None:
            tel.shutdown()
    if json_path is not None:
        summary.to_json(json_path)
    return summary
