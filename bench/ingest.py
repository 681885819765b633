"""Ingest throughput of ``kvtune.traces.load`` against a naive loader, measured in one run.

Generates N spans (default 1,000,000) of the span convention as OTLP-JSON lines (router, prefill and
decode files, 8 phase spans per request) in a temporary directory, then loads them in two fresh
subprocesses, one after the other:
- ``kvtune``: ``kvtune.traces.load(dir)`` (typed columns, clock correction on);
- ``naive``: ``json.loads`` per line + ``pandas.json_normalize`` of the spans, attributes flattened
  with a second ``json_normalize``.
Prints each one's wall and CPU time, spans per second, peak RSS (``resource.getrusage`` in the
child) and the ratios of the two.

    .venv/bin/python bench/ingest.py [--spans 1000000] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from tqdm import tqdm

from kvtune import spans

SPANS_PER_REQUEST = 8
SPANS_PER_LINE = 512
"""Spans per ExportTraceServiceRequest line (the SDK's BatchSpanProcessor exports up to 512)."""
NS_PER_MS = 1_000_000
BYTES_PER_TOKEN = 160 * 1024  # a 32B-class model's KV per token (order of magnitude)
BLOCK_TOKENS = 16


def _kv(key: str, value: object) -> dict:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    if isinstance(value, float):
        return {"key": key, "value": {"doubleValue": value}}
    return {"key": key, "value": {"stringValue": str(value)}}


def _resource(role: spans.Role, host: str) -> dict:
    return {"attributes": [_kv(spans.SERVICE_NAME, spans.service_name(role)), _kv(spans.HOST_NAME, host),
                           _kv(spans.KVTUNE_CONVENTION, spans.CONVENTION_VERSION)]}


def _span(rng: random.Random, trace_id: str, parent: str, name: spans.SpanName, start: int,
          dur_ns: int, attrs: dict) -> dict:
    return {"traceId": trace_id, "spanId": f"{rng.getrandbits(64):016x}", "parentSpanId": parent,
            "name": name.value, "kind": 1, "startTimeUnixNano": str(start),
            "endTimeUnixNano": str(start + dur_ns), "attributes": [_kv(k, v) for k, v in attrs.items()],
            "status": {}}


def generate(out_dir: Path, n_spans: int, seed: int = 0) -> list[Path]:
    """Writes ``n_spans`` convention spans to ``<out_dir>/{router,prefill,decode}.jsonl``."""
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    roles = {spans.Role.ROUTER: "host-router", spans.Role.PREFILL: "host-p0", spans.Role.DECODE: "host-d0"}
    files = {r: open(out_dir / f"{r.value}.jsonl", "wb") for r in roles}
    pending: dict[spans.Role, list[dict]] = {r: [] for r in roles}
    enc = msgspec.json.Encoder()

    def flush(role: spans.Role) -> None:
        doc = {"resourceSpans": [{"resource": _resource(role, roles[role]),
                                  "scopeSpans": [{"scope": {"name": "kvtune"}, "spans": pending[role]}]}]}
        files[role].write(enc.encode(doc) + b"\n")
        pending[role] = []

    t0 = 1_790_000_000 * 10**9
    n_requests = max(1, n_spans // SPANS_PER_REQUEST)
    for i in tqdm(range(n_requests), desc="generating", unit="req", file=sys.stderr):
        tid = f"{rng.getrandbits(128):032x}"
        base = f"req-{i:08d}"
        tokens = rng.choice((128, 512, 2048, 8192))
        common = {spans.REQUEST_ID: f"cmpl-{base}-0", spans.BASE_REQUEST_ID: base,
                  spans.TRANSFER_ID: spans.transfer_id(base, spans.Direction.FORWARD),
                  spans.MODE: spans.Mode.PUSH.value, spans.DIRECTION: spans.Direction.FORWARD.value,
                  spans.TOKENS: tokens, spans.BLOCKS: tokens // BLOCK_TOKENS,
                  spans.BYTES: tokens * BYTES_PER_TOKEN, spans.TP_RANK: 0}
        start = t0 + i * 5 * NS_PER_MS
        root = _span(rng, tid, "", spans.SpanName.REQUEST, start, 900 * NS_PER_MS,
                     {spans.REQUEST_ID: base, spans.BASE_REQUEST_ID: base, spans.PROMPT_TOKENS: tokens,
                      spans.OUTPUT_TOKENS: 64, spans.TTFT_MS: 120.5, spans.STREAM: True,
                      spans.HTTP_STATUS: 200})
        pid = root["spanId"]
        p = {**common, spans.ROLE: spans.Role.PREFILL.value, spans.ENGINE_ID: "prefill-0"}
        d = {**common, spans.ROLE: spans.Role.DECODE.value, spans.ENGINE_ID: "decode-0"}
        pending[spans.Role.ROUTER].append(root)
        pending[spans.Role.PREFILL].extend([
            _span(rng, tid, pid, spans.SpanName.PREFILL, start + 1 * NS_PER_MS, 80 * NS_PER_MS,
                  {**p, spans.PROMPT_TOKENS: tokens, spans.CACHED_TOKENS: 0, spans.COMPUTED_TOKENS: tokens}),
            _span(rng, tid, pid, spans.SpanName.RENDEZVOUS, start + 2 * NS_PER_MS, 79 * NS_PER_MS,
                  {**p, spans.FIRST_ARRIVAL: spans.FirstArrival.REGISTRATION.value}),
            _span(rng, tid, pid, spans.SpanName.DESCRIPTOR_SETUP, start + 81 * NS_PER_MS, NS_PER_MS // 2, p),
            _span(rng, tid, pid, spans.SpanName.RDMA, start + 82 * NS_PER_MS, 3 * NS_PER_MS,
                  {**p, spans.NIXL_BACKEND: "UCX", spans.NIXL_OP: spans.NixlOp.WRITE.value,
                   spans.DESCRIPTORS: tokens // BLOCK_TOKENS * 128, spans.NIXL_POST_US: 41.5,
                   spans.NIXL_XFER_US: 2900.0, spans.FABRIC: "efa"}),
        ])
        pending[spans.Role.DECODE].extend([
            _span(rng, tid, pid, spans.SpanName.REGISTRATION, start + 1 * NS_PER_MS, NS_PER_MS, d),
            _span(rng, tid, pid, spans.SpanName.NOTIFY, start + 85 * NS_PER_MS, 10_000,
                  {**d, spans.NOTIFY_SENT_NS: start + 85 * NS_PER_MS - 50_000,
                   spans.REMOTE_ENGINE_ID: "prefill-0"}),
            _span(rng, tid, pid, spans.SpanName.DECODE_START, start + 86 * NS_PER_MS, 2 * NS_PER_MS, d),
        ])
        for role in roles:
            if len(pending[role]) >= SPANS_PER_LINE:
                flush(role)
    for role in roles:
        if pending[role]:
            flush(role)
        files[role].close()
    return [out_dir / f"{r.value}.jsonl" for r in roles]


def naive_load(paths: list[Path]):
    """The baseline: json.loads each line, json_normalize the spans, flatten attributes."""
    import pandas as pd

    records = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                for rs in json.loads(line)["resourceSpans"]:
                    res = rs.get("resource", {}).get("attributes", [])
                    for ss in rs.get("scopeSpans", []):
                        for sp in ss.get("spans", []):
                            sp["resourceAttributes"] = res
                            records.append(sp)
    df = pd.json_normalize(records)
    del records

    def flat(kvs):
        return {kv["key"]: next(iter(kv["value"].values())) for kv in kvs} if isinstance(kvs, list) else {}

    res = pd.json_normalize(df.pop("resourceAttributes").map(flat).tolist())
    attrs = pd.json_normalize(df.pop("attributes").map(flat).tolist())
    df = pd.concat([df, res, attrs], axis=1)
    df["startTimeUnixNano"] = df["startTimeUnixNano"].astype("int64")
    df["endTimeUnixNano"] = df["endTimeUnixNano"].astype("int64")
    df["duration_ms"] = (df["endTimeUnixNano"] - df["startTimeUnixNano"]) / 1e6
    return df


def _child(kind: str, directory: str) -> None:
    """Runs one loader in this (fresh) process and prints a JSON result line."""
    paths = sorted(Path(directory).glob("*.jsonl"))
    t, cpu = time.perf_counter(), time.process_time()
    if kind == "kvtune":
        from kvtune.traces import load
        df = load(directory, progress=False)
    else:
        df = naive_load(paths)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"kind": kind, "spans": len(df), "wall_s": wall, "cpu_s": cpu,
                      "peak_rss_mib": peak_kib / 1024}))


