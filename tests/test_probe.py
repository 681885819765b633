"""The fabric probe with real NIXL transfers between two OS processes (initiator here, target in a
child process), on this host's UCX (shared memory / TCP loopback)."""
from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvtune import spans as S
from kvtune import telemetry
from kvtune.errors import ConfigError, ProbeError
from kvtune.geometry import KvGeometry
from kvtune.probe import ProbeConfig, run_probe
from kvtune.probe.initiator import InitiatorSession
from kvtune.probe.target import spawn_local_target
from kvtune.traces import load
from _net import free_port

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(180)]

# 2 layers x K/V = 4 regions; one block of one region is 16 tokens x 1 head x 64 x 2 B = 2 KiB.
SMALL = KvGeometry(layers=2, kv_heads=1, head_dim=64, dtype_bytes=2, block_size_tokens=16,
                   name="probe-test")
WIDE = KvGeometry(layers=2, kv_heads=2, head_dim=128, dtype_bytes=2, block_size_tokens=16,
                  name="probe-test-wide")  # 2 KiB per token


@pytest.fixture
def session():
    target = spawn_local_target(max_mem_mb=16)
    alive = target.alive
    try:
        with InitiatorSession((target.host, target.port), SMALL, capacity_blocks=8,
                              xfer_timeout_s=20.0, target_alive=alive) as s:
            yield s, target
    finally:
        target.stop()


@pytest.mark.parametrize("layout", ["per_block", "merged"])
def test_read_and_write_move_the_targets_bytes(session, layout):
    s, _ = session
    point = s.prepare(100, layout)  # 7 blocks (a partial last block moves whole)
    assert point.blocks == 7 and point.bytes == 7 * SMALL.bytes_per_block
    assert point.descriptors == (4 * 7 if layout == "per_block" else 4)

    # WRITE: our pattern lands in the target's registered buffer.
    s.fill_local(point, seed=11)
    s.fill_remote(point, seed=12)
    assert s.remote_digest(point) != s.local_digest(point)  # the check below can fail
    rec = s.transfer("WRITE", point, iteration=0, warmup=False, run_id="t")
    assert rec.status == "DONE"
    assert s.remote_digest(point) == s.local_digest(point)
    # NIXL did not merge the per-block descriptors (that is what per_block measures).
    assert rec.nixl_descriptors == point.descriptors
    assert rec.nixl_xfer_us is not None and rec.nixl_xfer_us >= 0

    # READ: the target's new pattern comes here.
    s.fill_remote(point, seed=13)
    assert s.remote_digest(point) != s.local_digest(point)
    assert s.transfer("READ", point, iteration=1, warmup=False, run_id="t").status == "DONE"
    assert s.remote_digest(point) == s.local_digest(point)

    # verify() does the same round trip for either op; and every transfer notified the target.
    s.verify("READ", point, seed=14, run_id="t")
    s.verify("WRITE", point, seed=15, run_id="t")
    assert s.notifications_seen(expect=4) == 4
    s.release(point)


def test_target_death_mid_sweep_fails_fast_naming_side_and_transfer(session):
    s, target = session
    point = s.prepare(32, "per_block")
    assert s.transfer("READ", point, iteration=0, warmup=False, run_id="t").status == "DONE"
    target.process.kill()
    target.process.wait(10)
    t0 = time.monotonic()
    with pytest.raises(ProbeError) as err:
        for i in range(1, 50):  # UCX may complete a few from buffers before it sees the reset
            s.transfer("READ", point, iteration=i, warmup=False, run_id="dead")
    msg = str(err.value)
    assert "side: target" in msg and "probe-dead-read-per_block-32-" in msg
    assert target.peer in msg
    assert time.monotonic() - t0 < 60


def test_unreachable_peer_names_host_and_port():
    port = free_port()
    with pytest.raises(ProbeError, match=f"127.0.0.1:{port}"):
        run_probe(ProbeConfig(geometry=SMALL, tokens=(16,), peer=f"127.0.0.1:{port}",
                              progress=False, spans=False))


def test_bad_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="ops"):
        run_probe(ProbeConfig(geometry=SMALL, ops=("COPY",)))
    with pytest.raises(ConfigError, match="max_mem_mb"):
        run_probe(ProbeConfig(geometry=SMALL, tokens=(1 << 20,), max_mem_mb=1))
    with pytest.raises(ConfigError, match="layout"):
        run_probe(ProbeConfig(geometry=SMALL, layouts=("diagonal",)))
    with pytest.raises(ProbeError, match="HOST:PORT"):
        run_probe(ProbeConfig(geometry=SMALL, peer="nohost"))


