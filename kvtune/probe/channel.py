"""The probe's side channel: length-prefixed frames of JSON plus raw bytes over TCP. No pickle.

A frame is ``!II`` (JSON length, blob length), then the UTF-8 JSON object, then the blob (NIXL agent
metadata, which is opaque bytes). Both lengths are bounded so a stray client cannot make the target
allocate without limit.
"""
from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass

from kvtune.errors import ProbeError

HEADER = struct.Struct("!II")
MAX_JSON_BYTES = 1 << 20
"""Largest JSON part of a frame (commands are a few hundred bytes)."""
MAX_BLOB_BYTES = 64 << 20
"""Largest blob part of a frame (NIXL metadata is a few KiB; digests ship no bulk data)."""
PROTOCOL_VERSION = 1
CONNECT_TIMEOUT_S = 10.0
"""How long the initiator waits for the target's TCP accept."""


@dataclass(frozen=True)
class Frame:
    """One message: a JSON object (``type`` names it) and an optional blob."""

    msg: dict
    blob: bytes = b""


class ChannelClosed(ProbeError):
    """The peer closed the side channel."""


class Channel:
    """A connected side channel; ``peer`` names the other end in error messages."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, msg: dict, blob: bytes = b"") -> None:
        data = json.dumps(msg, separators=(",", ":")).encode()
        if len(data) > MAX_JSON_BYTES or len(blob) > MAX_BLOB_BYTES:
            raise ProbeError(f"side channel to {self.peer}: frame too large "
                             f"({len(data)} B JSON, {len(blob)} B blob)")
        try:
            self.sock.sendall(HEADER.pack(len(data), len(blob)) + data + blob)
        except OSError as exc:
            raise ChannelClosed(f"side channel to {self.peer}: send failed: {exc}") from exc

    def recv(self, timeout_s: float | None) -> Frame:
        """Next frame; ``ProbeError`` after ``timeout_s`` seconds, ``ChannelClosed`` on EOF."""
        self.sock.settimeout(timeout_s)
        json_len, blob_len = HEADER.unpack(self._read(HEADER.size, timeout_s))
        if json_len > MAX_JSON_BYTES or blob_len > MAX_BLOB_BYTES:
            raise ProbeError(f"side channel from {self.peer}: frame header announces {json_len} B "
                             f"JSON and {blob_len} B blob; expected at most {MAX_JSON_BYTES} and "
                             f"{MAX_BLOB_BYTES} (not a kvtune probe peer?)")
        raw = self._read(json_len, timeout_s)
        blob = self._read(blob_len, timeout_s) if blob_len else b""
        try:
            msg = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProbeError(f"side channel from {self.peer}: expected a JSON object: {exc}") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise ProbeError(f"side channel from {self.peer}: expected a JSON object with a "
                             f"string 'type', got {str(msg)[:200]!r}")
        return Frame(msg, blob)

    def request(self, msg: dict, blob: bytes = b"", *, timeout_s: float) -> Frame:
        """Send ``msg`` and wait for the reply; a reply of type ``error`` raises ``ProbeError``."""
        self.send(msg, blob)
        try:
            reply = self.recv(timeout_s)
        except ChannelClosed as exc:
            raise ChannelClosed(f"{exc} (waiting for the reply to {msg['type']!r})") from None
        except ProbeError as exc:
            raise ProbeError(f"{exc} (waiting for the reply to {msg['type']!r})") from None
        if reply.msg["type"] == "error":
            raise ProbeError(f"probe target {self.peer}: {reply.msg.get('message', 'error')} "
                             f"(while handling {msg['type']!r})")
        return reply

    def _read(self, n: int, timeout_s: float | None) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except socket.timeout:
                raise ProbeError(f"side channel from {self.peer}: no reply within {timeout_s:g} s") from None
            except OSError as exc:
                raise ChannelClosed(f"side channel from {self.peer}: receive failed: {exc}") from exc
            if not chunk:
                raise ChannelClosed(f"side channel from {self.peer}: peer closed the connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def parse_hostport(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) into its parts, with an error naming what was expected."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ProbeError(f"--peer: expected HOST:PORT with a port in 1..65535, got {value!r}")
    return host, int(port)


def connect(host: str, port: int, *, timeout_s: float = CONNECT_TIMEOUT_S) -> Channel:
    """Open the side channel to a probe target, or raise ``ProbeError`` naming ``host:port``."""
    peer = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except socket.timeout:
        raise ProbeError(f"cannot reach probe target at {peer}: no answer within {timeout_s:g} s "
                         f"(is `kvtune probe serve` running there and the port open?)") from None
    except OSError as exc:
        raise ProbeError(f"cannot reach probe target at {peer}: {exc.strerror or exc} "
                         f"(is `kvtune probe serve` running there?)") from None
    return Channel(sock, peer)
