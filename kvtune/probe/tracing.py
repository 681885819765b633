"""The probe's spans, in the kvtune convention, built from timestamps taken around each transfer.

The timed code takes only ``time.time_ns()`` stamps; spans are made afterwards with explicit start
and end times, so the probe's own telemetry never sits inside the interval it measures. Both sides
of one transfer derive the same trace (and parent) from its ``kv.transfer_id``, so the initiator's
``kv.descriptor_setup``/``kv.rdma`` and the target's ``kv.notify`` meet in one trace without a
router. Telemetry failures are logged, never raised into the probe.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvtune import spans as S

logger = logging.getLogger(__name__)

TRACER_NAME = "kvtune.probe"


def get_tracer() -> trace.Tracer:
    """The probe's tracer from the global provider (the caller's, or ``kvtune.telemetry.setup``'s)."""
    from kvtune import __version__
    return trace.get_tracer(TRACER_NAME, __version__)


def transfer_context(transfer_id: str) -> trace.Context:
    """A context whose (remote, unrecorded) parent is derived from ``transfer_id``: both sides of a
    transfer compute the same trace id without exchanging it."""
    digest = hashlib.sha256(transfer_id.encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    parent = trace.SpanContext(trace_id, span_id, is_remote=True,
                               trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


@dataclass(frozen=True)
class TransferRecord:
    """What one probe transfer did, in the initiator's clock (ns since epoch)."""

    transfer_id: str
    op: str
    layout: str
    tokens: int
    blocks: int
    bytes: int
    descriptors: int
    iteration: int
    warmup: bool
    setup_start_ns: int
    post_ns: int
    done_ns: int
    status: str
    nixl_post_us: float | None = None
    nixl_xfer_us: float | None = None
    nixl_descriptors: int | None = None

    @property
    def setup_ms(self) -> float:
        return (self.post_ns - self.setup_start_ns) / 1e6

    @property
    def rdma_ms(self) -> float:
        return (self.done_ns - self.post_ns) / 1e6

    @property
    def critical_ms(self) -> float:
        """Descriptor setup plus RDMA: the part of a transfer that the floor fit models."""
        return (self.done_ns - self.setup_start_ns) / 1e6


@dataclass(frozen=True)
class SpanContextInfo:
    """Attributes every span of one probe session carries."""

    engine_id: str
    remote_engine_id: str
    backend: str
    fabric: str
    transport: str = ""

    def common(self) -> dict:
        attrs = {S.MODE: S.Mode.PROBE.value, S.ROLE: S.Role.PROBE.value, S.ENGINE_ID: self.engine_id,
                 S.REMOTE_ENGINE_ID: self.remote_engine_id, S.NIXL_BACKEND: self.backend,
                 S.FABRIC: self.fabric}
        if self.transport:
            attrs[S.TRANSPORT] = self.transport
        return attrs


def emit_transfers(tracer: trace.Tracer | None, info: SpanContextInfo,
                   records: list[TransferRecord]) -> None:
    """``kv.descriptor_setup`` and ``kv.rdma`` spans for each record (initiator side)."""
    if tracer is None or not records:
        return
    try:
        common = info.common()
        for r in records:
            ctx = transfer_context(r.transfer_id)
            attrs = dict(common)
            attrs.update({S.TRANSFER_ID: r.transfer_id, S.NIXL_OP: r.op, S.TOKENS: r.tokens,
                          S.BLOCKS: r.blocks, S.BYTES: r.bytes, S.DESCRIPTORS: r.descriptors,
                          S.PROBE_ITERATION: r.iteration, S.PROBE_WARMUP: r.warmup,
                          S.PROBE_LAYOUT: r.layout})
            setup = tracer.start_span(S.SpanName.DESCRIPTOR_SETUP.value, context=ctx,
                                      kind=SpanKind.INTERNAL, attributes=attrs,
                                      start_time=r.setup_start_ns)
            setup.end(end_time=r.post_ns)
            rdma_attrs = dict(attrs)
            rdma_attrs[S.NIXL_STATUS] = r.status
            if r.nixl_post_us is not None:
                rdma_attrs[S.NIXL_POST_US] = float(r.nixl_post_us)
            if r.nixl_xfer_us is not None:
                rdma_attrs[S.NIXL_XFER_US] = float(r.nixl_xfer_us)
            rdma = tracer.start_span(S.SpanName.RDMA.value, context=ctx, kind=SpanKind.CLIENT,
                                     attributes=rdma_attrs, start_time=r.post_ns)
            if r.status != "DONE":
                rdma.set_status(Status(StatusCode.ERROR, f"NIXL status {r.status}"))
                rdma.set_attribute(S.ERROR_TYPE, "NixlTransferError")
            rdma.end(end_time=r.done_ns)
    except Exception:  # telemetry never breaks the probe
        logger.warning("kvtune probe: could not record transfer spans", exc_info=True)


def flush_quietly(flush) -> None:
    """Call a span flush hook (e.g. ``Telemetry.force_flush``); failures are logged, not raised."""
    if flush is None:
        return
    try:
        flush()
    except Exception:
        logger.warning("kvtune probe: flushing spans failed", exc_info=True)


def emit_handshake(tracer: trace.Tracer | None, info: SpanContextInfo, start_ns: int, end_ns: int,
                   *, error: str | None = None) -> None:
    """``kv.handshake``: the side-channel metadata exchange with the target (first contact)."""
    if tracer is None:
        return
    try:
        span = tracer.start_span(S.SpanName.HANDSHAKE.value, attributes=info.common(),
                                 start_time=start_ns)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
            span.set_attribute(S.ERROR_TYPE, "ProbeError")
        span.end(end_time=end_ns)
    except Exception:
        logger.warning("kvtune probe: could not record the handshake span", exc_info=True)


def emit_notify(tracer: trace.Tracer | None, info: SpanContextInfo, notif: dict, received_ns: int) -> None:
    """``kv.notify`` (target side, point-like) for one parsed notification message.

    ``kv.notify.sent_ns`` is the initiator's clock when it posted the transfer: NIXL sends the
    notification after the data, so the true send time is later; as a lower bound it still serves
    the causal check (a notification cannot arrive before it was sent) used to align clocks."""
    if tracer is None:
        return
    try:
        tid = str(notif["t"])
        attrs = info.common()
        attrs.update({S.TRANSFER_ID: tid, S.NIXL_OP: str(notif.get("o", "")),
                      S.TOKENS: int(notif.get("k", 0)), S.BYTES: int(notif.get("b", 0)),
                      S.DESCRIPTORS: int(notif.get("d", 0)),
                      S.PROBE_ITERATION: int(notif.get("i", 0)),
                      S.PROBE_WARMUP: bool(notif.get("w", 0)),
                      S.PROBE_LAYOUT: str(notif.get("l", ""))})
        if "s" in notif:
            attrs[S.NOTIFY_SENT_NS] = int(notif["s"])
        span = tracer.start_span(S.SpanName.NOTIFY.value, context=transfer_context(tid),
                                 kind=SpanKind.SERVER, attributes=attrs, start_time=received_ns)
        span.end(end_time=received_ns)
    except Exception:
        logger.warning("kvtune probe: could not record a notify span", exc_info=True)
