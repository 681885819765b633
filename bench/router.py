"""The router's added latency against calling the upstreams directly, measured in one run, for
each mode (pull, bidirectional) and each conversation store (SQLite, Redis), against the aim of
issue 30: added median at most 0.5 ms and added p90 at most 0.8 ms.

Upstream: stand-in vLLM servers (``kvtune.testing.standin``; no model, answers at once), so what is
measured is the router's own cost. Traffic: multi-turn conversations (:data:`TURNS` turns each, each
prompt the previous prompt plus its answer plus a new question), so every routed request counts a
turn in the store and, in bidirectional mode, is offered the previous turn's held KV (its history
matches) and stores its own for the next turn. For each request the baseline client does the P/D
flow itself (prefill leg, then decode leg with the returned ``kv_transfer_params``) over kept-alive
connections; the routed client sends one request to the router (a separate process,
``RouterProcess``), which does the same two legs. Requests alternate between the two paths so
machine load affects both alike. Prints, per mode and store: medians, p90s, the added latency and
the router process's CPU time per request, then the verdict against the aim (MET / NOT MET).

Redis rows need a ``redis-server`` binary (``scripts/setup.sh --test`` installs it); without one the
run says ``redis: skipped (no redis-server)``.

    .venv/bin/python bench/router.py [--requests 300] [--mode pull --mode bidirectional]
                                     [--state sqlite --state redis] [--cprofile DIR]

With ``--cprofile DIR`` each router process runs under cProfile (``DIR/<mode>-<state>.prof``) and
the run prints where its time went, by part (own time of the functions in each part; the timings
of such a run are inflated by the profiler and not the result).
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from tqdm import tqdm

from kvtune import vllm_pd
from kvtune.router import RouterProcess
from kvtune.testing.standin import StandInVllmCluster
from kvtune.testing.redis_server import redis_server

WARMUP_REQUESTS = 20
TURNS = 4
"""Turns per conversation (the first has no history to reuse)."""
AIM_ADDED_MEDIAN_MS = 0.5
"""Issue 30: the router adds at most this much to the median request."""
AIM_ADDED_P90_MS = 0.8
"""Issue 30: ... and at most this much to the p90."""
MODES = ("pull", "bidirectional")
STATES = ("sqlite", "redis")


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


class Conversations:
    """Prompts of sequential multi-turn conversations: request ``i`` is turn ``i % TURNS + 1`` of
    conversation ``i // TURNS``; a next turn's prompt is the last prompt, its answer and a new
    question (so its history matches the KV the decode held)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._prompt = ""

    def body(self, i: int) -> dict:
        if i % TURNS == 0:
            self._prompt = f"{self.tag} conversation {i // TURNS} " + "word " * 64
        else:
            self._prompt += f" question {i % TURNS} please"
        return {"model": "m", "prompt": self._prompt, "max_tokens": 8,
                "conversation_id": f"{self.tag}-{i // TURNS}"}

    def answered(self, answer: dict) -> None:
        self._prompt += answer["choices"][0]["text"]


@dataclass(frozen=True)
class Result:
    """One mode and store: latencies of both paths, in ms, and the router's CPU per request."""

    mode: str
    state: str
    requests: int
    direct_median_ms: float
    direct_p90_ms: float
    routed_median_ms: float
    routed_p90_ms: float
    router_cpu_ms_per_request: float | None

    @property
    def added_median_ms(self) -> float:
        return self.routed_median_ms - self.direct_median_ms

    @property
    def added_p90_ms(self) -> float:
        return self.routed_p90_ms - self.direct_p90_ms

    @property
    def met(self) -> bool:
        return self.added_median_ms <= AIM_ADDED_MEDIAN_MS and self.added_p90_ms <= AIM_ADDED_P90_MS


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def redis_url(workdir: str) -> Iterator[str]:
    """A throw-away ``redis-server`` on loopback (``kvtune.testing.redis_server``); yields its URL."""
    with redis_server(workdir) as port:
        yield f"redis://127.0.0.1:{port}/0"


