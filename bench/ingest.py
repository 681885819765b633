"""A fleet's spans in bounded memory: the streamed reduction against the in-memory analysis, in one
run.

Generates N spans (default 10,000,000) of the span convention as OTLP-JSON lines: conversations of
1-5 turns in pull mode through the router (``kv.request``, ``kv.queue``, ``kv.prefill``,
``kv.descriptor_setup``, ``kv.rdma``, ``kv.notify``, ``kv.decode_start``: 7 spans a request),
think-time gaps between turns, prefill and transfer times drawn from a known cost model with 3%
noise. Files are written in parts of ``--subset`` spans (whole conversations); part 0 is the
subset. Then, in fresh subprocesses one after the other:

- ``streamed``: ``kvtune.analysis.reduced.reduce_source(all parts, max_spans=--max-spans,
  max_transfers=--max-transfers)`` (a sample of whole conversations as the spans frame, the fits
  reading a larger sample chunk by chunk) and ``kvtune.recommend.recommend`` on it: wall time,
  spans read per second, peak RSS (``VmHWM``), the recommendation;
- ``subset``: ``kvtune.traces.load(part 0)`` (every span of the subset in one frame) and
  ``recommend``: the same.

Prints both, whether threshold, TTL and mode are identical, and each interval's width in the
streamed run over the subset's (aim: <= 1.1; peak RSS of the streamed run aim < 1.5 GB).

    .venv/bin/python bench/ingest.py [--spans 10000000] [--subset 1000000]
                                     [--max-spans 200000] [--max-transfers 250000] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
from tqdm import tqdm

from kvtune import spans

SPANS_PER_REQUEST = 7
SPANS_PER_LINE = 512
"""Spans per ExportTraceServiceRequest line (the SDK's BatchSpanProcessor exports up to 512)."""
NS_PER_MS = 1_000_000
BYTES_PER_TOKEN = 32 * 1024
BLOCK_TOKENS = 16
DESCRIPTORS_PER_BLOCK = 64
FIRST_PROMPTS = (256, 1024, 2048)
TURNS = (1, 5)
NEW_TOKENS = 64
OUTPUT_TOKENS = 64
GAP_S = (0.5, 20.0)
"""Think time between a turn's answer and the next turn: uniform (bounded, as agents' timeouts are)."""
QPS = 5.0
FLOOR_MS = 0.797
"""Transfer floor (setup + RDMA at zero bytes). With these costs the true break-even is 106.5
tokens, midway between two integers: the threshold is that estimate rounded up, so two samples give
the same value when their estimates differ by less than the distance to the next integer."""
SETUP_MS = 0.2
BANDWIDTH_GBPS = 100.0
PREFILL_BASE_MS = 2.0
PREFILL_PER_TOKEN_MS = 0.010
PREFILL_PREFIX_US = 2.0
"""Microseconds per new token per 1000 tokens of context (kvtune.analysis.prefill's model)."""
NOISE = 0.03


def _kv(key: str, value: object) -> dict:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    if isinstance(value, float):
        return {"key": key, "value": {"doubleValue": value}}
    return {"key": key, "value": {"stringValue": str(value)}}


def _resource(role: spans.Role, host: str) -> dict:
    return {"attributes": [_kv(spans.SERVICE_NAME, spans.service_name(role)),
                           _kv(spans.HOST_NAME, host),
                           _kv(spans.KVTUNE_CONVENTION, spans.CONVENTION_VERSION)]}


class _Writer:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.roles = {spans.Role.ROUTER: "host-router", spans.Role.PREFILL: "host-p0",
                      spans.Role.DECODE: "host-d0"}
        self.files = {r: open(directory / f"{r.value}.jsonl", "wb") for r in self.roles}
        self.pending: dict[spans.Role, list[dict]] = {r: [] for r in self.roles}
        self.enc = msgspec.json.Encoder()

    def add(self, role: spans.Role, span: dict) -> None:
        self.pending[role].append(span)
        if len(self.pending[role]) >= SPANS_PER_LINE:
            self.flush(role)

    def flush(self, role: spans.Role) -> None:
        if not self.pending[role]:
            return
        doc = {"resourceSpans": [{"resource": _resource(role, self.roles[role]),
                                  "scopeSpans": [{"scope": {"name": "kvtune"},
                                                  "spans": self.pending[role]}]}]}
        self.files[role].write(self.enc.encode(doc) + b"\n")
        self.pending[role] = []

    def close(self) -> None:
        for role in self.roles:
            self.flush(role)
            self.files[role].close()


def _span(ids: np.random.Generator, trace_id: str, parent: str, name: spans.SpanName, start: int,
          dur_ns: int, attrs: dict) -> dict:
    return {"traceId": trace_id, "spanId": f"{int(ids.integers(1, 2**63)):016x}",
            "parentSpanId": parent, "name": name.value, "kind": 1,
            "startTimeUnixNano": str(start), "endTimeUnixNano": str(start + max(dur_ns, 0)),
            "attributes": [_kv(k, v) for k, v in attrs.items()], "status": {}}


def _prefill_ms(tokens: int) -> float:
    return (PREFILL_BASE_MS + tokens * PREFILL_PER_TOKEN_MS
            + (tokens ** 2 / 2.0) / 1000.0 * PREFILL_PREFIX_US / 1e3)


def _request(w: _Writer, rng: np.random.Generator, conv: str, turn: int, prompt: int,
             start: int) -> int:
    """Writes one request's spans; returns its end (ns)."""
    tid = f"{int(rng.integers(1, 2**63)):016x}{int(rng.integers(1, 2**63)):016x}"
    base = f"{conv}-t{turn}"
    noise = np.exp(rng.normal(0.0, NOISE, 4))
    queue_ns = int(0.3 * NS_PER_MS * noise[0])
    pre_ns = int(_prefill_ms(prompt) * NS_PER_MS * noise[1])
    nbytes = prompt * BYTES_PER_TOKEN
    blocks = math.ceil(prompt / BLOCK_TOKENS)
    setup_ns = int(SETUP_MS * NS_PER_MS * noise[2])
    rdma_ns = int(((FLOOR_MS - SETUP_MS) + nbytes * 8 / (BANDWIDTH_GBPS * 1e9) * 1e3)
                  * NS_PER_MS * noise[3])
    hop_ns = 2 * NS_PER_MS
    t_pre = start + NS_PER_MS
    t_dec = t_pre + queue_ns + pre_ns + hop_ns
    t_rdma = t_dec + setup_ns
    t_ready = t_rdma + rdma_ns
    end = t_ready + 40 * NS_PER_MS
    root = _span(rng, tid, "", spans.SpanName.REQUEST, start, end - start,
                 {spans.REQUEST_ID: base, spans.BASE_REQUEST_ID: base,
                  spans.CONVERSATION_ID: conv, spans.TURN: turn, spans.MODE: "pull",
                  spans.PROMPT_TOKENS: prompt, spans.OUTPUT_TOKENS: OUTPUT_TOKENS,
                  spans.STREAM: False, spans.HTTP_STATUS: 200})
    pid = root["spanId"]
    common = {spans.MODE: "pull", spans.BASE_REQUEST_ID: base,
              spans.TRANSFER_ID: spans.transfer_id(base, spans.Direction.FORWARD),
              spans.DIRECTION: spans.Direction.FORWARD.value}
    p = {spans.ROLE: spans.Role.PREFILL.value, spans.ENGINE_ID: "prefill-0",
         spans.REQUEST_ID: f"cmpl-{base}-p"}
    d = {spans.ROLE: spans.Role.DECODE.value, spans.ENGINE_ID: "decode-0",
         spans.REQUEST_ID: f"cmpl-{base}-d"}
    size = {spans.TOKENS: prompt, spans.BLOCKS: blocks,
            spans.DESCRIPTORS: blocks * DESCRIPTORS_PER_BLOCK, spans.TP_RANK: 0}
    w.add(spans.Role.ROUTER, root)
    w.add(spans.Role.PREFILL, _span(rng, tid, pid, spans.SpanName.QUEUE, t_pre, queue_ns,
                                    {**p, spans.MODE: "pull", spans.PROMPT_TOKENS: prompt}))
    w.add(spans.Role.PREFILL, _span(rng, tid, pid, spans.SpanName.PREFILL, t_pre + queue_ns,
                                    pre_ns, {**p, **common, spans.PROMPT_TOKENS: prompt,
                                             spans.CACHED_TOKENS: 0,
                                             spans.COMPUTED_TOKENS: prompt}))
    w.add(spans.Role.DECODE, _span(rng, tid, pid, spans.SpanName.DESCRIPTOR_SETUP, t_dec,
                                   setup_ns, {**d, **common, **size,
                                              spans.NIXL_OP: spans.NixlOp.READ.value,
                                              spans.NIXL_BACKEND: "UCX",
                                              spans.REMOTE_ENGINE_ID: "prefill-0"}))
    w.add(spans.Role.DECODE, _span(rng, tid, pid, spans.SpanName.RDMA, t_rdma, rdma_ns,
                                   {**d, **common, **size, spans.BYTES: nbytes,
                                    spans.NIXL_OP: spans.NixlOp.READ.value,
                                    spans.NIXL_BACKEND: "UCX", spans.FABRIC: "efa",
                                    spans.NIXL_POST_US: 20.0,
                                    spans.NIXL_XFER_US: rdma_ns / 1e3,
                                    spans.REMOTE_ENGINE_ID: "prefill-0"}))
    w.add(spans.Role.PREFILL, _span(rng, tid, pid, spans.SpanName.NOTIFY, t_ready, 0,
                                    {**p, **common, spans.TOKENS: prompt}))
    w.add(spans.Role.DECODE, _span(rng, tid, pid, spans.SpanName.DECODE_START, t_ready,
                                   NS_PER_MS, {**d, **common, spans.TOKENS: prompt}))
    return end


def generate(out_dir: Path, n_spans: int, subset_spans: int, seed: int = 0) -> list[Path]:
    """Writes about ``n_spans`` spans as ``out_dir/part-NNN/{router,prefill,decode}.jsonl``, each
    part about ``subset_spans`` spans of whole conversations; returns the part directories."""
    rng = np.random.default_rng(seed)
    t = 1_790_000_000 * 10**9
    written, part_spans, part = 0, 0, 0
    parts = [out_dir / "part-000"]
    w = _Writer(parts[0])
    bar = tqdm(total=n_spans, desc="generating", unit="span", unit_scale=True, file=sys.stderr)
    conv_no = 0
    mean_turns = (TURNS[0] + TURNS[1]) / 2
    while written < n_spans:
        if part_spans >= subset_spans:
            w.close()
            part += 1
            parts.append(out_dir / f"part-{part:03d}")
            w = _Writer(parts[-1])
            part_spans = 0
        conv = f"conv-{conv_no:08d}"
        conv_no += 1
        t += int(rng.exponential(mean_turns / QPS) * 1e9)  # conversations arrive at QPS / turns
        turns = int(rng.integers(TURNS[0], TURNS[1] + 1))
        prompt = int(rng.choice(FIRST_PROMPTS))
        at = t
        for turn in range(1, turns + 1):
            end = _request(w, rng, conv, turn, prompt, at)
            at = end + int(rng.uniform(*GAP_S) * 1e9)
            prompt += OUTPUT_TOKENS + NEW_TOKENS
        n = turns * SPANS_PER_REQUEST
        written += n
        part_spans += n
        bar.update(n)
    w.close()
    bar.close()
    return parts


def _values(tuning) -> dict:
    ev = tuning.threshold.evidence
    return {"threshold": tuning.threshold.value, "threshold_range": list(tuning.threshold.range),
            "break_even_tokens": ev.break_even_tokens,
            "break_even_range_fabric_tokens": list(ev.break_even_range_fabric_tokens),
            "break_even_range_prefill_tokens": list(ev.break_even_range_prefill_tokens),
            "ttl_s": tuning.ttl.value, "ttl_range_s": list(tuning.ttl.range),
            "mode": tuning.mode.value, "mode_range": list(tuning.mode.range),
            "floor_ms": tuning.fit.floor_ms, "floor_ci_ms": list(tuning.fit.floor_ci_ms),
            "bandwidth_gbps": tuning.fit.bandwidth_gbps, "n_transfers": tuning.fit.n_transfers,
            "findings": [f.code for f in tuning.findings]}


def _child(kind: str, max_spans: int, max_transfers: int, dirs: list[str]) -> None:
    """Runs one pipeline in this (fresh) process and prints a JSON result line."""
    from kvtune.recommend import recommend

    t, cpu = time.perf_counter(), time.process_time()
    if kind == "streamed":
        from kvtune.analysis.reduced import reduce_source
        df = reduce_source(dirs, max_spans=max_spans, max_transfers=max_transfers,
                           progress=False)
        sample = df.attrs["sample"]
        spans_read = sample.source_spans
    else:
        from kvtune.traces import load
        df = load(dirs, progress=False)
        sample, spans_read = None, len(df)
    read_wall = time.perf_counter() - t
    tuning = recommend(df)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    # VmHWM: this process image's own peak (ru_maxrss keeps the forking parent's across exec)
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    peak_kib = int(hwm.split()[1])
    print(json.dumps({"kind": kind, "spans_read": spans_read, "spans_analyzed": len(df),
                      "read_wall_s": read_wall, "wall_s": wall, "cpu_s": cpu,
                      "peak_rss_mib": peak_kib / 1024,
                      "sample": sample.as_dict() if sample is not None else None,
                      "values": _values(tuning)}, default=str))


def _measure(kind: str, max_spans: int, max_transfers: int, dirs: list[Path]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", kind, str(max_spans),
                           str(max_transfers), *map(str, dirs)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _width(r: list) -> float | None:
    try:
        return float(r[1]) - float(r[0])
    except (TypeError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=10_000_000)
    ap.add_argument("--subset", type=int, default=1_000_000)
    ap.add_argument("--max-spans", type=int, default=200_000)
    ap.add_argument("--max-transfers", type=int, default=250_000)
    ap.add_argument("--keep", type=Path,
                    help="write the spans here and keep them (reused when the counts match)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child[0], int(args.child[1]), int(args.child[2]), args.child[3:])
        return 0
    print(f"uptime: {os.popen('uptime').read().strip()}")
    directory = args.keep or Path(tempfile.mkdtemp(prefix="kvtune-ingest-"))
    try:
        marker = directory / "generated.txt"
        want = f"{args.spans} {args.subset}"
        if args.keep is not None and marker.exists() and marker.read_text().strip() == want:
            parts = sorted(directory.glob("part-*"))
            print(f"reusing {args.spans} spans in {directory}")
        else:
            t = time.perf_counter()
            parts = generate(directory, args.spans, args.subset)
            marker.write_text(want + "\n")
            print(f"generated {args.spans} spans in {len(parts)} parts in "
                  f"{time.perf_counter() - t:.0f} s")
        size = sum(f.stat().st_size for p in parts for f in p.iterdir())
        print(f"{size / 2**30:.2f} GiB of OTLP-JSON lines ({size / args.spans:.0f} B/span)")
        streamed = _measure("streamed", args.max_spans, args.max_transfers, parts)
        subset = _measure("subset", args.max_spans, args.max_transfers, parts[:1])
        for r in (streamed, subset):
            print(f"{r['kind']:>8}: {r['spans_read']:,} spans read, {r['spans_analyzed']:,} "
                  f"analyzed; read {r['read_wall_s']:.0f} s ({r['spans_read'] / r['read_wall_s']:,.0f}"
                  f" spans/s), total {r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s CPU; peak RSS "
                  f"{r['peak_rss_mib']:,.0f} MiB")
            print(f"          {json.dumps(r['values'])}")
        if streamed["sample"]:
            print(f"sample: {json.dumps(streamed['sample'])}")
        a, b = streamed["values"], subset["values"]
        same = {k: a[k] == b[k] for k in ("threshold", "ttl_s", "mode")}
        print(f"identical values (streamed over {streamed['spans_read']:,} spans vs in-memory over "
              f"the {subset['spans_read']:,}-span subset): {same}")
        for k in ("threshold_range", "break_even_range_fabric_tokens",
                  "break_even_range_prefill_tokens", "ttl_range_s", "floor_ci_ms"):
            wa, wb = _width(a[k]), _width(b[k])
            ratio = (wa / wb if wb else (1.0 if wa == wb else math.inf)) if (
                wa is not None and wb is not None) else None
            print(f"  {k}: streamed {a[k]} (width {wa}), subset {b[k]} (width {wb}); "
                  f"ratio {ratio if ratio is None else f'{ratio:.3f}'} (aim <= 1.1)")
        print(f"streamed peak RSS {streamed['peak_rss_mib']:,.0f} MiB (aim < 1536); "
              f"in-memory peak RSS {subset['peak_rss_mib']:,.0f} MiB for the subset; "
              f"uptime after: {os.popen('uptime').read().strip()}")
    finally:
        if args.keep is None:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
