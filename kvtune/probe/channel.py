"""The probe's side channel: length-prefixed frames of JSON plus raw bytes over TCP. No pickle.

A frame is ``!II`` (JSON length, blob length), then the UTF-8 JSON object, then the blob (NIXL agent
metadata, which is opaque bytes). Both lengths are bounded so a stray client cannot make the target
allocate without limit.
"""
from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass

from kvtune.errors import ProbeError

HEADER = struct.Struct("!II")
MAX_JSON_BYTES = 1 << 20
"""Largest JSON part of a frame (commands are a few hundred bytes)."""
MAX_BLOB_BYTES = 64 << 20
"""Largest blob part of a frame (NIXL metadata is a few KiB; digests ship no bulk data)."""
PROTOCOL_VERSION = 1
_RECV_CHUNK_BYTES = 1 << 20
SEND_TIMEOUT_S = 60.0
"""How long one frame's send may block on a peer that does not read."""
CONNECT_TIMEOUT_S = 10.0
"""How long the initiator waits for the target's TCP accept."""


@dataclass(frozen=True)
class Frame:
    """One message: a JSON object (``type`` names it) and an optional blob."""

    msg: dict
    blob: bytes = b""


class ChannelClosed(ProbeError):
    """The peer closed the side channel."""


class BadMessage(ProbeError):
    """A whole frame arrived but its JSON is not a message (the stream is still in step, so a
    target replies with the error and reads the next frame)."""


MAX_TYPE_CHARS = 64
"""Longest message ``type`` (they are short words)."""


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not allowed (JSON numbers must be finite)")


def decode_message(raw: bytes, peer: str) -> dict:
    """A frame's JSON part as a message (an object with a short string ``type``), or
    :class:`BadMessage` naming ``peer`` and what was expected; never another exception (deep
    nesting, bad UTF-8, NaN/Infinity, integers too long to parse all become ``BadMessage``)."""
    try:
        msg = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise BadMessage(f"side channel from {peer}: expected a JSON object, got one nested "
                         f"too deeply to decode") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limit, NaN
        raise BadMessage(f"side channel from {peer}: expected a JSON object: {exc}") from None
    if (not isinstance(msg, dict) or not isinstance(msg.get("type"), str)
            or len(msg["type"]) > MAX_TYPE_CHARS):
        raise BadMessage(f"side channel from {peer}: expected a JSON object with a string "
                         f"'type' of at most {MAX_TYPE_CHARS} characters, got {_preview(msg)}")
    return msg


def _preview(value: object) -> str:
    try:
        text = repr(value)
    except RecursionError:  # unreachable for decoded JSON within the limit; kept cheap and safe
        text = f"<{type(value).__name__}>"
    return text[:200]


class Channel:
    """A connected side channel; ``peer`` names the other end in error messages."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, msg: dict, blob: bytes = b"", *, timeout_s: float = SEND_TIMEOUT_S) -> None:
        """Sends one frame; ``ChannelClosed`` when the peer is gone or takes no data for
        ``timeout_s`` seconds (a peer that never reads cannot block the sender for ever)."""
        data = json.dumps(msg, separators=(",", ":")).encode()
        if len(data) > MAX_JSON_BYTES or len(blob) > MAX_BLOB_BYTES:
            raise ProbeError(f"side channel to {self.peer}: frame too large "
                             f"({len(data)} B JSON, {len(blob)} B blob)")
        try:
            self.sock.settimeout(timeout_s)
            self.sock.sendall(HEADER.pack(len(data), len(blob)) + data + blob)
        except OSError as exc:
            raise ChannelClosed(f"side channel to {self.peer}: send failed: {exc}") from exc

    def recv(self, timeout_s: float | None, *, deadline: float | None = None) -> Frame:
        """Next frame, whole within ``timeout_s`` seconds (one deadline for the frame, not per
        ``recv``: a peer trickling bytes cannot stretch it) and before ``deadline`` (a
        ``time.monotonic()`` value, e.g. the end of a session) when given. ``ProbeError`` when
        late or oversized, :class:`BadMessage` when its JSON is not a message, ``ChannelClosed`` on EOF."""
        limit = None if timeout_s is None else time.monotonic() + timeout_s
        if deadline is not None and (limit is None or deadline < limit):
            limit, timeout_s = deadline, None  # the session's end comes first
        json_len, blob_len = HEADER.unpack(self._read(HEADER.size, timeout_s, limit))
        if json_len > MAX_JSON_BYTES or blob_len > MAX_BLOB_BYTES:
            raise ProbeError(f"side channel from {self.peer}: frame header announces {json_len} B "
                             f"JSON and {blob_len} B blob; expected at most {MAX_JSON_BYTES} and "
                             f"{MAX_BLOB_BYTES} (not a kvtune probe peer?)")
        raw = self._read(json_len, timeout_s, limit)
        blob = self._read(blob_len, timeout_s, limit) if blob_len else b""
        return Frame(decode_message(raw, self.peer), blob)

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

    def _read(self, n: int, timeout_s: float | None, limit: float | None) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            if limit is not None:
                left = limit - time.monotonic()
                if left <= 0:
                    raise self._late(timeout_s, len(buf))
                self.sock.settimeout(left)
            else:
                self.sock.settimeout(None)
            try:
                chunk = self.sock.recv(min(n - len(buf), _RECV_CHUNK_BYTES))
            except socket.timeout:
                raise self._late(timeout_s, len(buf)) from None
            except OSError as exc:
                raise ChannelClosed(f"side channel from {self.peer}: receive failed: {exc}") from exc
            if not chunk:
                raise ChannelClosed(f"side channel from {self.peer}: peer closed the connection")
            buf += chunk
        return bytes(buf)

    def _late(self, timeout_s: float | None, got: int) -> ProbeError:
        what = f"within {timeout_s:g} s" if timeout_s is not None else "before the session's end"
        part = f" (a frame was still incomplete: {got} B of one part arrived)" if got else ""
        return ProbeError(f"side channel from {self.peer}: no reply {what}{part}")

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
