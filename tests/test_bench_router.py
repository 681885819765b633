"""``bench/router.py`` runs end to end, tiny (issue 30): every mode and store prints its lines and a
verdict. Its timings are not checked here (they live in the bench's own output)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_router_bench_prints_every_mode_and_store_with_a_verdict():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "router.py"), "--requests", "10",
                           "--no-progress"], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    stores = ["sqlite", "redis"] if shutil.which("redis-server") else ["sqlite"]
    for state in stores:
        for mode in ("pull", "bidirectional"):
            assert f"mode={mode} state={state} requests=10" in out, out
    rows = re.findall(r"added: median -?\d+\.\d\d ms, p90 -?\d+\.\d\d ms", out)
    verdicts = re.findall(r"aim \(added median <= 0\.5 ms, p90 <= 0\.8 ms\): (MET|NOT MET)", out)
    assert len(rows) == len(verdicts) == 2 * len(stores), out
    if "redis" not in stores:
        assert "redis: skipped (no redis-server)" in out
    assert out.count("through the router:") == 2 * len(stores)
    assert re.search(r"^summary: pull/sqlite \+", out, re.M), out
