"""A fabric with a known bandwidth: two network namespaces joined by a veth pair shaped with
``tc ... tbf rate R``; the probe runs over UCX TCP across them and must estimate R within 15%."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.nixl, pytest.mark.timeout(240)]

RATE_MBIT = 400
"""Shaped rate: fast enough for a quick test, far below what the host's loopback can do."""
BURST = "256kb"
"""tbf bucket: at least a few TCP segments' worth, or tbf rather than R limits TCP's throughput."""
TOLERANCE = 0.15
PY = sys.executable


def _need_root_and_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs `{tool}`")


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def shaped_pair():
    _need_root_and_tools()
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b = f"kvtA{tag}", f"kvtB{tag}"
    dev_a, dev_b = f"kva{tag}", f"kvb{tag}"
    net = f"10.214.{os.getpid() % 250}"
    created: list[str] = []
    try:
        for ns in (ns_a, ns_b):
            _sh("ip", "netns", "add", ns)
            created.append(ns)
        _sh("ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        for ns, dev, host in ((ns_a, dev_a, 1), (ns_b, dev_b, 2)):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{net}.{host}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", f"{RATE_MBIT}mbit", "burst", BURST, "latency", "100ms")
        yield (ns_a, dev_a, f"{net}.1"), (ns_b, dev_b, f"{net}.2")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot build the namespaces here: {exc.cmd}: {exc.stderr.decode()[:200]}")
    finally:
        for ns in created:  # deleting a namespace deletes its end of the veth pair (and the pair)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_probe_bandwidth_matches_tbf_rate_across_namespaces(shaped_pair, tmp_path):
    (ns_a, dev_a, _), (ns_b, dev_b, ip_b) = shaped_pair
    serve = subprocess.Popen(
        ["ip", "netns", "exec", ns_b, "env", "UCX_TLS=tcp", f"UCX_NET_DEVICES={dev_b}",
         PY, "-m", "kvtune.probe", "serve", "--bind", ip_b, "--port", "0", "--max-sessions", "1"],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.log", "w"), text=True)
    try:
        port = None
        deadline = time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            line = serve.stdout.readline()
            if not line:
                break
            if line.startswith("kvtune probe serve: listening on "):
                port = int(line.rsplit(":", 1)[1])
        assert port, "the target in the second namespace did not start"
        out = tmp_path / "netns.json"
        run = subprocess.run(
            ["ip", "netns", "exec", ns_a, "env", "UCX_TLS=tcp", f"UCX_NET_DEVICES={dev_a}",
             PY, "-m", "kvtune.probe", "run", "--peer", f"{ip_b}:{port}", "--model", "qwen3-32b",
             "--tokens", "16,32,48", "--layout", "merged", "--iters", "3", "--warmup", "1",
             "--no-progress", "--fabric", "veth-tbf", "--json", str(out)],
            capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, (run.stderr[-2000:], (tmp_path / "serve.log").read_text()[-2000:])
    finally:
        serve.kill()
        serve.wait(10)
    summary = json.loads(out.read_text())
    assert summary["fabric"] == "veth-tbf" and summary["ucx_tls"] == "tcp"
    assert summary["verified_transfers"] == 4
    rate_gbps = RATE_MBIT / 1000
    for fit in summary["fits"]:
        assert fit["fit"] is not None, fit["error"]
        bw = fit["fit"]["bandwidth_gbps"]
        assert abs(bw - rate_gbps) <= TOLERANCE * rate_gbps, (fit["op"], bw, rate_gbps)
