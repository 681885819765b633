"""The router's client for its JSON legs (issue 30): one POST, one whole JSON answer, over kept-alive
HTTP/1.1 connections per instance.

Why not aiohttp's client here: a leg's request and answer are a few KiB, and aiohttp's general
machinery (request and response objects, a writer task, stream readers, trace signals) cost more
CPU than the rest of the router per request. This client does only what a leg needs: write the
request in one call, parse the status line and headers, read a ``Content-Length``, chunked or
until-close body, decompress ``gzip``/``deflate`` under the same cap as the raw bytes (a
decompression bomb is cut off), and put the connection back only when the answer was read whole
and the server keeps it open. Any failure, timeout or cancellation closes the connection (a
cancelled leg is aborted upstream, as vLLM aborts a request whose client goes away).

Streamed decodes and ``/v1/models`` still use aiohttp (:mod:`kvtune.router.server`).
"""
from __future__ import annotations

import asyncio
import base64
import ssl
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from kvtune.router.tracing import leg_body_read, leg_connection, leg_request_sent

MAX_HEADER_BYTES = 64 * 1024
"""Longest status line plus headers accepted from an upstream."""
MAX_IDLE_PER_INSTANCE = 256
"""Kept-alive connections held per instance (more are closed when their leg ends)."""
IDLE_TIMEOUT_S = 30.0
"""A kept-alive connection idle this long is closed rather than reused (servers drop them too)."""


class UpstreamProtocolError(Exception):
    """The upstream's answer broke HTTP/1.1 (or the connection closed mid-answer)."""


class AnswerTooLarge(Exception):
    """The answer's body (decompressed) grew past the caller's limit."""


@dataclass(frozen=True)
class Answer:
    """An upstream's answer: status, content type and body (decompressed; capped)."""

    status: int
    content_type: str | None
    body: bytes


