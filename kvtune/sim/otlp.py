"""The simulation's spans in the kvtune convention: built from the request timelines after the run,
written as OTLP-JSON lines by a direct writer (the SDK is far too slow for millions of spans) or
handed out as SDK ``ReadableSpan`` objects.

Each simulated role/instance is one resource (``service.name`` ``kvtune-<role>``, ``host.name``
``sim-<role>-<i>``), so the spans look like those of a real deployment: ``kv.request`` on the
router is the root; prefill, transfer-phase and reuse spans are its children. ``kv.retention``
outlives its request, so it is a second root in the finished request's trace.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from kvtune import spans as S
from kvtune.sim.config import SimConfig, TransferModel
from kvtune.sim.timeline import Timeline, conversation_id, request_id

SCOPE_NAME = "kvtune.sim"
SPANS_PER_LINE = 4096
"""Spans per OTLP-JSON line (one ExportTraceServiceRequest), like an exporter's batch."""
_KIND_INTERNAL, _KIND_SERVER = 1, 2  # OTLP/JSON span kinds
_ROUTER, _PREFILL, _DECODE = S.Role.ROUTER.value, S.Role.PREFILL.value, S.Role.DECODE.value

# A span record: resource key, trace id, span id, parent span id (0 = root), name, OTLP kind,
# start ns, end ns, attributes.
Record = tuple[tuple[str, int], int, int, int, str, int, int, int, dict[str, Any]]


def _engine_id(role: str, inst: int) -> str:
    return f"sim-{role}-{inst}"


def resource_attributes(config: SimConfig, key: tuple[str, int]) -> dict[str, Any]:
    role, inst = key
    from kvtune import __version__ as kvtune_version
    attrs: dict[str, Any] = {
        S.SERVICE_NAME: S.service_name(role),
        S.HOST_NAME: _engine_id(role, inst) if role != _ROUTER else "sim-router",
        S.KVTUNE_CONVENTION: S.CONVENTION_VERSION,
        S.KVTUNE_VERSION: str(kvtune_version),
    }
    if config.model:
        attrs[S.MODEL] = config.model
    return attrs


