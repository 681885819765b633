"""The Tempo reader's trust boundaries (issue 29): a redirect never carries the source's headers to
another origin, and one request has one overall deadline, however slowly the server answers.

Stand-in HTTP servers on 127.0.0.1 (Tempo cannot be made to misbehave on purpose): one that
redirects, one that records the headers it gets, one that trickles its answer a byte at a time.
"""
from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtune.errors import TraceSourceError
from kvtune.traces import TempoSource, load
from kvtune.traces.http import redact

SECRET = "Bearer planted-secret-7f3a"
SEARCH = json.dumps({"traces": []}).encode()


@contextmanager
def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


class Quiet(BaseHTTPRequestHandler):
    """A handler that logs nothing and answers with :meth:`reply`."""

    def reply(self, data: bytes, status: int = 200, **headers: str) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def recorder() -> type[BaseHTTPRequestHandler]:
    class Recorder(Quiet):
        seen: list[dict[str, str]] = []

        def do_GET(self) -> None:
            type(self).seen.append(dict(self.headers))
            self.reply(SEARCH)

    return Recorder


def redirector(target: str) -> type[BaseHTTPRequestHandler]:
    """Answers every request under /api with a 302 to ``target`` + the path."""
    class Redirect(Quiet):
        def do_GET(self) -> None:
            self.reply(b"", 302, Location=target + self.path)

    return Redirect


def test_a_redirect_to_another_origin_is_refused_and_carries_nothing_there() -> None:
    other = recorder()
    with serve(other) as elsewhere:
        with serve(redirector(f"http://localhost:{elsewhere.server_port}")) as tempo:
            src = TempoSource(f"http://127.0.0.1:{tempo.server_port}",
                              headers={"Authorization": SECRET}, since_s=60)
            with pytest.raises(TraceSourceError) as err:
                load(src)
    msg = str(err.value)
    assert "redirect to another origin" in msg and f"localhost:{elsewhere.server_port}" in msg
    assert SECRET not in msg
    assert other.seen == []  # the other origin was never asked, with or without the header


def test_a_redirect_within_the_origin_is_followed_with_the_headers() -> None:
    class SameOrigin(Quiet):
        seen: list[tuple[str, str | None]] = []

        def do_GET(self) -> None:
            type(self).seen.append((self.path, self.headers.get("Authorization")))
            if self.path.startswith("/api/"):
                self.reply(b"", 307, Location="/tempo" + self.path)
            else:
                self.reply(SEARCH)

    with serve(SameOrigin) as tempo:
        df = load(TempoSource(f"http://127.0.0.1:{tempo.server_port}",
                              headers={"Authorization": SECRET}, since_s=60))
    assert len(df) == 0
    paths = [p for p, _ in SameOrigin.seen]
    assert paths[0].startswith("/api/search") and paths[1].startswith("/tempo/api/search")
    assert {a for _, a in SameOrigin.seen} == {SECRET}


@pytest.mark.parametrize("phase", ["headers", "body"])
def test_a_trickling_server_is_cut_off_at_the_deadline(phase: str) -> None:
    """1 byte a second for 40 s against a 2 s deadline: the reader gives up, naming the URL and the
    deadline, and closes the connection long before the server has sent its answer."""
    sent = []
    done = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def trickle() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n"
        try:
            if phase == "body":
                conn.sendall(head)
                payload = b" " * 40
            else:
                payload = head
            for b in payload[:40]:
                conn.sendall(bytes([b]))
                sent.append(b)
                if done.wait(1.0):
                    break
                # a closed peer shows as an empty, readable socket
                conn.settimeout(0.01)
                try:
                    if conn.recv(1) == b"":
                        break
                except TimeoutError:
                    pass
                except OSError:
                    break
                conn.settimeout(None)
        except OSError:
            pass
        finally:
            conn.close()

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        with pytest.raises(TraceSourceError) as err:
            load(TempoSource(f"http://127.0.0.1:{port}", timeout_s=2, since_s=60))
    finally:
        thread.join(timeout=60)
        done.set()
        listener.close()
    assert "no complete answer within 2 s" in str(err.value)
    assert f"127.0.0.1:{port}/api/search" in str(err.value)
    assert len(sent) < 20, f"the server trickled {len(sent)} of 40 bytes before the reader left"


def test_redact_hides_the_password_only() -> None:
    assert redact("http://u:pw@h:1/p?q=1") == "http://u:***@h:1/p?q=1"
    assert redact("http://h:1/p") == "http://h:1/p"


def test_a_trace_tempo_answers_as_partial_is_said_never_silently() -> None:
    """Tempo's v2 trace answer carries ``"status": "PARTIAL"`` when the trace exceeded its size
    limit: the read keeps the spans it got and says so (a warning finding, the URL, Tempo's
    message)."""
    tid = "4bf92f3577b34da6a3ce929d0e0e4736"
    span = {"traceId": tid, "spanId": "00f067aa0ba902b7", "name": "kv.rdma",
            "startTimeUnixNano": "1000", "endTimeUnixNano": "2000"}
    body = json.dumps({"trace": {"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]},
                       "status": "PARTIAL",
                       "message": "Trace exceeds maximum size of 5000000 bytes, a partial trace "
                                  "is returned"}).encode()

    class Partial(Quiet):
        def do_GET(self) -> None:
            self.reply(json.dumps({"traces": [{"traceID": tid}]}).encode()
                       if self.path.startswith("/api/search") else body)

    with serve(Partial) as tempo:
        df = load(TempoSource(f"http://127.0.0.1:{tempo.server_port}", since_s=60))
    (read,) = df.attrs["tempo_reads"]
    assert len(df) == 1 and read.partial
    (note,) = read.partial_answers
    assert f"/api/v2/traces/{tid}" in note and "maximum size" in note
    codes = {f["code"]: f for f in read.findings()}
    assert codes["tempo_partial_answers"]["severity"] == "warning"
