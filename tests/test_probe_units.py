"""Probe pieces without NIXL: the side channel's framing, results, UCX log parsing, the CLI."""
from __future__ import annotations

import json
import socket
import struct
import threading

import pytest

from kvtune import spans as S
from kvtune.cli import main
from kvtune.errors import ProbeError
from kvtune.geometry import preset
from kvtune.probe import cli as probe_cli
from kvtune.probe import sweep
from kvtune.probe.channel import (
    HEADER,
    MAX_JSON_BYTES,
    Channel,
    ChannelClosed,
    connect,
    parse_hostport,
)
from kvtune.probe.check import BackendStatus, ReadinessReport, parse_ucx_log
from kvtune.probe.results import PointStats, ProbeSummary
from kvtune.probe.tracing import TransferRecord, transfer_context
from _net import free_port


def _pair() -> tuple[Channel, Channel]:
    a, b = socket.socketpair()
    return Channel(a, "a"), Channel(b, "b")


def test_frames_carry_json_and_raw_bytes():
    a, b = _pair()
    blob = bytes(range(256)) * 10
    a.send({"type": "hello", "n": 3}, blob)
    frame = b.recv(5)
    assert frame.msg == {"type": "hello", "n": 3} and frame.blob == blob
    a.close()
    with pytest.raises(ChannelClosed, match="closed"):
        b.recv(5)


def test_channel_rejects_oversized_or_non_json_frames_without_unpickling():
    a, b = _pair()
    a.sock.sendall(HEADER.pack(MAX_JSON_BYTES + 1, 0))
    with pytest.raises(ProbeError, match="not a kvtune probe peer"):
        b.recv(5)
    a, b = _pair()
    import pickle
    body = pickle.dumps({"type": "x"})
    a.sock.sendall(struct.pack("!II", len(body), 0) + body)
    with pytest.raises(ProbeError, match="expected a JSON object"):
        b.recv(5)
    a, b = _pair()
    a.send({"no_type": 1})
    with pytest.raises(ProbeError, match="'type'"):
        b.recv(5)


def test_recv_times_out_and_error_replies_raise():
    a, b = _pair()
    with pytest.raises(ProbeError, match="no reply within"):
        b.recv(0.05)

    def reply():
        a.recv(5)
        a.send({"type": "error", "message": "buffer too big"})
    t = threading.Thread(target=reply)
    t.start()
    with pytest.raises(ProbeError, match="buffer too big"):
        b.request({"type": "hello"}, timeout_s=5)
    t.join()


def test_parse_hostport_and_unreachable_connect():
    assert parse_hostport("10.0.0.2:5599") == ("10.0.0.2", 5599)
    assert parse_hostport("[::1]:80") == ("::1", 80)
    for bad in ("host", "host:0", ":80", "host:http"):
        with pytest.raises(ProbeError, match="HOST:PORT"):
            parse_hostport(bad)
    port = free_port()
    with pytest.raises(ProbeError, match=f"127.0.0.1:{port}"):
        connect("127.0.0.1", port, timeout_s=5)


def _rec(i: int, ms: float, nbytes: int = 1000) -> TransferRecord:
    return TransferRecord(f"t{i}", "READ", "merged", 16, 1, nbytes, 4, i, False, 0,
                          10_000, 10_000 + int(ms * 1e6), "DONE", 1.0, 2.0, 4)


def test_point_stats_percentiles_by_hand():
    recs = [_rec(i, ms) for i, ms in enumerate([1.0, 2.0, 3.0, 4.0, 100.0])]
    p = PointStats.from_records(recs)
    assert p.iterations == 5 and p.rdma_p50_ms == 3.0
    assert p.p50_ms == pytest.approx(3.01)  # critical = 0.01 ms setup + rdma
    assert p.p90_ms == pytest.approx(0.01 + 4.0 + 0.6 * 96.0)  # numpy's linear interpolation
    assert p.setup_p50_ms == pytest.approx(0.01)
    assert p.gbps_p50 == pytest.approx(1000 * 8 / 3e6)


def test_transfer_context_is_shared_by_both_sides():
    from opentelemetry import trace
    a = trace.get_current_span(transfer_context("x:forward")).get_span_context()
    b = trace.get_current_span(transfer_context("x:forward")).get_span_context()
    c = trace.get_current_span(transfer_context("y:forward")).get_span_context()
    assert a.trace_id == b.trace_id != c.trace_id and a.is_remote