def records(cfg: SimConfig, timeline: Timeline) -> Iterator[Record]:
    """Every span of the run, request by request (retention spans last)."""
    t0 = cfg.start_unix_ns
    mode = cfg.mode.value
    tm, rtm = cfg.transfer, cfg.reverse_transfer or cfg.transfer
    bidi = mode == S.Mode.BIDIRECTIONAL.value
    push = mode == S.Mode.PUSH.value
    trace_hi = (cfg.seed * 0x9E3779B1 + 0x5EED) & 0xFFFFFFFFFFFFFFFF or 1
    counter = 0
    roots: dict[int, tuple[int, int]] = {}

    def ns(ms: float) -> int:
        return t0 + int(round(ms * 1e6))

    def sid() -> int:
        nonlocal counter
        counter += 1
        return counter

    def ok(x: float) -> bool:
        return not math.isnan(x)

    for r in timeline.requests:
        if math.isnan(r.done):
            continue  # did not finish (cannot happen in a drained run; kept for safety)
        rid = request_id(r.idx)
        conv = conversation_id(r.conv)
        trace = (trace_hi << 64) | (r.idx + 1)
        root = sid()
        roots[r.idx] = (trace, root)
        p_key, d_key = (_PREFILL, r.pinst), (_DECODE, r.dinst)
        p_eng, d_eng = _engine_id(*p_key), _engine_id(*d_key)
        common = {S.REQUEST_ID: rid, S.BASE_REQUEST_ID: rid, S.CONVERSATION_ID: conv, S.TURN: r.turn,
                  S.MODE: mode}
        ttft = r.first_token + cfg.overheads.hop_ms - r.arrival
        yield ((_ROUTER, 0), trace, root, 0, S.SpanName.REQUEST.value, _KIND_SERVER, ns(r.arrival),
               ns(r.done), {**common, S.ROLE: _ROUTER, S.PROMPT_TOKENS: r.prompt,
                            S.OUTPUT_TOKENS: r.output, S.TTFT_MS: float(ttft),
                            S.PREFILL_INSTANCE: p_eng, S.DECODE_INSTANCE: d_eng, S.STREAM: True,
                            S.HTTP_STATUS: 200})
        on_p = {**common, S.ROLE: _PREFILL, S.ENGINE_ID: p_eng}
        on_d = {**common, S.ROLE: _DECODE, S.ENGINE_ID: d_eng}
        # each engine's intake: its API server stamped the leg's arrival -> the engine took it in
        for key, attrs, start, end in ((p_key, on_p, r.at_prefill, r.prefill_seen),
                                       (d_key, on_d, r.at_decode, r.decode_seen)):
            if ok(start) and ok(end):
                yield (key, trace, sid(), root, S.SpanName.QUEUE.value, _KIND_INTERNAL, ns(start),
                       ns(end), attrs)
        if bidi:
            yield (p_key, trace, sid(), root, S.SpanName.REUSE_DECISION.value, _KIND_INTERNAL,
                   ns(r.decision), ns(r.decision),
                   {**on_p, S.REUSE_OUTCOME: r.outcome or S.ReuseOutcome.NONE.value,
                    S.REUSE_REMOTE_TOKENS: r.remote_tokens,
                    S.REUSE_THRESHOLD_TOKENS: int(cfg.reuse.threshold_tokens)})
        if r.rev_tokens and ok(r.rev_rdma_end):
            xfer = _transfer_attrs(rtm, r.rev_tokens, rid, S.Direction.REVERSE, cfg.fabric)
            ini = {**on_p, **xfer, S.REMOTE_ENGINE_ID: d_eng}
            yield (p_key, trace, sid(), root, S.SpanName.DESCRIPTOR_SETUP.value, _KIND_INTERNAL,
                   ns(r.rev_setup_start), ns(r.rev_setup_end), ini)
            yield (p_key, trace, sid(), root, S.SpanName.RDMA.value, _KIND_INTERNAL,
                   ns(r.rev_rdma_post), ns(r.rev_rdma_end),
                   {**ini, S.NIXL_OP: S.NixlOp.READ.value, S.NIXL_STATUS: "DONE",
                    S.NIXL_XFER_US: (r.rev_rdma_end - r.rev_rdma_post) * 1e3})
            yield (d_key, trace, sid(), root, S.SpanName.NOTIFY.value, _KIND_INTERNAL,
                   ns(r.rev_rdma_end), ns(r.rev_notify),
                   {**on_d, **xfer, S.REMOTE_ENGINE_ID: p_eng, S.NOTIFY_SENT_NS: ns(r.rev_rdma_end)})
        yield (p_key, trace, sid(), root, S.SpanName.PREFILL.value, _KIND_INTERNAL,
               ns(r.prefill_start), ns(r.prefill_end),
               {**on_p, S.PROMPT_TOKENS: r.prompt, S.CACHED_TOKENS: r.cached,
                S.COMPUTED_TOKENS: r.computed})
        xfer = _transfer_attrs(tm, r.fwd_tokens, rid, S.Direction.FORWARD, cfg.fabric)
        if push:
            ini, tgt = {**on_p, **xfer, S.REMOTE_ENGINE_ID: d_eng}, {**on_d, **xfer, S.REMOTE_ENGINE_ID: p_eng}
            first = S.FirstArrival.REGISTRATION if r.reg_arrive <= r.prefill_end else S.FirstArrival.PREFILL
            yield (d_key, trace, sid(), root, S.SpanName.REGISTRATION.value, _KIND_INTERNAL,
                   ns(r.reg_start), ns(r.reg_end), tgt)
            yield (p_key, trace, sid(), root, S.SpanName.RENDEZVOUS.value, _KIND_INTERNAL,
                   ns(min(r.reg_arrive, r.prefill_end)), ns(max(r.reg_arrive, r.prefill_end)),
                   {**ini, S.FIRST_ARRIVAL: first.value})
            op, ini_key, tgt_key, tgt_attrs = S.NixlOp.WRITE.value, p_key, d_key, tgt
        else:
            ini, tgt = {**on_d, **xfer, S.REMOTE_ENGINE_ID: p_eng}, {**on_p, **xfer, S.REMOTE_ENGINE_ID: d_eng}
            op, ini_key, tgt_key, tgt_attrs = S.NixlOp.READ.value, d_key, p_key, tgt
        yield (ini_key, trace, sid(), root, S.SpanName.DESCRIPTOR_SETUP.value, _KIND_INTERNAL,
               ns(r.setup_start), ns(r.setup_end), ini)
        yield (ini_key, trace, sid(), root, S.SpanName.RDMA.value, _KIND_INTERNAL,
               ns(r.rdma_post), ns(r.rdma_end),
               {**ini, S.NIXL_OP: op, S.NIXL_STATUS: "DONE",
                S.NIXL_XFER_US: (r.rdma_end - r.rdma_post) * 1e3})
        yield (tgt_key, trace, sid(), root, S.SpanName.NOTIFY.value, _KIND_INTERNAL,
               ns(r.rdma_end), ns(r.notify), {**tgt_attrs, S.NOTIFY_SENT_NS: ns(r.rdma_end)})
        yield (d_key, trace, sid(), root, S.SpanName.DECODE_START.value, _KIND_INTERNAL,
               ns(r.kv_ready), ns(r.decode_start), {**on_d, **xfer, S.REMOTE_ENGINE_ID: p_eng})
    for ret in timeline.retentions:
        owner = roots.get(ret.req_idx)
        if owner is None or math.isnan(ret.end):
            continue
        req = timeline.requests[ret.req_idx]
        rid = request_id(req.idx)
        # in the finished request's trace but not its child: it outlives the request span
        yield ((_DECODE, ret.dinst), owner[0], sid(), 0, S.SpanName.RETENTION.value,
               _KIND_INTERNAL, ns(ret.start), ns(ret.end),
               {S.REQUEST_ID: rid, S.BASE_REQUEST_ID: rid, S.CONVERSATION_ID: conversation_id(ret.conv),
                S.TURN: req.turn, S.MODE: mode, S.ROLE: _DECODE, S.ENGINE_ID: _engine_id(_DECODE, ret.dinst),
                S.TOKENS: ret.tokens, S.BLOCKS: tm.blocks(ret.tokens),
                S.RETENTION_TTL_S: float(ret.ttl_s), S.RETENTION_OUTCOME: ret.outcome})


