"""Synthetic spans DataFrames with a known truth, in the shape of ``kvtune.traces.load`` and the span
convention, for tests of everything downstream of the loader.

- :func:`spans_frame` builds a contract-shaped frame from plain span records.
- :func:`probe_spans` makes a fabric-probe sweep (sizes x descriptor layouts x iterations, warm-ups)
  whose critical path costs exactly :meth:`FabricTruth.critical_ms` plus noise and outliers.
- :func:`serving_spans` makes multi-turn conversations through a router, prefill and decode hosts,
  in push, pull or bidirectional mode, with prefill times from :class:`PrefillTruth`, reuse
  decisions and retention spans, optional vLLM ``llm_request`` spans and optional clock skew.

Everything is seeded; the same arguments give the same frame.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import pandas as pd

from kvtune import spans as sc
from kvtune.traces.columns import NULLABLE_DTYPES
from kvtune.analysis.prefill import VLLM_PREFILL_TIME_S, VLLM_PROMPT_TOKENS, VLLM_REQUEST_SPAN

_CONTRACT_DTYPES: dict[str, str] = {
    "trace_id": "str", "span_id": "str", "parent_span_id": "string", "name": "str",
    "service": "str", "host": "str", "start_ns": "int64", "end_ns": "int64",
    "duration_ms": "float64", "status": "str", "status_message": "str",
    "attrs": "object", "resource": "object",
}
try:  # the loader's own column contract (built in parallel); identical by docs/contracts.md
    from kvtune.traces.columns import SPAN_COLUMNS as _COLS, SPAN_DTYPES as _DTYPES
except Exception:  # loader missing or broken: fall back to the contract's lists
    _COLS, _DTYPES = tuple(_CONTRACT_DTYPES), _CONTRACT_DTYPES

SPAN_COLUMNS: tuple[str, ...] = tuple(_COLS)
"""Leading columns of a spans frame (docs/contracts.md), before one column per attribute."""
SPAN_DTYPES: dict[str, str] = dict(_DTYPES)
"""Their dtypes, as the loader makes them."""

T0_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z: a fixed epoch for reproducible frames


def spans_frame(records: Iterable[dict]) -> pd.DataFrame:
    """A spans DataFrame (contract shape) from records with keys ``name, host, start_ns, end_ns,
    attrs`` and optionally ``trace_id, span_id, parent_span_id, service, status, status_message,
    resource``. Every convention attribute gets its typed column (NA when absent)."""
    rows = []
    for i, r in enumerate(records):
        attrs = dict(r.get("attrs", {}))
        host = r.get("host", "")
        rows.append({
            "trace_id": r.get("trace_id", f"{i + 1:032x}"),
            "span_id": r.get("span_id", f"{i + 1:016x}"),
            "parent_span_id": r.get("parent_span_id", pd.NA),
            "name": r["name"],
            "service": r.get("service", "kvtune-sim"),
            "host": host,
            "start_ns": int(r["start_ns"]),
            "end_ns": int(r["end_ns"]),
            "duration_ms": (int(r["end_ns"]) - int(r["start_ns"])) / 1e6,
            "status": r.get("status", "UNSET"),
            "status_message": r.get("status_message", ""),
            "attrs": attrs,
            "resource": dict(r.get("resource", {sc.SERVICE_NAME: r.get("service", "kvtune-sim"),
                                                sc.HOST_NAME: host})),
        })
    data: dict[str, pd.Series] = {}
    for c in SPAN_COLUMNS:
        vals = [row[c] for row in rows]
        data[c] = pd.Series(vals, dtype=SPAN_DTYPES.get(c, "object"))
    for key, typ in sc.ATTRIBUTE_TYPES.items():
        vals = [row["attrs"].get(key, pd.NA) for row in rows]
        vals = [v.value if isinstance(v, Enum) else v for v in vals]
        data[key] = pd.Series(pd.array(vals, dtype=NULLABLE_DTYPES[typ]))
    df = pd.DataFrame(data)
    df.attrs["clock_offsets_ns"] = {}
    df.attrs["skipped"] = []
    df.attrs["sources"] = ["synthetic"]
    return df


@dataclass(frozen=True)
class FabricTruth:
    """Known cost of the critical path (descriptor setup + RDMA) of one transfer."""

    floor_ms: float = 2.0
    bandwidth_gbps: float = 40.0
    per_descriptor_us: float = 5.0
    setup_share: float = 0.3
    """Share of the floor spent in descriptor setup (the rest is in the RDMA span)."""
    noise_rel: float = 0.02
    """Gaussian noise, relative (sd as a share of the time)."""
    noise_abs_ms: float = 0.02
    """Gaussian noise, absolute (sd, ms)."""
    outlier_share: float = 0.05
    outlier_ms: float = 25.0
    """Outliers: this many ms added to the RDMA of ``outlier_share`` of transfers."""

    def critical_ms(self, bytes: float, descriptors: float) -> float:  # shadows bytes(): named for its unit
        """Noise-free descriptor setup + RDMA time."""
        return (self.floor_ms + bytes * 8.0 / (self.bandwidth_gbps * 1e9) * 1e3
                + descriptors * self.per_descriptor_us / 1e3)


@dataclass(frozen=True)
class PrefillTruth:
    """Known prefill cost: ``base + R*per_token + (R*L + R^2/2)/1000 * per_token_prefix_us/1e3``
    for R new tokens after a prefix of L tokens (see ``kvtune.analysis.PrefillCost``)."""

    base_ms: float = 5.0
    per_token_ms: float = 0.05
    per_token_prefix_us: float = 2.0
    noise_rel: float = 0.02

    def prefill_ms(self, new_tokens: float, prefix_tokens: float = 0) -> float:
        attn = (new_tokens * prefix_tokens + new_tokens ** 2 / 2.0) / 1000.0
        return self.base_ms + new_tokens * self.per_token_ms + attn * self.per_token_prefix_us / 1e3


DEFAULT_SIZES_BYTES: tuple[int, ...] = tuple(1 << k for k in range(16, 28, 2))
"""64 KiB .. 32 MiB in factors of 4."""


class _Ids:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def hex(self, n: int) -> str:
        return "".join(f"{int(x):02x}" for x in self.rng.integers(0, 256, n // 2))


def _noisy(rng: np.random.Generator, ms: float, truth: FabricTruth | PrefillTruth) -> float:
    abs_sd = getattr(truth, "noise_abs_ms", 0.0)
    v = ms * (1.0 + rng.normal(0.0, truth.noise_rel)) + rng.normal(0.0, abs_sd)
    return max(v, 1e-3)


def _ns(ms: float) -> int:
    return int(round(ms * 1e6))


def _split_critical(rng: np.random.Generator, truth: FabricTruth, nbytes: int, desc: int,
                    outlier: bool) -> tuple[float, float]:
    """(descriptor_setup_ms, rdma_ms) whose sum is the noisy critical time."""
    setup = truth.floor_ms * truth.setup_share + desc * truth.per_descriptor_us / 1e3
    rdma = truth.critical_ms(nbytes, desc) - setup
    setup, rdma = _noisy(rng, setup, truth), _noisy(rng, rdma, truth)
    if outlier:
        rdma += truth.outlier_ms
    return setup, rdma


def probe_spans(truth: FabricTruth = FabricTruth(), *,
                sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
                descriptor_bytes: Sequence[int | None] = (16384, None), iterations: int = 12,
                warmup: int = 2, seed: int = 0, hosts: tuple[str, str] = ("probe-a", "probe-b"),
                fabric: str = "ucx-tcp-loopback", transport: str | None = "tcp",
                clock_offsets_ns: dict[str, int] | None = None) -> pd.DataFrame:
    """A probe sweep: for each size and descriptor layout (``descriptor_bytes`` bytes per
    descriptor, ``None`` = one merged descriptor), ``warmup`` warm-ups then ``iterations``
    transfers: ``kv.descriptor_setup`` + ``kv.rdma`` on the initiator, ``kv.notify`` on the target.
    ``clock_offsets_ns`` shifts a host's timestamps (an uncorrected clock)."""
    rng = np.random.default_rng(seed)
    ids = _Ids(rng)
    init, targ = hosts
    offs = clock_offsets_ns or {}
    recs: list[dict] = []
    t = float(T0_NS)
    n = 0
    for nbytes in sizes_bytes:
        for per_desc in descriptor_bytes:
            desc = 1 if per_desc is None else max(1, int(nbytes) // int(per_desc))
            layout = sc.Layout.MERGED if per_desc is None else sc.Layout.PER_BLOCK
            for it in range(-warmup, iterations):
                n += 1
                tid = sc.transfer_id(f"probe-{n}", sc.Direction.FORWARD)
                trace = ids.hex(32)
                out = rng.random() < truth.outlier_share and it >= 0
                setup, rdma = _split_critical(rng, truth, int(nbytes), desc, out)
                if it < 0:  # warm-ups are slow (first registration, connection set-up)
                    rdma += 10 * truth.floor_ms
                common = {
                    sc.TRANSFER_ID: tid, sc.MODE: sc.Mode.PROBE.value,
                    sc.DIRECTION: sc.Direction.FORWARD.value, sc.BYTES: int(nbytes),
                    sc.DESCRIPTORS: desc, sc.FABRIC: fabric, sc.PROBE_ITERATION: max(it, 0),
                    sc.PROBE_WARMUP: it < 0, sc.PROBE_LAYOUT: layout.value,
                    sc.BASE_REQUEST_ID: f"probe-{n}", sc.REQUEST_ID: f"probe-{n}",
                    sc.ROLE: sc.Role.PROBE.value, sc.NIXL_BACKEND: "UCX",
                }
                if transport:
                    common[sc.TRANSPORT] = transport
                s0 = t
                s1 = s0 + _ns(setup)
                r0 = s1 + _ns(0.01)
                r1 = r0 + _ns(rdma)
                n1 = r1 + _ns(0.05)
                o_i, o_t = offs.get(init, 0), offs.get(targ, 0)
                svc = sc.service_name(sc.Role.PROBE)
                recs.append({"name": sc.SpanName.DESCRIPTOR_SETUP.value, "host": init,
                             "service": svc, "trace_id": trace, "span_id": ids.hex(16),
                             "start_ns": s0 + o_i, "end_ns": s1 + o_i, "attrs": dict(common)})
                recs.append({"name": sc.SpanName.RDMA.value, "host": init, "service": svc,
                             "trace_id": trace, "span_id": ids.hex(16), "start_ns": r0 + o_i,
                             "end_ns": r1 + o_i, "status": "OK",
                             "attrs": {**common, sc.NIXL_OP: sc.NixlOp.READ.value,
                                       sc.NIXL_POST_US: 15.0, sc.NIXL_XFER_US: rdma * 1e3,
                                       sc.NIXL_STATUS: "DONE"}})
                recs.append({"name": sc.SpanName.NOTIFY.value, "host": targ, "service": svc,
                             "trace_id": trace, "span_id": ids.hex(16),
                             "start_ns": n1 - _ns(0.005) + o_t, "end_ns": n1 + o_t,
                             "attrs": dict(common)})
                t = n1 + _ns(0.5)
    return spans_frame(recs)


@dataclass(frozen=True)
class SyntheticWorkload:
    """A multi-turn serving workload to generate spans for."""

    n_conversations: int = 20
    turns: tuple[int, ...] = (1, 3, 5)
    """Turns per conversation, drawn uniformly from this tuple."""
    first_prompt_tokens: int = 2000
    prompt_sigma: float = 0.5
    """Spread of first-turn prompt lengths: lognormal sigma around ``first_prompt_tokens`` (0: fixed)."""
    turn_prompt_tokens: int = 300
    """New user tokens per later turn (the prompt is history + these)."""
    output_tokens: int = 100
    gap_mean_s: float = 20.0
    """Mean inter-turn gap (exponential): next turn start - previous turn end."""
    conversation_qps: float = 0.5
    """Arrival rate of new conversations (Poisson)."""
    bytes_per_token: int = 131072
    block_tokens: int = 16
    itl_ms: float = 20.0
    """Inter-token latency of decode."""
    prefill_hosts: tuple[str, ...] = ("prefill-0",)
    decode_hosts: tuple[str, ...] = ("decode-0",)
    fabric: str = "efa"
    transport: str | None = "rc"
    ttl_s: float = 60.0
    """decoder_kv_blocks_ttl in force (bidirectional)."""
    threshold_tokens: int = 512
    """kv_recompute_threshold in force (bidirectional)."""
    prefix_hit_share: float = 0.0
    """Non-bidirectional modes: share of later turns whose history hits the prefill's prefix cache."""
    prefill_lease_s: float | None = None
    """Pull: vLLM's ``kv_lease_duration`` in force; set, each prefill ``kv.notify`` carries the
    hold (``kv.prefill_lease.*``: prefill finished -> notified, read, no renewals). None: absent."""


def serving_spans(workload: SyntheticWorkload = SyntheticWorkload(), *,
                  mode: sc.Mode | str = sc.Mode.PULL, fabric: FabricTruth = FabricTruth(),
                  prefill: PrefillTruth = PrefillTruth(), seed: int = 0,
                  vllm_request_spans: bool = False,
                  clock_offsets_ns: dict[str, int] | None = None) -> pd.DataFrame:
    """Router, prefill and decode spans of ``workload`` served in ``mode`` (see module doc)."""
    mode = sc.Mode(mode)
    rng = np.random.default_rng(seed)
    ids = _Ids(rng)
    offs = clock_offsets_ns or {}
    w = workload
    recs: list[dict] = []
    conv_start = float(T0_NS)
    n_req = 0

    def add(name: str, host: str, role: sc.Role, trace: str, s: float, e: float,
            attrs: dict, parent: str | None = None, status: str = "UNSET") -> str:
        sid = ids.hex(16)
        o = offs.get(host, 0)
        recs.append({"name": name, "host": host, "service": sc.service_name(role),
                     "trace_id": trace, "span_id": sid,
                     "parent_span_id": parent if parent else pd.NA,
                     "start_ns": int(s) + o, "end_ns": int(e) + o, "attrs": attrs,
                     "status": status})
        return sid

    for c in range(w.n_conversations):
        conv = f"conv-{c}"
        conv_start += rng.exponential(1.0 / w.conversation_qps) * 1e9
        n_turns = int(rng.choice(w.turns))
        p_host = w.prefill_hosts[c % len(w.prefill_hosts)]
        d_host = w.decode_hosts[c % len(w.decode_hosts)]
        history = 0
        t = conv_start
        prev_end = None
        for turn in range(1, n_turns + 1):
            n_req += 1
            base = f"req-{n_req}"
            trace = ids.hex(32)
            new_user = (max(1, int(round(w.first_prompt_tokens
                                         * math.exp(rng.normal(0.0, w.prompt_sigma)))))
                        if turn == 1 else w.turn_prompt_tokens)
            prompt = history + new_user
            out_tokens = w.output_tokens
            common = {sc.BASE_REQUEST_ID: base, sc.CONVERSATION_ID: conv, sc.TURN: turn,
                      sc.MODE: mode.value, sc.FABRIC: w.fabric}
            if w.transport:
                common[sc.TRANSPORT] = w.transport
            arrival = t
            root_sid = ids.hex(16)
            cursor = arrival + _ns(0.5)
            cached = 0
            # Bidirectional: decide whether to pull the history back from the decode.
            if mode is sc.Mode.BIDIRECTIONAL and turn > 1:
                gap_s = (arrival - prev_end) / 1e9
                if gap_s > w.ttl_s:
                    outcome = sc.ReuseOutcome.EXPIRED
                elif history >= w.threshold_tokens:
                    outcome = sc.ReuseOutcome.PULL
                else:
                    outcome = sc.ReuseOutcome.RECOMPUTE
                add(sc.SpanName.REUSE_DECISION.value, p_host, sc.Role.PREFILL, trace, cursor,
                    cursor + _ns(0.05),
                    {**common, sc.REUSE_OUTCOME: outcome.value, sc.REUSE_REMOTE_TOKENS: history,
                     sc.REUSE_THRESHOLD_TOKENS: w.threshold_tokens}, root_sid)
                ret_out = (sc.RetentionOutcome.EXPIRED if outcome is sc.ReuseOutcome.EXPIRED
                           else sc.RetentionOutcome.REUSED)
                ret_end = prev_end + (w.ttl_s * 1e9 if ret_out is sc.RetentionOutcome.EXPIRED
                                      else arrival - prev_end)
                add(sc.SpanName.RETENTION.value, d_host, sc.Role.DECODE, trace, prev_end, ret_end,
                    {**common, sc.RETENTION_TTL_S: w.ttl_s, sc.RETENTION_OUTCOME: ret_out.value,
                     sc.TOKENS: history})
                cursor += _ns(0.05)
                if outcome is sc.ReuseOutcome.PULL:
                    nblocks = math.ceil(history / w.block_tokens)
                    nbytes = nblocks * w.block_tokens * w.bytes_per_token
                    desc = nblocks * 2
                    setup, rdma = _split_critical(rng, fabric, nbytes, desc,
                                                  rng.random() < fabric.outlier_share)
                    tattrs = {**common, sc.TRANSFER_ID: sc.transfer_id(base, sc.Direction.REVERSE),
                              sc.DIRECTION: sc.Direction.REVERSE.value, sc.TOKENS: history,
                              sc.BLOCKS: nblocks, sc.BYTES: nbytes, sc.DESCRIPTORS: desc,
                              sc.REQUEST_ID: f"cmpl-{base}-0"}
                    s1 = cursor + _ns(setup)
                    add(sc.SpanName.DESCRIPTOR_SETUP.value, p_host, sc.Role.PREFILL, trace,
                        cursor, s1, tattrs, root_sid)
                    r1 = s1 + _ns(0.01) + _ns(rdma)
                    add(sc.SpanName.RDMA.value, p_host, sc.Role.PREFILL, trace, s1 + _ns(0.01), r1,
                        {**tattrs, sc.NIXL_OP: sc.NixlOp.READ.value, sc.NIXL_XFER_US: rdma * 1e3,
                         sc.NIXL_POST_US: 12.0, sc.NIXL_STATUS: "DONE"}, root_sid, "OK")
                    add(sc.SpanName.NOTIFY.value, d_host, sc.Role.DECODE, trace, r1 + _ns(0.03),
                        r1 + _ns(0.04), tattrs, root_sid)
                    cursor = r1 + _ns(0.05)
                    cached = history
            elif turn > 1 and rng.random() < w.prefix_hit_share:
                cached = (history // w.block_tokens) * w.block_tokens
            computed = prompt - cached
            pre_ms = _noisy(rng, prefill.prefill_ms(computed, cached), prefill)
            p_start = cursor
            p_end = p_start + _ns(pre_ms)
            add(sc.SpanName.PREFILL.value, p_host, sc.Role.PREFILL, trace, p_start, p_end,
                {**common, sc.PROMPT_TOKENS: prompt, sc.CACHED_TOKENS: cached,
                 sc.COMPUTED_TOKENS: computed, sc.REQUEST_ID: f"cmpl-{base}-0"}, root_sid)
            if vllm_request_spans:
                add(VLLM_REQUEST_SPAN, p_host, sc.Role.PREFILL, trace, p_start - _ns(0.2),
                    p_end + _ns(0.1), {VLLM_PREFILL_TIME_S: pre_ms / 1e3,
                                       VLLM_PROMPT_TOKENS: prompt})
            # Forward transfer of the prompt's KV.
            nblocks = math.ceil(prompt / w.block_tokens)
            nbytes = nblocks * w.block_tokens * w.bytes_per_token
            desc = nblocks * 2
            setup, rdma = _split_critical(rng, fabric, nbytes, desc,
                                          rng.random() < fabric.outlier_share)
            push = mode is sc.Mode.PUSH
            tattrs = {**common, sc.TRANSFER_ID: sc.transfer_id(base, sc.Direction.FORWARD),
                      sc.DIRECTION: sc.Direction.FORWARD.value, sc.TOKENS: prompt,
                      sc.BLOCKS: nblocks, sc.BYTES: nbytes, sc.DESCRIPTORS: desc,
                      sc.REQUEST_ID: f"cmpl-{base}-0"}
            init_host, init_role = (p_host, sc.Role.PREFILL) if push else (d_host, sc.Role.DECODE)
            targ_host, targ_role = (d_host, sc.Role.DECODE) if push else (p_host, sc.Role.PREFILL)
            x0 = p_end + _ns(0.3)
            if push:
                reg0 = arrival + _ns(0.6)
                reg1 = reg0 + _ns(0.4)
                add(sc.SpanName.REGISTRATION.value, d_host, sc.Role.DECODE, trace, reg0, reg1,
                    tattrs, root_sid)
                add(sc.SpanName.RENDEZVOUS.value, p_host, sc.Role.PREFILL, trace, reg1, p_end,
                    {**tattrs, sc.FIRST_ARRIVAL: sc.FirstArrival.REGISTRATION.value}, root_sid)
                x0 = p_end + _ns(0.02)
            s1 = x0 + _ns(setup)
            add(sc.SpanName.DESCRIPTOR_SETUP.value, init_host, init_role, trace, x0, s1, tattrs,
                root_sid)
            r0 = s1 + _ns(0.01)
            r1 = r0 + _ns(rdma)
            op = sc.NixlOp.WRITE if push else sc.NixlOp.READ
            add(sc.SpanName.RDMA.value, init_host, init_role, trace, r0, r1,
                {**tattrs, sc.NIXL_OP: op.value, sc.NIXL_XFER_US: rdma * 1e3,
                 sc.NIXL_POST_US: 12.0, sc.NIXL_STATUS: "DONE"}, root_sid, "OK")
            hold = {}
            if w.prefill_lease_s is not None and not push:
                held_s = (r1 + _ns(0.03) - p_end) / 1e9
                hold = {sc.PREFILL_LEASE_S: float(w.prefill_lease_s),
                        sc.PREFILL_LEASE_HELD_S: held_s, sc.PREFILL_LEASE_RENEWALS: 0,
                        sc.PREFILL_LEASE_MARGIN_S: float(w.prefill_lease_s) - held_s,
                        sc.PREFILL_LEASE_OUTCOME: sc.PrefillLeaseOutcome.READ.value}
            add(sc.SpanName.NOTIFY.value, targ_host, targ_role, trace, r1 + _ns(0.03),
                r1 + _ns(0.04), {**tattrs, **hold}, root_sid)
            ds1 = r1 + _ns(0.1) + _ns(float(rng.uniform(0.2, 2.0)))
            add(sc.SpanName.DECODE_START.value, d_host, sc.Role.DECODE, trace, r1 + _ns(0.1), ds1,
                tattrs, root_sid)
            first_token = ds1 + _ns(w.itl_ms)
            end = first_token + _ns(w.itl_ms * max(out_tokens - 1, 0))
            ttft_ms = (first_token - arrival) / 1e6
            o = offs.get("router", 0)
            recs.append({"name": sc.SpanName.REQUEST.value, "host": "router",
                         "service": sc.service_name(sc.Role.ROUTER), "trace_id": trace,
                         "span_id": root_sid, "start_ns": int(arrival) + o, "end_ns": int(end) + o,
                         "status": "OK",
                         "attrs": {**common, sc.PROMPT_TOKENS: prompt, sc.OUTPUT_TOKENS: out_tokens,
                                   sc.TTFT_MS: ttft_ms, sc.REQUEST_ID: base,
                                   sc.PREFILL_INSTANCE: f"http://{p_host}:8100",
                                   sc.DECODE_INSTANCE: f"http://{d_host}:8200",
                                   sc.STREAM: True, sc.HTTP_STATUS: 200}})
            history = prompt + out_tokens
            prev_end = end
            t = end + rng.exponential(w.gap_mean_s) * 1e9
    recs.sort(key=lambda r: r["start_ns"])
    return spans_frame(recs)


@dataclass(frozen=True)
class SyntheticCase:
    """A probe sweep and a serving trace generated from one truth (convenience for tests)."""

    fabric: FabricTruth = field(default_factory=FabricTruth)
    prefill: PrefillTruth = field(default_factory=PrefillTruth)
    workload: SyntheticWorkload = field(default_factory=SyntheticWorkload)

    def spans(self, *, mode: sc.Mode | str = sc.Mode.PULL, seed: int = 0) -> pd.DataFrame:
        """Probe sweep + serving trace in one frame."""
        probe = probe_spans(self.fabric, seed=seed)
        serve = serving_spans(self.workload, mode=mode, fabric=self.fabric, prefill=self.prefill,
                              seed=seed + 1)
        out = pd.concat([probe, serve], ignore_index=True)
        out.attrs.update(probe.attrs)
        return out


def _otlp_value(v: object) -> dict:
    if isinstance(v, Enum):
        v = v.value
    if isinstance(v, (bool, np.bool_)):
        return {"boolValue": bool(v)}
    if isinstance(v, (int, np.integer)):
        return {"intValue": str(int(v))}
    if isinstance(v, (float, np.floating)):
        return {"doubleValue": float(v)}
    return {"stringValue": str(v)}


def write_otlp_json(spans: pd.DataFrame, path: str | os.PathLike[str]) -> int:
    """Write a spans frame as OTLP-JSON lines (docs/contracts.md), one line per (service, host);
    returns the number of spans written. Reading it back with ``kvtune.traces.load`` gives the
    same spans (the round trip the CLI tests rely on)."""
    lines = []
    for (service, host), g in spans.groupby(["service", "host"], sort=True):
        out = []
        for r in g.itertuples(index=False):
            parent = getattr(r, "parent_span_id")
            out.append({
                "traceId": r.trace_id, "spanId": r.span_id,
                "parentSpanId": "" if pd.isna(parent) else str(parent), "name": r.name,
                "kind": 1, "startTimeUnixNano": str(int(r.start_ns)),
                "endTimeUnixNano": str(int(r.end_ns)),
                "attributes": [{"key": k, "value": _otlp_value(v)} for k, v in r.attrs.items()
                               if v is not None and not (isinstance(v, float) and math.isnan(v))],
                "status": {"code": {"OK": 1, "ERROR": 2}.get(str(r.status), 0),
                           "message": str(r.status_message or "")},
            })
        res = [{"key": sc.SERVICE_NAME, "value": {"stringValue": str(service)}},
               {"key": sc.HOST_NAME, "value": {"stringValue": str(host)}}]
        lines.append(json.dumps({"resourceSpans": [{"resource": {"attributes": res}, "scopeSpans": [
            {"scope": {"name": "kvtune.synthetic"}, "spans": out}]}]}))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return len(spans)


@dataclass(frozen=True)
class Step:
    """One span of a hand-built request (:func:`request_spans`), in ms from the request's start."""

    name: sc.SpanName
    role: sc.Role
    start_ms: float
    end_ms: float


ROLE_HOSTS: dict[sc.Role, str] = {sc.Role.ROUTER: "router", sc.Role.PREFILL: "prefill-0",
                                  sc.Role.DECODE: "decode-0"}
"""The host each role's spans of :func:`request_spans` come from."""


def request_spans(steps: Sequence[Step], *, end_ms: float, trace_id: str = "a" * 32,
                  mode: sc.Mode | str = sc.Mode.PULL, t0_ns: int = T0_NS,
                  clock_offsets_ns: dict[str, int] | None = None) -> list[dict]:
    """Span records (for :func:`spans_frame`) of one router-traced request: its ``kv.request``
    from 0 to ``end_ms`` and ``steps``, each on its role's host (:data:`ROLE_HOSTS`) shifted by
    that host's clock offset. Tiny frames with hand-computed answers are built from these."""
    offs = clock_offsets_ns or {}
    mode = sc.Mode(mode).value
    root = f"{trace_id[:8]}{1:08x}"

    def rec(name: str, role: sc.Role, s_ms: float, e_ms: float, n: int) -> dict:
        host = ROLE_HOSTS[role]
        o = offs.get(host, 0)
        return {"name": name, "host": host, "service": sc.service_name(role),
                "trace_id": trace_id, "span_id": root if n < 0 else f"{trace_id[:8]}{n + 2:08x}",
                "parent_span_id": pd.NA if n < 0 else root,
                "start_ns": t0_ns + _ns(s_ms) + o, "end_ns": t0_ns + _ns(e_ms) + o,
                "attrs": {sc.MODE: mode, sc.ROLE: role.value}}

    out = [rec(sc.SpanName.REQUEST.value, sc.Role.ROUTER, 0.0, end_ms, -1)]
    out += [rec(s.name.value, s.role, s.start_ms, s.end_ms, i) for i, s in enumerate(steps)]
    return out
