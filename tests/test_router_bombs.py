"""The router's upstream reads under a decompression bomb (issue 29): an upstream answering with
a 1 MB gzip body that inflates to 1 GiB gets a 502 naming the limit, and the router's peak memory
stays under :data:`PEAK_LIMIT_MIB`, measured in a fresh subprocess (its ``VmHWM``). The bomb
server is a fake (no vLLM answers like this on cue), defined in the child below."""
from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PEAK_LIMIT_MIB = 300
pytestmark = pytest.mark.timeout(300)

CHILD = r"""
import asyncio, json, sys
import aiohttp
from aiohttp import web
from kvtune.router.config import RouterConfig, InstanceConfig
from kvtune.router.server import Router

BOMB = open(sys.argv[1], "rb").read()

async def bomb(request):  # fake upstream: a 1 MB gzip body that inflates to 1 GiB of zeros
    await request.read()
    return web.Response(body=BOMB, headers={"Content-Encoding": "gzip",
                                            "Content-Type": "application/json"})

async def main():
    app = web.Application()
    app.router.add_post("/v1/completions", bomb)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    router = Router(RouterConfig(prefill=(InstanceConfig(url),), decode=(InstanceConfig(url),),
                                 state=":memory:", port=0))
    base = await router.start()
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/completions", json={"model": "m", "prompt": "a"}) as r:
            out = {"status": r.status, "body": (await r.text())[:2000]}
    await router.stop()
    await runner.cleanup()
    return out

out = asyncio.run(main())
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
out["peak_mib"] = int(hwm.split()[1]) / 1024
print(json.dumps(out))
"""


def test_gzip_bomb_from_an_upstream_is_cut_off_under_300_mb(tmp_path):
    """Before: the router read the whole inflated answer (2.2 GB peak)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    path = tmp_path / "bomb.gz"
    with open(path, "wb") as f:
        for _ in range(1024):
            f.write(comp.compress(block))
        f.write(comp.flush())
    assert path.stat().st_size < 2 * 1024 * 1024
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True,
                          text=True, timeout=240, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(out)
    assert out["status"] == 502 and "larger than" in out["body"], out
    assert out["peak_mib"] < PEAK_LIMIT_MIB, out