PROFILE_PARTS = (
    ("spans (OpenTelemetry SDK, phase spans)", ("opentelemetry/", "kvtune/router/tracing.py")),
    ("conversation store", ("kvtune/router/state.py", "sqlite3", "concurrent/futures/",
                            "threading.py", "asyncio/threads.py", "queue.py")),
    ("binding (history digests)", ("kvtune/router/binding.py", "hashlib", "_hashlib")),
    ("request parsing, redaction", ("kvtune/router/parsing.py", "kvtune/redact.py")),
    ("JSON encode/decode", ("/json/", "_json.")),
    ("socket send/recv syscalls", ("method 'send' of", "method 'recv' of", "method 'sendmsg'")),
    ("waiting for I/O (idle)", ("method 'poll' of", "selectors.py")),
    ("upstream legs (HTTP client)", ("kvtune/router/upstream.py", "aiohttp/client",
                                     "aiohttp/connector")),
    ("router handler (server.py)", ("kvtune/router/server.py", "kvtune/vllm_pd.py",
                                    "kvtune/router/pool.py", "uuid.py")),
    ("aiohttp server (parse, respond)", ("aiohttp/", "multidict", "yarl")),
    ("event loop", ("asyncio/",)),
)
"""Parts of a router's time, by the file (or built-in) that spends it; the first match wins."""


def profile_parts(path: str, requests: int) -> list[tuple[str, float]]:
    """Own time per request (ms) of each :data:`PROFILE_PARTS` part (and "other") in a cProfile
    file, start-up imports left out."""
    totals: dict[str, float] = {}
    for (filename, _, name), row in pstats.Stats(path).stats.items():  # type: ignore[attr-defined]
        where = f"{filename}:{name}"
        if "importlib" in where or name in ("<module>", "<built-in method builtins.exec>",
                                            "<built-in method builtins.compile>",
                                            "<built-in method marshal.loads>"):
            continue
        part = next((p for p, keys in PROFILE_PARTS if any(k in where for k in keys)), "other")
        totals[part] = totals.get(part, 0.0) + row[2]
    return sorted(((p, t * 1000.0 / requests) for p, t in totals.items()), key=lambda x: -x[1])


def measure(mode: str, state: str, state_spec: str, requests: int, workdir: str,
            *, progress: bool = True, cprofile: str | None = None) -> Result:
    """Run ``requests`` alternating direct and routed requests (after a warm-up) in ``mode``
    against a router whose conversation store is ``state_spec`` (with ``cprofile``, a path: the
    router process runs under cProfile and writes its profile there)."""
    bidirectional = mode == "bidirectional"
    python, env = sys.executable, None
    if cprofile is not None:
        # Profiled on asyncio's own loop: uvloop's C loop would hide waiting and socket calls
        # inside its callers' own time (an importable "uvloop" that fails makes the router fall
        # back to asyncio).
        python = os.path.join(workdir, "python-cprofile.sh")
        with open(python, "w") as fh:
            # The router is started as ``python -P -m kvtune.router ...``; cProfile takes no -P,
            # so the interpreter gets it instead.
            fh.write(f'#!/bin/sh\n[ "$1" = -P ] && shift\n'
                     f'exec {sys.executable} -P -m cProfile -o {cprofile} "$@"\n')
        os.chmod(python, 0o755)
        os.makedirs(os.path.join(workdir, "no-uvloop", "uvloop"), exist_ok=True)
        with open(os.path.join(workdir, "no-uvloop", "uvloop", "__init__.py"), "w") as fh:
            fh.write("raise ImportError('profiled on asyncio\\'s loop')\n")
        env = {"PYTHONPATH": os.pathsep.join(
            p for p in (os.path.join(workdir, "no-uvloop"), os.environ.get("PYTHONPATH")) if p)}
    with StandInVllmCluster(1, 1, bidirectional=bidirectional) as cluster:
        config = cluster.router_config(mode, state=state_spec)
        with RouterProcess(config, workdir=workdir, python=python, env=env) as router:
            assert router.proc is not None
            prefill, decode = KeepAlive(cluster.prefill[0].url), KeepAlive(cluster.decode[0].url)
            routed = KeepAlive(router.url)
            tag = f"{mode}-{state}-{os.getpid()}"
            direct_convs, routed_convs = Conversations(f"direct-{tag}"), Conversations(tag)

            def direct(i: int) -> None:
                body = direct_convs.body(i)
                del body["conversation_id"]  # vLLM does not know it
                rid = {"X-Request-Id": f"direct-{tag}-{i}"}
                p = prefill.post("/v1/completions", {
                    **body, "max_tokens": 1,
                    vllm_pd.KV_TRANSFER_PARAMS: vllm_pd.prefill_leg_params()}, rid)
                direct_convs.answered(decode.post("/v1/completions", {
                    **body, vllm_pd.KV_TRANSFER_PARAMS: vllm_pd.pull_decode_leg_params(
                        p[vllm_pd.KV_TRANSFER_PARAMS])}, rid))

            def via_router(i: int) -> None:
                routed_convs.answered(routed.post("/v1/completions", routed_convs.body(i)))

            times: dict[str, list[float]] = {"direct": [], "router": []}
            for i in range(WARMUP_REQUESTS):
                direct(i)
                via_router(i)
            cpu0 = _cpu_s(router.proc.pid)
            for i in tqdm(range(WARMUP_REQUESTS, WARMUP_REQUESTS + requests), disable=not progress,
                          desc=f"router bench ({mode}, {state})", file=sys.stderr):
                order = (("direct", direct), ("router", via_router))
                for name, fn in (order if i % 2 == 0 else order[::-1]):
                    t0 = time.perf_counter()
                    fn(i)
                    times[name].append((time.perf_counter() - t0) * 1000.0)
            cpu1 = _cpu_s(router.proc.pid)
        if bidirectional:  # the bench is only worth its numbers if the history was reused
            pulled = sum(1 for r in cluster.requests("prefill") if r.pulled_tokens > 0)
            if pulled < (requests + WARMUP_REQUESTS) * (TURNS - 1) // TURNS // 2:
                raise RuntimeError(f"bidirectional: only {pulled} routed turns reused the history")
    cpu_ms = None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) * 1000.0 / requests

    def p90(v: list[float]) -> float:
        return statistics.quantiles(v, n=10)[-1]
    return Result(mode, state, requests, statistics.median(times["direct"]), p90(times["direct"]),
                  statistics.median(times["router"]), p90(times["router"]), cpu_ms)