def test_run_probe_sweeps_fits_and_emits_spans_on_both_sides(tmp_path):
    mem = InMemorySpanExporter()
    tel = telemetry.setup("probe", exporters=[mem], batch=False)
    tokens = (16, 256, 4096)  # 32 KiB .. 8 MiB: a wide range keeps the slope clear of noise
    cfg = ProbeConfig(geometry=WIDE, tokens=tokens, ops=("READ", "WRITE"),
                      layouts=("per_block", "merged"), iters=6, warmup=1, spans_dir=tmp_path,
                      progress=False, fabric="test-loopback", n_boot=50)
    summary = run_probe(cfg, tracer=tel.tracer)
    tel.shutdown()

    # points and percentiles
    assert len(summary.points) == 2 * 2 * len(tokens)
    for p in summary.points:
        assert p.iterations == 6
        assert 0 < p.p50_ms <= p.p90_ms <= p.p99_ms
        assert p.bytes == WIDE.transfer_bytes(p.tokens)
    # both ops fitted (descriptors vary independently of bytes across the two layouts)
    assert [f.op for f in summary.fits] == ["READ", "WRITE"]
    assert summary.floor_ms is not None and summary.bandwidth_gbps > 0
    lo, hi = summary.bandwidth_ci_gbps
    assert lo <= summary.bandwidth_gbps <= hi
    assert summary.verified_transfers == 2 * 2 * 2  # smallest and largest point per op and layout
    assert summary.notifications_received == summary.n_transfers
    assert "READ" in summary.table() and "floor" in summary.table()
    assert summary.as_dict()["fits"][0]["fit"]["floor_ms"] == summary.floor_ms

    # initiator spans: one kv.descriptor_setup and one kv.rdma per transfer, convention attributes
    finished = mem.get_finished_spans()
    rdma = [s for s in finished if s.name == S.SpanName.RDMA.value]
    setup = [s for s in finished if s.name == S.SpanName.DESCRIPTOR_SETUP.value]
    assert len(rdma) == len(setup) == summary.n_transfers
    assert sum(1 for s in finished if s.name == S.SpanName.HANDSHAKE.value) == 1
    measured = [s for s in rdma if not s.attributes[S.PROBE_WARMUP]]
    assert len(measured) == 2 * 2 * len(tokens) * 6
    for s in rdma:
        a = s.attributes
        assert a[S.MODE] == S.Mode.PROBE.value and a[S.FABRIC] == "test-loopback"
        assert a[S.NIXL_OP] in ("READ", "WRITE") and a[S.PROBE_LAYOUT] in ("per_block", "merged")
        assert a[S.BYTES] == WIDE.transfer_bytes(a[S.TOKENS])
        assert a[S.NIXL_STATUS] == "DONE" and a[S.NIXL_XFER_US] >= 0
        assert s.end_time >= s.start_time
    assert {s.resource.attributes[S.SERVICE_NAME] for s in rdma} == {S.service_name(S.Role.PROBE)}

    # target spans (child process, JSON lines): one kv.notify per transfer, same transfer ids and
    # the same trace as the initiator's spans of that transfer
    target = load(tmp_path / "probe-target.jsonl")
    notify = target[target["name"] == S.SpanName.NOTIFY.value]
    assert len(notify) == summary.n_transfers
    trace_of = {s.attributes[S.TRANSFER_ID]: format(s.context.trace_id, "032x") for s in rdma}
    assert set(notify[S.TRANSFER_ID]) == set(trace_of)
    for tid, trace_id in zip(notify[S.TRANSFER_ID], notify["trace_id"], strict=True):
        assert trace_of[tid] == trace_id
    assert (notify[S.NOTIFY_SENT_NS] > 0).all()
    assert (notify[S.MODE] == S.Mode.PROBE.value).all()


def test_serve_outlives_an_initiator_that_vanishes_and_serves_the_next(tmp_path):
    import subprocess
    import sys
    serve = subprocess.Popen([sys.executable, "-m", "kvtune.probe", "serve", "--port", "0",
                              "--max-sessions", "2", "--spans", str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        while not line.startswith("kvtune probe serve: listening on "):  # NIXL logs come first
            line = serve.stdout.readline()
            assert line, "serve exited before listening"
        peer = line.rsplit(" ", 1)[1].strip()
        assert peer.startswith("127.0.0.1:")
        host, port = peer.rsplit(":", 1)
        gone = InitiatorSession((host, int(port)), SMALL, capacity_blocks=2)
        gone.ch.sock.close()  # no bye: the target must notice and move on
        summary = run_probe(ProbeConfig(geometry=SMALL, tokens=(16, 32, 64), ops=("WRITE",),
                                        iters=3, warmup=1, peer=peer, progress=False, spans=False,
                                        n_boot=20))
        assert summary.peer == peer and summary.fabric.endswith("-remote")
        assert summary.verified_transfers == 2 and summary.notifications_received == summary.n_transfers
        assert serve.wait(60) == 0  # both sessions served, then it exits
    finally:
        serve.kill()
        serve.wait(10)
    assert list(tmp_path.glob("*.jsonl")), "the target wrote its spans"
