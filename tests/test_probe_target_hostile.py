"""A real probe target (NIXL agents, in a child process) against hostile peers: every bad
frame is answered with an error to that peer, trickling peers miss their frame's deadline, no
session outlives its deadline, and the target keeps serving real transfers throughout."""
from __future__ import annotations

import json
import select
import subprocess
import sys
import threading

import pytest

from kvtune.errors import ProbeError
from kvtune.geometry import KvGeometry
from kvtune.probe.channel import HEADER, ChannelClosed, connect
from kvtune.probe.initiator import InitiatorSession

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(300)]

SMALL = KvGeometry(layers=2, kv_heads=1, head_dim=64, dtype_bytes=2, block_size_tokens=16,
                   name="probe-hostile-test")
DEEP = b'{"type":"hello","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"


_SERVE = """
import json, sys
from kvtune.probe.target import ProbeTarget
target = ProbeTarget("127.0.0.1", 0, max_mem_mb=1, **json.loads(sys.argv[1]))
print("listening", target.address[1], flush=True)
target.serve_forever()
"""


class _Target:
    """A probe target in a child process (as `kvtune probe serve` runs), with test timeouts."""

    def __init__(self, **timeouts: float) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", _SERVE, json.dumps(timeouts)],
                                        stdout=subprocess.PIPE, text=True)
        line = ""
        while not line.startswith("listening"):  # NIXL may log first
            line = self.process.stdout.readline()
            assert line, "the target exited before listening"
        self.address = ("127.0.0.1", int(line.split()[1]))
        threading.Thread(target=self.process.stdout.read, daemon=True).start()  # never a full pipe

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)


@pytest.fixture
def make_target():
    started: list[_Target] = []

    def make(**timeouts: float) -> _Target:
        started.append(_Target(**timeouts))
        return started[-1]

    yield make
    for target in started:
        assert target.alive(), "the target process died"
        target.stop()


def _raw(target: _Target):
    return connect(*target.address)


def _error_then_closed(ch, pattern: str) -> None:
    reply = ch.recv(60)
    assert reply.msg["type"] == "error", reply.msg
    assert pattern in reply.msg["message"], reply.msg
    with pytest.raises(ChannelClosed):
        ch.recv(60)
    ch.close()


def _session_works(target: _Target) -> None:
    """A real initiator still gets a session, and a WRITE's bytes arrive checked."""
    with InitiatorSession(target.address, SMALL, capacity_blocks=8, xfer_timeout_s=60.0) as s:
        point = s.prepare(64, "per_block")
        s.verify("WRITE", point, seed=7, run_id="hostile")
        s.release(point)


def test_hostile_hellos_and_commands_get_errors_and_the_target_keeps_serving(make_target):
    target = make_target()
    hellos = [
        (DEEP, "nested too deeply"),
        (json.dumps({"type": "hello", "version": 1, "nbytes": 2**64 + 8}).encode(), "bytes asked"),
        (json.dumps({"type": "hello", "version": 1, "nbytes": "x"}).encode(), "bytes asked"),
        (json.dumps({"type": "hello", "version": True, "nbytes": 8}).encode(), "'version'"),
        (b"\x80not json", "expected a JSON object"),
    ]
    for raw, pattern in hellos:
        ch = _raw(target)
        ch.sock.sendall(HEADER.pack(len(raw), 0) + raw)
        _error_then_closed(ch, pattern)
    ch = _raw(target)
    ch.sock.sendall(HEADER.pack(0xFFFFFFFF, 0xFFFFFFFF))
    _error_then_closed(ch, "not a kvtune probe peer")

    with InitiatorSession(target.address, SMALL, capacity_blocks=8, xfer_timeout_s=60.0) as s:
        bad = [
            ({"type": "fill", "seed": "x", "ranges": [[0, 8]]}, "'seed'"),
            ({"type": "fill", "ranges": [[1]]}, "ranges[0]"),
            ({"type": "fill", "ranges": [[2**62, 2**62]]}, "ranges[0]"),  # int64 wrap-around
            ({"type": "digest", "ranges": [[0, 2**64]]}, "ranges[0]"),
            ({"type": "stats", "expect": 1, "timeout_s": float("inf")}, "Infinity"),
            ({"type": "stats", "expect": 2**70}, "'expect'"),
        ]
        for msg, pattern in bad:
            with pytest.raises(ProbeError, match=pattern.replace("[", r"\[")):
                s.ch.request(msg, timeout_s=60)
        s.ch.sock.sendall(HEADER.pack(len(DEEP), 0) + DEEP)  # in a session: answered, session goes on
        assert s.ch.recv(60).msg["type"] == "error"
        assert s.target_alive()
        point = s.prepare(64, "per_block")
        s.verify("READ", point, seed=3, run_id="after-hostile")  # bytes still checked end to end
        s.release(point)
    _session_works(target)


def _trickle(sock, data: bytes, pause_s: float) -> tuple[int, bytes]:
    """Sends ``data`` a byte at a time until the target answers; (bytes sent, what it answered)."""
    for sent, byte in enumerate(data):
        readable, _, _ = select.select([sock], [], [], pause_s)
        if readable:
            return sent, sock.recv(65536)
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return sent, b""
    return len(data), b""


def test_a_peer_trickling_bytes_is_cut_off_at_the_frames_deadline(make_target):
    """One byte every 0.1 s: each recv() sees data well within 1 s, the frame never completes
    within it; the old per-recv timeout kept the one-at-a-time target busy for as long as the
    peer liked (the 2000-byte frame here would have taken 200 s)."""
    target = make_target(hello_timeout_s=1.0, command_timeout_s=1.0)
    hello = json.dumps({"type": "hello", "version": 1, "nbytes": 8, "pad": "x" * 2000}).encode()
    ch = _raw(target)
    sent, answer = _trickle(ch.sock, HEADER.pack(len(hello), 0) + hello, 0.1)
    assert sent < len(hello) and b"no reply within 1 s" in answer
    ch.close()
    with InitiatorSession(target.address, SMALL, capacity_blocks=8, xfer_timeout_s=60.0) as s:
        ping = json.dumps({"type": "ping", "pad": "x" * 2000}).encode()
        sent, answer = _trickle(s.ch.sock, HEADER.pack(len(ping), 0) + ping, 0.1)
        assert sent < len(ping) and b"no reply within 1 s" in answer
    _session_works(target)


def test_no_session_outlives_its_deadline(make_target):
    """Pings every 0.1 s keep the session from going idle; the session deadline still ends it,
    with an error that says so, and the next initiator is served."""
    target = make_target(session_max_s=10.0)
    with InitiatorSession(target.address, SMALL, capacity_blocks=8, xfer_timeout_s=60.0) as s:
        ended = ""
        for _ in range(3000):  # 300 s at most; the deadline is 10 s
            readable, _, _ = select.select([s.ch.sock], [], [], 0.1)
            if readable:  # the target spoke first: its reason for ending the session
                reply = s.ch.recv(60).msg
                assert reply["type"] == "error"
                ended = reply["message"]
                break
            try:
                assert s.ch.request({"type": "ping"}, timeout_s=60).msg["type"] == "pong"
            except ProbeError as exc:  # it ended the session while this ping was on its way
                ended = str(exc)
                break
        assert "session ended after 10 s" in ended
    # the next initiator is served (its handshake completes; transfers need a longer deadline)
    with InitiatorSession(target.address, SMALL, capacity_blocks=8, xfer_timeout_s=60.0) as s:
        assert s.remote_name
