"""Two fabrics on one host: UCX's default intra-node choice (shared memory: CMA moves the bulk)
and UCX over TCP loopback. The probe must report a lower floor and a higher bandwidth on the first,
and the readiness check must name TCP when it is what UCX selected."""
from __future__ import annotations

import pytest

from kvtune.geometry import preset
from kvtune.probe import ProbeConfig, compare_fabrics
from kvtune.probe.check import check

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(300)]

SHM, TCP = "ucx-shm", "ucx-tcp-loopback"


def test_shared_memory_beats_tcp_loopback_on_floor_and_bandwidth():
    # Interleaved in one run (rounds alternate fabrics in shuffled order), so the load that other
    # work puts on this shared host falls on both fabrics alike.
    cfg = ProbeConfig(geometry=preset("tiny"), tokens=(16, 1024, 8192), ops=("READ",),
                      layouts=("merged",), iters=10, warmup=2, spans=False, progress=False,
                      n_boot=100)
    res = compare_fabrics(cfg, {SHM: {"UCX_TLS": ""}, TCP: {"UCX_TLS": "tcp"}})
    shm, tcp = res[SHM], res[TCP]
    assert shm.ucx_tls == "" and tcp.ucx_tls == "tcp"
    assert shm.verified_transfers == tcp.verified_transfers == 2
    assert shm.floor_ms is not None and tcp.floor_ms is not None, (shm.fits, tcp.fits)
    assert shm.bandwidth_gbps > tcp.bandwidth_gbps, (shm.table(), tcp.table())
    assert shm.floor_ms < tcp.floor_ms, (shm.table(), tcp.table())


def test_readiness_check_names_tcp_and_warns_when_rdma_devices_are_bypassed(tmp_path):
    ib = tmp_path / "infiniband"  # a stand-in for /sys/class/infiniband with one device
    (ib / "mlx5_0").mkdir(parents=True)
    report = check(env={"UCX_TLS": "tcp"}, infiniband_dir=ib)
    assert report.transfer_ok, report.transfer_error
    assert report.transports == ("tcp",) and report.tcp_used and not report.rdma_used
    assert "UCX" in [b.name for b in report.backends if b.loaded]
    assert report.nixl_version and report.ucx_version
    assert report.rdma_devices == ("mlx5_0",)
    assert any("mlx5_0" in w and "TCP" in w for w in report.warnings)
    assert "TCP" in report.text() and "WARNING" in report.text()
    assert report.ok() and not report.ok(require_rdma=True)
