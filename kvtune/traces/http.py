"""One bounded HTTP GET for the Tempo reader: an overall deadline, a size cap, and redirects that
never carry the source's headers to another origin.

``urllib.request.urlopen`` gives neither: its ``timeout`` bounds each socket operation, so a server
trickling one byte a second holds a read for as long as it likes (a 2 s timeout took 13 s); and it
follows a redirect to any host with every header of the request, ``Authorization`` included.
Here the whole exchange (connect, headers, body) has one deadline, enforced by shutting the socket
when it passes; a redirect is followed only to the same origin (scheme, host and port), and one to
another origin is refused, naming both.
"""
from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from kvtune.errors import TraceSourceError
from kvtune.redact import redact_url as redact

MAX_REDIRECTS = 5
"""Same-origin redirects followed for one request before it is refused."""
ERROR_BODY_BYTES = 64 * 1024
"""Bytes of a non-200 answer's body kept (the caller quotes the start of it)."""
FULL_BODY_STATUSES = (200, 206)
"""Statuses whose body is the answer, read up to the caller's cap (206: Tempo's partial answer)."""
_READ_BYTES = 1 << 16


@dataclass(frozen=True)
class Answer:
    """A server's answer: the status, the body (at most the cap asked for) and the final URL."""

    status: int
    body: bytes
    url: str


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL, the port defaulted by scheme."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


def get(url: str, *, headers: Mapping[str, str], timeout_s: float, max_bytes: int) -> Answer:
    """GET ``url`` within ``timeout_s`` seconds in all (redirects included).

    A 200 (or 206) answer's body longer than ``max_bytes`` raises; other statuses keep at most
    :data:`ERROR_BODY_BYTES`. Raises :class:`TraceSourceError` naming the URL when the server is
    unreachable, answers past the deadline, cuts its answer off, or redirects to another origin.
    """
    deadline = time.monotonic() + timeout_s
    start = url
    for _ in range(MAX_REDIRECTS + 1):
        answer, location = _get_once(url, headers, deadline, timeout_s, max_bytes)
        if location is None:
            return answer
        target = urllib.parse.urljoin(url, location)
        if origin(target) != origin(start) or urllib.parse.urlsplit(target).scheme not in (
                "http", "https"):
            raise TraceSourceError(
                f"{redact(url)}: HTTP {answer.status} redirect to another origin "
                f"({redact(target)}); not followed: the request's headers (credentials) go only "
                f"to {'://'.join(origin(start)[:2])}:{origin(start)[2]}; point the source at the "
                f"server that answers")
        url = target
    raise TraceSourceError(f"{redact(start)}: more than {MAX_REDIRECTS} redirects")


def _get_once(url: str, headers: Mapping[str, str], deadline: float, timeout_s: float,
              max_bytes: int) -> tuple[Answer, str | None]:
    """One request: (answer, the Location of a redirect or None)."""
    parts = urllib.parse.urlsplit(url)
    scheme, host, port = origin(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    where = redact(url)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _late(where, timeout_s)
    if scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=remaining, context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=remaining)
    expired = threading.Event()

    def cut() -> None:  # the deadline passed: unblock whatever read or connect is waiting
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(remaining, cut)
    timer.daemon = True
    timer.start()
    try:
        conn.request("GET", path, headers=dict(headers))
        resp = conn.getresponse()
        if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
            location = resp.getheader("Location")
            resp.read(ERROR_BODY_BYTES)
            return Answer(resp.status, b"", url), location
        cap = max_bytes if resp.status in FULL_BODY_STATUSES else ERROR_BODY_BYTES
        chunks: list[bytes] = []
        got = 0
        while got <= cap:
            chunk = resp.read1(min(_READ_BYTES, cap + 1 - got)) if hasattr(resp, "read1") else \
                resp.read(min(_READ_BYTES, cap + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        body = b"".join(chunks)
        if expired.is_set():
            raise _late(where, timeout_s)
        if resp.status in FULL_BODY_STATUSES:
            if len(body) > max_bytes:
                raise TraceSourceError(f"{where}: answer larger than {max_bytes} bytes; narrow "
                                       f"the query or the range")
            if resp.length:  # the connection closed before the announced length arrived
                raise TraceSourceError(f"{where}: Tempo's answer was cut off: {len(body)} of "
                                       f"{len(body) + resp.length} bytes arrived")
        return Answer(resp.status, body[:cap], url), None
    except TraceSourceError:
        raise
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set():
            raise _late(where, timeout_s) from None
        if isinstance(exc, http.client.HTTPException):
            raise TraceSourceError(f"{where}: Tempo's answer was cut off or malformed: "
                                   f"{type(exc).__name__}: {exc}") from exc
        raise TraceSourceError(f"{where}: Tempo unreachable: {exc}") from exc
    finally:
        timer.cancel()
        conn.close()


def _late(where: str, timeout_s: float) -> TraceSourceError:
    return TraceSourceError(f"{where}: no complete answer within {timeout_s:g} s (the Tempo "
                            f"source's deadline for one request, headers and body; raise it with "
                            f"TempoSource(timeout_s=...))")