UCX_LOG = """\
[1.1] [vm:1:0]     ucp_context.c:2753 UCX  INFO  Version 1.23.0 (loaded from /x/libucp.so)
[1.2] [vm:1:0]      ucp_worker.c:1997 UCX  INFO    a self cfg#0 rma_am(tcp/lo)  am(tcp/lo cma/memory)
[1.3] [vm:1:0]      ucp_worker.c:1997 UCX  INFO    a intra-node cfg#1 rma(rc_mlx5/mlx5_0:1)  am(rc_mlx5/mlx5_0:1 cma/memory)  ka(ud_mlx5/mlx5_0:1)
"""  # noqa: E501 - UCX's log lines, verbatim


def test_parse_ucx_log_reads_peer_lanes_not_self():
    version, transports, lanes = parse_ucx_log(UCX_LOG)
    assert version == "1.23.0"
    assert transports == ("cma", "rc_mlx5", "ud_mlx5")  # tcp only appeared in the self config
    assert "rma:rc_mlx5/mlx5_0:1" in lanes


def _report(transports: tuple[str, ...], devices: tuple[str, ...] = ()) -> ReadinessReport:
    return ReadinessReport("1.5.1", "1.23.0", ("UCX",), (BackendStatus("UCX", True),), transports,
                           (), devices, "", True, "")


def test_readiness_report_classifies_transports():
    assert _report(("rc_mlx5",)).ok(require_rdma=True)
    assert not _report(("cma", "tcp")).ok(require_rdma=True)
    assert "TCP" in _report(("tcp",)).text()


def _summary() -> ProbeSummary:
    return ProbeSummary("READ", 0.02, (0.01, 0.03), 10.0, (9.0, 11.0), None, None, (), (),
                        preset("tiny").as_dict(), "f", "UCX", "local", "1.5.1", "", 10, 10, 2, 1.0)


def test_cli_run_parses_and_calls_one_library_function(monkeypatch, tmp_path, capsys):
    seen = {}

    def fake(config, *, json_path=None):
        seen["config"], seen["json"] = config, json_path
        return _summary()
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")  # the CLI would set it process-wide otherwise
    monkeypatch.setattr(sweep, "run_and_write", fake)
    cfg_json = tmp_path / "config.json"
    cfg_json.write_text(json.dumps({"num_hidden_layers": 4, "num_key_value_heads": 2,
                                    "head_dim": 64, "torch_dtype": "bfloat16"}))
    rc = main(["probe", "run", "--config", str(cfg_json), "--tp", "2", "--tokens", "16,64",
               "--ops", "write", "--layout", "merged,per_block", "--iters", "5", "--peer",
               "h:1", "--json", str(tmp_path / "o.json"), "--fabric", "efa", "--no-progress"])
    assert rc == 0
    c = seen["config"]
    assert c.geometry.layers == 4 and c.geometry.tp_size == 2 and c.tokens == (16, 64)
    assert c.ops == ("write",) and c.layouts == ("merged", "per_block") and c.iters == 5
    assert c.peer == "h:1" and c.fabric == "efa" and not c.spans and not c.progress
    assert seen["json"] == tmp_path / "o.json"
    assert "floor" not in capsys.readouterr().err


def test_cli_errors_are_reported_not_raised(capsys, monkeypatch):
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    assert main(["probe", "run", "--model", "qwen3-32b", "--tokens", "999999", "--max-mem-mb", "1",
                 "--no-progress"]) == 2
    assert "max_mem_mb" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["probe", "run", "--tokens", "a,b"])


def test_cli_check_exit_code_follows_require_rdma(monkeypatch, tmp_path, capsys):
    import kvtune.probe.check as check_mod
    monkeypatch.setattr(check_mod, "check", lambda **kw: _report(("tcp",), ("mlx5_0",)))
    out = tmp_path / "c.json"
    assert main(["probe", "check", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["tcp_used"] is True
    assert main(["probe", "check", "--require-rdma"]) == 1
    assert "no RDMA transport" in capsys.readouterr().err


def test_cli_registers_probe_subcommands():
    import argparse
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    probe_cli.register(sub)
    args = parser.parse_args(["probe", "serve", "--port", "0"])
    assert args.func is probe_cli.serve and args.bind == "127.0.0.1"
    assert S.Layout.PER_BLOCK.value in parser.parse_args(["probe", "run"]).layout