def _measure(kind: str, directory: Path) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", kind, str(directory)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} loader failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path,
                    help="write the spans here and keep them (reused when the count matches)")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    directory = args.keep or Path(tempfile.mkdtemp(prefix="kvtune-ingest-"))
    try:
        marker = directory / "generated.txt"
        if args.keep is not None and marker.exists() and marker.read_text().strip() == str(args.spans):
            files = sorted(directory.glob("*.jsonl"))
            print(f"reusing {args.spans} spans in {directory}")
        else:
            t = time.perf_counter()
            files = generate(directory, args.spans)
            marker.write_text(f"{args.spans}\n")
            print(f"generated {args.spans} spans in {time.perf_counter() - t:.1f} s")
        size_mib = sum(f.stat().st_size for f in files) / 2**20
        print(f"{size_mib:.0f} MiB of OTLP-JSON lines in {len(files)} files")
        results = {kind: _measure(kind, directory) for kind in ("kvtune", "naive")}
        for r in results.values():
            print(f"{r['kind']:>7}: {r['spans']} spans in {r['wall_s']:.2f} s wall "
                  f"({r['spans'] / r['wall_s']:,.0f} spans/s), {r['cpu_s']:.2f} s CPU "
                  f"({r['spans'] / r['cpu_s']:,.0f} spans/CPU-s), peak RSS {r['peak_rss_mib']:,.0f} MiB")
        wall_ratio = results["naive"]["wall_s"] / results["kvtune"]["wall_s"]
        cpu_ratio = results["naive"]["cpu_s"] / results["kvtune"]["cpu_s"]
        print(f"kvtune.traces.load vs json.loads + json_normalize: {wall_ratio:.2f}x faster in wall "
              f"time, {cpu_ratio:.2f}x in CPU time (aim >= 3x; CPU time is the steadier measure on "
              f"a shared machine); peak RSS {results['kvtune']['peak_rss_mib']:,.0f} MiB (aim < 2048)")
    finally:
        if args.keep is None:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
