"""Two fabrics on one host: UCX's default intra-node choice (shared memory: CMA moves the bulk;
small messages and RMA emulation go over TCP loopback either way) and UCX over TCP loopback only.
The probe must report a higher bandwidth and a lower floor on the first, and the readiness check
must name TCP when it is what UCX selected."""
from __future__ import annotations

import os

import pytest

from kvtune.geometry import preset
from kvtune.probe import ProbeConfig, compare_fabrics
from kvtune.probe.check import check

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(300)]

SHM, TCP = "ucx-shm", "ucx-tcp-loopback"
OVERSUBSCRIBED_LOAD_PER_CPU = 1.0
"""Above this 1-minute load average per CPU the floor comparison says nothing (see the test)."""


@pytest.fixture(scope="module")
def two_fabrics():
    # One run, rounds interleaving the fabrics in shuffled order, so the load that other work puts
    # on this shared host falls on both alike.
    cfg = ProbeConfig(geometry=preset("tiny"), tokens=(16, 64, 1024, 8192), ops=("READ",),
                      layouts=("merged",), iters=10, warmup=2, spans=False, progress=False,
                      n_boot=100)
    res = compare_fabrics(cfg, {SHM: {"UCX_TLS": ""}, TCP: {"UCX_TLS": "tcp"}})
    load_per_cpu = os.getloadavg()[0] / (os.cpu_count() or 1)
    return res[SHM], res[TCP], load_per_cpu


def _fits_or_skip(shm, tcp, load_per_cpu: float, field: str) -> None:
    """Both fabrics' fits must exist; on an oversubscribed host a failed fit (timings too noisy to
    grow with bytes) makes the comparison say nothing, so it is skipped, with the reason."""
    if getattr(shm, field) is not None and getattr(tcp, field) is not None:
        return
    if load_per_cpu > OVERSUBSCRIBED_LOAD_PER_CPU:
        errors = [f.error for f in (*shm.fits, *tcp.fits) if f.error]
        pytest.skip(f"host oversubscribed (load {load_per_cpu:.1f} per CPU): no {field} fit "
                    f"({'; '.join(e[:120] for e in errors)})")
    pytest.fail(f"no {field} fit on a quiet host: {shm.fits} {tcp.fits}")


def test_shared_memory_has_higher_bandwidth_than_tcp_loopback(two_fabrics):
    shm, tcp, load_per_cpu = two_fabrics
    assert shm.ucx_tls == "" and tcp.ucx_tls == "tcp"
    assert shm.verified_transfers == tcp.verified_transfers == 2
    _fits_or_skip(shm, tcp, load_per_cpu, "bandwidth_gbps")
    assert shm.bandwidth_gbps > tcp.bandwidth_gbps, (shm.table(), tcp.table())


def test_shared_memory_has_lower_floor_than_tcp_loopback(two_fabrics):
    shm, tcp, load_per_cpu = two_fabrics
    _fits_or_skip(shm, tcp, load_per_cpu, "floor_ms")
    if load_per_cpu > OVERSUBSCRIBED_LOAD_PER_CPU:
        # The floors differ by microseconds; on a host with more runnable threads than CPUs each
        # wake-up of the target's progress thread costs milliseconds, and UCX's rendezvous for the
        # shared-memory path takes more of them than TCP's eager path, so the order is noise.
        pytest.skip(f"host oversubscribed (load {load_per_cpu:.1f} per CPU): floors shm "
                    f"{shm.floor_ms:.4f} ms vs tcp {tcp.floor_ms:.4f} ms are not comparable")
    if shm.floor_ci_ms and tcp.floor_ci_ms and shm.floor_ci_ms[1] >= tcp.floor_ci_ms[0] \
            and tcp.floor_ci_ms[1] >= shm.floor_ci_ms[0] and not shm.floor_ms < tcp.floor_ms:
        # Overlapping bootstrap intervals: this run cannot tell the floors apart (timing noise
        # on a shared 2-core host); the bench (bench/probe.py) reports the ratio instead.
        pytest.skip(f"floors not separable in this run: shm {shm.floor_ms:.4f} ms "
                    f"{shm.floor_ci_ms} vs tcp {tcp.floor_ms:.4f} ms {tcp.floor_ci_ms}")
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
