"""Test bed for the Redis conversation store: a real ``redis-server`` on loopback, and
:class:`RedisFaultProxy`, a fault-injecting TCP proxy put between the store and that server.

The proxy is a fake for faults that a healthy local Redis never produces on cue (an error reply
at one chosen position of a pipeline, a connection dropped before, after or in the middle of a
reply, a garbled reply, a stalled reply). It relays one command at a time: it reads one RESP
command from the client, forwards it, reads Redis's whole reply and passes it back, unless the
command is the one armed with a fault.
"""
from __future__ import annotations

import socket
import threading
from typing import BinaryIO

from kvtune.testing.redis_server import redis_server  # noqa: F401  (the tests import it from here)

FAULT_KINDS = ("error", "reject", "drop_before", "drop_after", "drop_mid", "garbage", "stall")
"""- ``error``: the command runs in Redis, the client gets ``-ERR`` instead of its reply;
- ``reject``: the command never reaches Redis, the client gets ``-OOM`` (as a full Redis says);
- ``drop_before``: the connection closes before the command is forwarded;
- ``drop_after``: the command runs, the connection closes before its reply;
- ``drop_mid``: the command runs, half of its reply is sent, then the connection closes;
- ``garbage``: the command runs, the client gets a line that is not RESP;
- ``stall``: the command runs, its reply is held back until the client gives up (then dropped)."""


def _read_command(f: BinaryIO) -> list[bytes] | None:
    """One RESP command (an array of bulk strings) from a client; None at end of stream."""
    line = f.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        raise ValueError(f"not a RESP command: {line[:40]!r}")
    args = []
    for _ in range(int(line[1:])):
        head = f.readline()
        n = int(head[1:])
        args.append(f.read(n + 2)[:-2])
    return args


def _read_reply(f: BinaryIO) -> bytes:
    """One whole RESP reply from Redis, as raw bytes."""
    line = f.readline()
    if not line:
        raise ConnectionError("redis closed")
    kind = line[:1]
    if kind == b"$":
        n = int(line[1:])
        return line + (f.read(n + 2) if n >= 0 else b"")
    if kind == b"*":
        n = int(line[1:])
        return line + b"".join(_read_reply(f) for _ in range(max(n, 0)))
    return line


def _encode(args: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class RedisFaultProxy:
    """A loopback proxy to ``127.0.0.1:upstream_port``. :meth:`arm` a fault at a command index
    (counted over all connections from the last :meth:`reset`); ``commands`` lists the command
    names seen, in order, and ``fired`` says whether the armed fault happened."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        self.commands: list[str] = []
        self._fault: tuple[str, int] | None = None
        self.fired = False
        self._thread = threading.Thread(target=self._accept, name="redis-fault-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def reset(self) -> None:
        with self._lock:
            self.commands, self._fault, self.fired = [], None, False

    def arm(self, kind: str, at: int) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind: expected one of {FAULT_KINDS}, got {kind!r}")
        with self._lock:
            self._fault, self.fired = (kind, at), False

    def close(self) -> None:
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for s in self._socks:
                try:
                    s.close()
                except OSError:
                    pass
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30)
        for sock in (client, upstream):  # one small write per reply: no Nagle delays
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._socks += [client, upstream]
        cf, uf = client.makefile("rb"), upstream.makefile("rb")
        try:
            while True:
                cmd = _read_command(cf)
                if cmd is None:
                    return
                with self._lock:
                    index = len(self.commands)
                    self.commands.append(cmd[0].decode().upper())
                    kind = None
                    if self._fault is not None and self._fault[1] == index:
                        kind, self.fired = self._fault[0], True
                if kind == "drop_before":
                    return
                if kind == "reject":
                    client.sendall(b"-OOM command not allowed (injected by the test proxy)\r\n")
                    continue
                upstream.sendall(_encode(cmd))
                reply = _read_reply(uf)
                if kind is None:
                    client.sendall(reply)
                elif kind == "error":
                    client.sendall(b"-ERR injected by the test proxy\r\n")
                elif kind == "drop_after":
                    return
                elif kind == "drop_mid":
                    client.sendall(reply[:max(1, len(reply) // 2)])
                    return
                elif kind == "garbage":
                    client.sendall(b"?not RESP\r\n")
                elif kind == "stall":
                    # Hold the reply until the client gives up and closes (then it goes nowhere).
                    client.settimeout(30)
                    while client.recv(65536):
                        pass
                    return
        except (OSError, ValueError, ConnectionError):
            return
        finally:
            for s in (client, upstream):
                try:
                    s.close()
                except OSError:
                    pass
