"""The router's added latency, as a ratio to calling the upstream directly, measured in one run.

Upstream: stand-in vLLM servers (``kvtune.testing.standin``; no model, answers at once), so what is
measured is the router's own cost. For each request the baseline client does the P/D flow itself
(prefill leg, then decode leg with the returned ``kv_transfer_params``) over kept-alive
connections; the routed client sends one request to the router (a separate process,
``RouterProcess``), which does the same two legs. Requests alternate between the two paths so
machine load affects both alike. Prints medians, p90s and the ratios.

    .venv/bin/python bench/router.py [--requests 300] [--mode pull|bidirectional]
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from urllib.parse import urlsplit

from tqdm import tqdm

from kvtune import vllm_pd
from kvtune.router import RouterProcess
from kvtune.testing.standin import StandInVllmCluster

WARMUP_REQUESTS = 20


class KeepAlive:
    """One kept-alive HTTP/1.1 connection."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)

    def post(self, path: str, body: dict, headers: dict | None = None) -> dict:
        self.conn.request("POST", path, json.dumps(body).encode(),
                          {"Content-Type": "application/json", **(headers or {})})
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
        return json.loads(data)


def _body(i: int, conv: str | None) -> dict:
    body = {"model": "m", "prompt": f"request {i} " + "word " * 64, "max_tokens": 8}
    if conv is not None:
        body["conversation_id"] = conv
    return body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--mode", choices=["pull", "bidirectional"], default="pull")
    args = ap.parse_args(argv)
    conv = "bench-conv" if args.mode == "bidirectional" else None
    with tempfile.TemporaryDirectory() as tmp, \
            StandInVllmCluster(1, 1, bidirectional=args.mode == "bidirectional") as cluster:
        config = cluster.router_config(args.mode, state=f"sqlite:{tmp}/state.db")
        with RouterProcess(config, workdir=tmp) as router:
            prefill, decode = KeepAlive(cluster.prefill[0].url), KeepAlive(cluster.decode[0].url)
            routed = KeepAlive(router.url)

            def direct(i: int) -> None:
                rid = {"X-Request-Id": f"direct-{i}"}
                p = prefill.post("/v1/completions", {
                    **_body(i, None), "max_tokens": 1,
                    vllm_pd.KV_TRANSFER_PARAMS: vllm_pd.prefill_leg_params()}, rid)
                decode.post("/v1/completions", {
                    **_body(i, None),
                    vllm_pd.KV_TRANSFER_PARAMS: vllm_pd.pull_decode_leg_params(
                        p[vllm_pd.KV_TRANSFER_PARAMS])}, rid)

            def via_router(i: int) -> None:
                routed.post("/v1/completions", _body(i, conv))

            times: dict[str, list[float]] = {"direct": [], "router": []}
            for i in range(WARMUP_REQUESTS):
                direct(i)
                via_router(i)
            for i in tqdm(range(args.requests), desc=f"router bench ({args.mode})", file=sys.stderr):
                order = (("direct", direct), ("router", via_router))
                for name, fn in (order if i % 2 == 0 else order[::-1]):
                    t0 = time.perf_counter()
                    fn(i)
                    times[name].append((time.perf_counter() - t0) * 1000.0)
    med = {k: statistics.median(v) for k, v in times.items()}
    p90 = {k: statistics.quantiles(v, n=10)[-1] for k, v in times.items()}
    print(f"mode={args.mode} requests={args.requests} (non-streaming, stand-in upstreams, loopback)")
    print(f"  direct P/D flow by the client: median {med['direct']:.2f} ms, p90 {p90['direct']:.2f} ms")
    print(f"  through the router:            median {med['router']:.2f} ms, p90 {p90['router']:.2f} ms")
    print(f"  ratio router/direct: median {med['router'] / med['direct']:.2f}x, "
          f"p90 {p90['router'] / p90['direct']:.2f}x; added median "
          f"{med['router'] - med['direct']:.2f} ms per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
