"""Minimal reproduction: an idle NIXL agent spins a whole CPU core (its UCX progress thread).

NIXL's Python API builds every agent with ``pthrDelay = 0``; the UCX backend's progress thread
then loops on ``poll(..., timeout=0)``. This measures, in one run, the CPU an *idle* agent uses
with NIXL's default and with a 1000 us delay (``kvtune.connectors.progress``), and the time of a
small READ between two agents in each case, so the cost of sleeping is visible too.

    .venv/bin/python bench/nixl_progress.py [--seconds 3]

No vLLM engine is involved: two agents in this process, DRAM, UCX.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import numpy as np


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def agents(delay_us: int | None, tag: str):
    from nixl._api import nixl_agent, nixl_agent_config

    from kvtune.connectors.progress import progress_delay

    with progress_delay(delay_us):
        a = nixl_agent(f"bench-{tag}-a", nixl_agent_config(backends=["UCX"]))
        b = nixl_agent(f"bench-{tag}-b", nixl_agent_config(backends=["UCX"]))
    return a, b


def read_ms(a, b, n: int = 50) -> float:
    src = np.ones(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    b.register_memory([(int(src.ctypes.data), src.nbytes, 0, "")], "DRAM")
    a.register_memory([(int(dst.ctypes.data), dst.nbytes, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    local = a.get_xfer_descs([(int(dst.ctypes.data), dst.nbytes, 0)], "DRAM")
    remote = b.get_xfer_descs([(int(src.ctypes.data), src.nbytes, 0)], "DRAM")
    times = []
    for _ in range(n):
        h = a.initialize_xfer("READ", local, remote, b.name)
        t0 = time.perf_counter()
        a.transfer(h)
        while a.check_xfer_state(h) == "PROC":
            pass
        times.append((time.perf_counter() - t0) * 1e3)
        a.release_xfer_handle(h)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    print(f"{os.cpu_count()} CPUs; idle agents measured for {args.seconds:g} s each", file=sys.stderr)
    rows = []
    for label, delay in (("NIXL default (pthrDelay 0)", None), ("kvtune delay 1000 us", 1000)):
        a, b = agents(delay, "spin" if delay is None else "sleep")
        time.sleep(0.5)
        c0, w0 = cpu_s(), time.monotonic()
        time.sleep(args.seconds)
        idle_cores = (cpu_s() - c0) / (time.monotonic() - w0)
        ms = read_ms(a, b)
        rows.append((label, idle_cores, ms))
        print(f"{label:28s} idle CPU {idle_cores:5.2f} cores (two agents)   "
              f"64 KiB READ median {ms:.3f} ms", flush=True)
        del a, b
    spin, sleep = rows[0][1], rows[1][1]
    print(f"idle CPU ratio default/delay: {spin / max(sleep, 1e-3):.0f}x; "
          f"READ time ratio delay/default: {rows[1][2] / rows[0][2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