def _transfer_attrs(tm: TransferModel, tokens: int, rid: str, direction: S.Direction, fabric: str) -> dict[str, Any]:
    return {S.TRANSFER_ID: S.transfer_id(rid, direction), S.DIRECTION: direction.value,
            S.TOKENS: int(tokens), S.BLOCKS: tm.blocks(tokens), S.BYTES: tm.bytes(tokens),
            S.DESCRIPTORS: tm.descriptors(tokens), S.FABRIC: fabric}


# --- OTLP/JSON ----------------------------------------------------------------------------------
# Spans are encoded straight to JSON text: per-key prefixes are built once and values are
# formatted by type, which is several times faster than building dicts for json.dumps.
_KEY_PREFIX: dict[str, str] = {}


def _prefix(key: str) -> str:
    pre = _KEY_PREFIX.get(key)
    if pre is None:
        pre = _KEY_PREFIX[key] = '{"key":' + json.dumps(key) + ',"value":{'
    return pre


def _json_str(v: str) -> str:
    if v.isascii() and '"' not in v and "\\" not in v and v.isprintable():
        return '"' + v + '"'
    return json.dumps(v)


def _value_json(v: Any) -> str:
    t = type(v)
    if t is str:
        return '"stringValue":' + _json_str(v)
    if t is bool:
        return '"boolValue":true' if v else '"boolValue":false'
    if t is int:
        return f'"intValue":"{v}"'
    if t is float:
        return f'"doubleValue":{v!r}' if math.isfinite(v) else f'"doubleValue":"{v}"'
    return '"stringValue":' + _json_str(str(v))