@dataclass(frozen=True, eq=False)  # one per instance URL (cached): keyed by identity, hashed fast
class _Origin:
    host: str
    port: int
    tls: bool
    host_header: str
    authorization: str | None
    """``Basic ...`` from the URL's user info (as aiohttp sends it), or None."""


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: received bytes in a buffer, a future to wait for more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.lost: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.idle_since = 0.0
        self.received = 0
        """Bytes received on this connection (all answers)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.received += len(data)
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self.eof = True
        self.lost = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def more(self) -> None:
        """Wait until more bytes (or the end of the stream) arrive."""
        if self.eof:
            raise UpstreamProtocolError("connection closed before the answer was complete"
                                        + (f" ({self.lost})" if self.lost else ""))
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    @property
    def usable(self) -> bool:
        return (self.transport is not None and not self.eof and not self.buf
                and not self.transport.is_closing())

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class UpstreamClient:
    """Kept-alive connections to the router's instances (by URL), and :meth:`post_json`. All calls
    run on the router's event loop."""

    def __init__(self, *, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    def _origin(self, base_url: str) -> _Origin:
        origin = self._origins.get(base_url)
        if origin is None:
            parts = urlsplit(base_url)
            tls = parts.scheme == "https"
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"instance URL {base_url!r}: expected http(s)://HOST[:PORT]")
            port = parts.port or (443 if tls else 80)
            default = port == (443 if tls else 80)
            host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
            auth = None
            if parts.username is not None or parts.password is not None:
                creds = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
                auth = "Basic " + base64.b64encode(creds.encode("latin-1")).decode()
            origin = _Origin(parts.hostname, port, tls, host if default else f"{host}:{port}",
                             auth)
            self._origins[base_url] = origin
        return origin

    async def _connection(self, origin: _Origin, *,
                          fresh: bool = False) -> tuple[_Connection, bool]:
        """A kept-alive connection to ``origin`` (reused: True) or a new one (False; always with
        ``fresh``)."""
        idle = self._idle.get(origin)
        loop = asyncio.get_running_loop()
        now = loop.time()
        while idle and not fresh:
            conn = idle.pop()
            if conn.usable and now - conn.idle_since < IDLE_TIMEOUT_S:
                return conn, True
            conn.close()
        if origin.tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                _Connection, origin.host, origin.port,
                ssl=self._ssl if origin.tls else None,
                server_hostname=origin.host if origin.tls else None)
        return conn, False

    def _release(self, origin: _Origin, conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if conn.usable and len(idle) < MAX_IDLE_PER_INSTANCE:
            conn.idle_since = asyncio.get_running_loop().time()
            idle.append(conn)
        else:
            conn.close()

    async def post_json(self, base_url: str, path: str, body: bytes,
                        headers: Mapping[str, str], *, limit: int, error_limit: int) -> Answer:
        """POST ``body`` (JSON bytes) to ``base_url + path`` and read the whole answer: a 200's body
        up to ``limit`` bytes (more raises :class:`AnswerTooLarge`), another status's first
        ``error_limit`` bytes. Raises :class:`UpstreamProtocolError` or ``OSError`` when the
        exchange fails; the caller bounds its time (the connection is closed when cancelled).

        A kept-alive connection that turns out closed before any byte of the answer arrived (the
        server dropped it as idle while the request was on its way) is replaced once and the
        request sent again, as the Redis store does (:mod:`kvtune.router.state`)."""
        origin = self._origin(base_url)
        conn, reused = await self._connection(origin)
        leg_connection(reused)
        if not reused:
            return await self._exchange(origin, conn, path, body, headers, limit, error_limit)
        before = conn.received
        try:
            return await self._exchange(origin, conn, path, body, headers, limit, error_limit)
        except (OSError, UpstreamProtocolError):
            if conn.received != before:
                raise
        conn, _ = await self._connection(origin, fresh=True)
        return await self._exchange(origin, conn, path, body, headers, limit, error_limit)

    async def _exchange(self, origin: _Origin, conn: _Connection, path: str, body: bytes,
                        headers: Mapping[str, str], limit: int, error_limit: int) -> Answer:
        keep = False
        try:
            head = [f"POST {path} HTTP/1.1\r\nHost: {origin.host_header}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                    "Accept: */*\r\n"]
            for name, value in headers.items():
                if origin.authorization is not None and name.lower() == "authorization":
                    continue  # the instance URL's credentials win
                head.append(f"{name}: {value}\r\n")
            if origin.authorization is not None:
                head.append(f"Authorization: {origin.authorization}\r\n")
            head.append("\r\n")
            assert conn.transport is not None
            conn.transport.write("".join(head).encode("latin-1") + body)
            leg_request_sent(len(body))
            answer, keep = await _read_answer(conn, limit, error_limit)
            return answer
        finally:
            if keep:
                self._release(origin, conn)
            else:
                conn.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


async def _read_answer(conn: _Connection, limit: int, error_limit: int) -> tuple[Answer, bool]:
    """The answer on ``conn`` and whether the connection may be reused."""
    while True:  # skip 1xx interim answers
        end = conn.buf.find(b"\r\n\r\n")
        while end < 0:
            if len(conn.buf) > MAX_HEADER_BYTES:
                raise UpstreamProtocolError(f"answer headers longer than {MAX_HEADER_BYTES} bytes")
            await conn.more()
            end = conn.buf.find(b"\r\n\r\n")
        lines = bytes(conn.buf[:end]).decode("latin-1").split("\r\n")
        del conn.buf[:end + 4]
        status_line = lines[0].split(" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/1.") \
                or not status_line[1].isdigit():
            raise UpstreamProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(status_line[1])
        if not 100 <= status < 200:
            break
    version = status_line[0]
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise UpstreamProtocolError(f"malformed header line {line[:80]!r}")
        key = name.strip().lower()
        value = value.strip()
        fields[key] = f"{fields[key]}, {value}" if key in fields else value
    cap = limit if status == 200 else error_limit
    encoding = fields.get("content-encoding", "identity").strip().lower()
    decoder = _Decoder(encoding, cap, truncate=status != 200)
    chunked = "chunked" in fields.get("transfer-encoding", "").lower()
    connection = fields.get("connection", "").lower()
    keep = "close" not in connection and (version != "HTTP/1.0" or "keep-alive" in connection)
    if chunked:
        await _read_chunked(conn, decoder)
    elif "content-length" in fields:
        try:
            n = int(fields["content-length"])
        except ValueError:
            raise UpstreamProtocolError("Content-Length is not an integer") from None
        if n < 0:
            raise UpstreamProtocolError("negative Content-Length")
        while n:
            if not conn.buf:
                await conn.more()
            take = min(n, len(conn.buf))
            piece = bytes(conn.buf[:take])
            del conn.buf[:take]
            n -= take
            if decoder.feed(piece):
                keep = False  # the rest is not read: this connection is not reusable
                break
    else:  # until the server closes the connection
        keep = False
        while True:
            if conn.buf:
                piece = bytes(conn.buf)
                conn.buf.clear()
                if decoder.feed(piece):
                    break
            if conn.eof:
                break
            try:
                await conn.more()
            except UpstreamProtocolError:
                break
    body = decoder.finish()
    return Answer(status, fields.get("content-type"), body), keep and not conn.buf


async def _read_chunked(conn: _Connection, decoder: _Decoder) -> None:
    while True:
        nl = conn.buf.find(b"\r\n")
        while nl < 0:
            if len(conn.buf) > MAX_HEADER_BYTES:
                raise UpstreamProtocolError("chunk size line too long")
            await conn.more()
            nl = conn.buf.find(b"\r\n")
        size_text = bytes(conn.buf[:nl]).split(b";", 1)[0].strip()
        del conn.buf[:nl + 2]
        try:
            size = int(size_text, 16)
        except ValueError:
            raise UpstreamProtocolError(f"bad chunk size {size_text[:20]!r}") from None
        if size == 0:  # trailers, then an empty line
            while True:
                nl = conn.buf.find(b"\r\n")
                while nl < 0:
                    await conn.more()
                    nl = conn.buf.find(b"\r\n")
                line = bytes(conn.buf[:nl])
                del conn.buf[:nl + 2]
                if not line:
                    return
        while len(conn.buf) < size + 2:
            await conn.more()
        piece = bytes(conn.buf[:size])
        if conn.buf[size:size + 2] != b"\r\n":
            raise UpstreamProtocolError("chunk not terminated by CRLF")
        del conn.buf[:size + 2]
        if decoder.feed(piece):
            conn.eof = True  # not read to its end: never reused
            return


class _Decoder:
    """The body as it arrives, decompressed, counted (``kv.http.response_bytes``) and capped."""

    def __init__(self, encoding: str, cap: int, *, truncate: bool) -> None:
        if encoding in ("gzip", "x-gzip"):
            self._z: zlib._Decompress | None = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._z = zlib.decompressobj()
        elif encoding in ("identity", ""):
            self._z = None
        else:
            raise UpstreamProtocolError(f"unsupported Content-Encoding {encoding[:40]!r}")
        self._cap, self._truncate = cap, truncate
        self._out = bytearray()
        self.full = False

    def feed(self, data: bytes) -> bool:
        """Take raw body bytes; True once the cap is reached (stop reading)."""
        if self.full:
            return True
        if self._z is not None:
            try:
                data = self._z.decompress(data, self._cap + 1 - len(self._out))
            except zlib.error as exc:
                raise UpstreamProtocolError(f"body does not decompress: {exc}") from None
        self._out += data
        leg_body_read(len(data))
        if len(self._out) > self._cap:
            if not self._truncate:
                raise AnswerTooLarge()
            del self._out[self._cap:]
            self.full = True
        return self.full

    def finish(self) -> bytes:
        return bytes(self._out)