def report(r: Result) -> str:
    cpu = ("n/a" if r.router_cpu_ms_per_request is None
           else f"{r.router_cpu_ms_per_request:.2f} ms")
    return (f"mode={r.mode} state={r.state} requests={r.requests}\n"
            f"  direct P/D flow by the client: median {r.direct_median_ms:.2f} ms, "
            f"p90 {r.direct_p90_ms:.2f} ms\n"
            f"  through the router:            median {r.routed_median_ms:.2f} ms, "
            f"p90 {r.routed_p90_ms:.2f} ms\n"
            f"  added: median {r.added_median_ms:.2f} ms, p90 {r.added_p90_ms:.2f} ms; "
            f"ratio router/direct median {r.routed_median_ms / r.direct_median_ms:.2f}x; "
            f"router CPU per request {cpu}\n"
            f"  aim (added median <= {AIM_ADDED_MEDIAN_MS} ms, p90 <= {AIM_ADDED_P90_MS} ms): "
            f"{'MET' if r.met else 'NOT MET'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="measured requests per path and row")
    ap.add_argument("--mode", choices=MODES, action="append",
                    help="routing mode (repeatable; default: both)")
    ap.add_argument("--state", choices=STATES, action="append",
                    help="conversation store (repeatable; default: both, Redis if available)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--cprofile", metavar="DIR",
                    help="run each router under cProfile, write DIR/<mode>-<state>.prof, print "
                         "its time by part")
    args = ap.parse_args(argv)
    if args.requests < 10:
        ap.error("--requests: expected at least 10 (p90 needs them)")
    modes, states = args.mode or list(MODES), args.state or list(STATES)
    print(f"router bench: {args.requests} requests per row, stand-in upstreams on loopback, "
          f"non-streaming, {TURNS}-turn conversations; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for state in states:
            if state == "redis" and shutil.which("redis-server") is None:
                print("redis: skipped (no redis-server)")
                continue
            for mode in modes:
                workdir = tempfile.mkdtemp(dir=tmp)
                with contextlib.ExitStack() as stack:
                    spec = (stack.enter_context(redis_url(workdir)) if state == "redis"
                            else f"sqlite:{workdir}/state.db")
                    prof = None
                    if args.cprofile:
                        os.makedirs(args.cprofile, exist_ok=True)
                        prof = os.path.abspath(os.path.join(args.cprofile, f"{mode}-{state}.prof"))
                    r = measure(mode, state, spec, args.requests, workdir,
                                progress=not args.no_progress, cprofile=prof)
                results.append(r)
                print(report(r), flush=True)
                if prof is not None:
                    parts = profile_parts(prof, args.requests + WARMUP_REQUESTS)
                    print(f"  profile {prof} (asyncio loop, cProfile: inflated): own time per "
                          f"request in ms, total {sum(t for _, t in parts):.2f}")
                    for part, ms in parts:
                        print(f"    {ms:6.3f}  {part}")
    if results:
        print("summary: " + "; ".join(f"{r.mode}/{r.state} +{r.added_median_ms:.2f} ms "
                                      f"(p90 +{r.added_p90_ms:.2f}) {'MET' if r.met else 'NOT MET'}"
                                      for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