def _attrs_json(attrs: dict[str, Any]) -> str:
    return ",".join([_prefix(k) + _value_json(v) + "}}" for k, v in attrs.items()])


def _span_json(rec: Record) -> str:
    _, trace, span, parent, name, kind, start, end, attrs = rec
    return (f'{{"traceId":"{trace:032x}","spanId":"{span:016x}","parentSpanId":"'
            + (f"{parent:016x}" if parent else "")
            + f'","name":"{name}","kind":{kind},"startTimeUnixNano":"{start}",'
            f'"endTimeUnixNano":"{end}","attributes":[{_attrs_json(attrs)}],"status":{{}}}}')


def write_otlp_jsonl(config: SimConfig, timeline: Timeline, path: Path, *,
                     progress: bool = False) -> int:
    """Write every span to ``path`` (OTLP-JSON lines); returns the span count."""
    from kvtune import __version__ as kvtune_version
    path.parent.mkdir(parents=True, exist_ok=True)
    scope = json.dumps({"name": SCOPE_NAME, "version": str(kvtune_version)}, separators=(",", ":"))
    res_cache: dict[tuple[str, int], str] = {}
    n = 0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(timeline.requests), unit="req", desc="spans", leave=False)
    with path.open("w", encoding="utf-8") as fh:
        batch: dict[tuple[str, int], list[str]] = {}
        count = 0
        for rec in records(config, timeline):
            batch.setdefault(rec[0], []).append(_span_json(rec))
            count += 1
            if bar is not None and rec[5] == _KIND_SERVER:
                bar.update(1)
            if count >= SPANS_PER_LINE:
                n += _flush(fh, batch, res_cache, config, scope)
                batch, count = {}, 0
        n += _flush(fh, batch, res_cache, config, scope)
    if bar is not None:
        bar.close()
    return n


def _flush(fh: IO[str], batch: dict[tuple[str, int], list[str]],
           res_cache: dict[tuple[str, int], str], config: SimConfig, scope: str) -> int:
    if not batch:
        return 0
    parts = []
    n = 0
    for key, span_list in batch.items():
        res = res_cache.get(key)
        if res is None:
            res = res_cache[key] = _attrs_json(resource_attributes(config, key))
        parts.append('{"resource":{"attributes":[' + res + ']},"scopeSpans":[{"scope":' + scope
                     + ',"spans":[' + ",".join(span_list) + "]}]}")
        n += len(span_list)
    fh.write('{"resourceSpans":[' + ",".join(parts) + "]}\n")
    return n


# --- OpenTelemetry SDK objects ------------------------------------------------------------------
def readable_spans(config: SimConfig, timeline: Timeline) -> list:
    """Every span as an SDK ``ReadableSpan`` (for exporters and in-memory checks)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

    from kvtune import __version__ as kvtune_version
    scope = InstrumentationScope(SCOPE_NAME, str(kvtune_version))
    resources: dict[tuple[str, int], Resource] = {}
    flags = TraceFlags(TraceFlags.SAMPLED)
    out = []
    for key, trace, span, parent, name, kind, start, end, attrs in records(config, timeline):
        res = resources.get(key)
        if res is None:
            res = resources[key] = Resource(resource_attributes(config, key))
        out.append(ReadableSpan(
            name=name, context=SpanContext(trace, span, is_remote=False, trace_flags=flags),
            parent=SpanContext(trace, parent, is_remote=False, trace_flags=flags) if parent else None,
            resource=res, attributes=attrs,
            kind=SpanKind.SERVER if kind == _KIND_SERVER else SpanKind.INTERNAL,
            start_time=start, end_time=end, instrumentation_scope=scope))
    return out
