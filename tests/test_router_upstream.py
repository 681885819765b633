"""The router's JSON-leg client (:mod:`kvtune.router.upstream`) against canned HTTP answers: bodies
by length, chunks or close; gzip under the cap; 1xx skipped; error bodies cut; connections reused
only after a whole answer the server keeps open; URL credentials sent as Basic auth."""
from __future__ import annotations

import asyncio
import base64
import gzip

import pytest

from kvtune.router.upstream import AnswerTooLarge, UpstreamClient, UpstreamProtocolError

pytestmark = pytest.mark.timeout(60)


class CannedServer:
    """A fake upstream: answers each request (read up to its body) with the next canned bytes
    (``b""``: closes the connection instead); records the raw requests and counts connections."""

    def __init__(self, answers: list[bytes]) -> None:
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.connections = 0
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if not answer:  # b"": drop the connection without answering
                    break
                writer.write(answer)
                await writer.drain()
                if b"Connection: close" in answer or b"Content-Length" not in answer \
                        and b"chunked" not in answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def __aenter__(self) -> CannedServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()


def _ok(body: bytes, extra: str = "") -> bytes:
    return (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            f"\r\n{extra}\r\n").encode() + body


async def _post(client: UpstreamClient, url: str, *, limit: int = 1 << 20,
                headers: dict[str, str] | None = None):
    return await client.post_json(url, "/v1/completions", b'{"a": 1}', headers or {},
                                  limit=limit, error_limit=8)


def test_bodies_by_length_chunks_and_close_and_reuse_only_when_kept():
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\n{\"b\r\n5;ext=1\r\n\": 2}\r\n0\r\nX-Trailer: t\r\n\r\n")
    interim = b"HTTP/1.1 100 Continue\r\n\r\n" + _ok(b'{"c": 3}')
    closing = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"d": 4}'

    async def run() -> None:
        async with CannedServer([_ok(b'{"a": 1}'), chunked, interim, closing]) as server:
            client = UpstreamClient(connect_timeout_s=5)
            bodies = [(await _post(client, server.url)).body for _ in range(4)]
            assert bodies == [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}', b'{"d": 4}']
            assert server.connections == 1  # kept alive across the first three, then closed
            first = server.requests[0]
            assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
            assert b"Content-Length: 8\r\n" in first and first.endswith(b'{"a": 1}')
            client.close()
    asyncio.run(run())


def test_a_closed_or_connection_close_answer_is_not_reused():
    async def run() -> None:
        async with CannedServer([_ok(b"{}", "Connection: close\r\n"), _ok(b"{}")]) as server:
            client = UpstreamClient(connect_timeout_s=5)
            await _post(client, server.url)
            await _post(client, server.url)
            assert server.connections == 2
            client.close()
    asyncio.run(run())


def test_gzip_is_decompressed_and_capped():
    body = gzip.compress(b'{"x": "' + b"0" * 5000 + b'"}')
    answer = _ok(body, "Content-Encoding: gzip\r\n")

    async def run() -> None:
        async with CannedServer([answer, answer]) as server:
            client = UpstreamClient(connect_timeout_s=5)
            assert len((await _post(client, server.url)).body) == 5009
            with pytest.raises(AnswerTooLarge):
                await _post(client, server.url, limit=1000)
            client.close()
    asyncio.run(run())


def test_an_error_answer_keeps_its_first_bytes_and_its_status():
    err = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
           b"Content-Length: 20\r\n\r\n{\"error\": \"bad one\"}")

    async def run() -> None:
        async with CannedServer([err]) as server:
            client = UpstreamClient(connect_timeout_s=5)
            answer = await _post(client, server.url)
            assert (answer.status, answer.content_type, answer.body) == (
                400, "application/json", b'{"error"')
            client.close()
    asyncio.run(run())


def test_garbage_and_truncated_answers_raise():
    async def run() -> None:
        async with CannedServer([b"SSH-2.0-OpenSSH\r\n\r\n"]) as server:
            with pytest.raises(UpstreamProtocolError, match="status line"):
                await _post(UpstreamClient(connect_timeout_s=5), server.url)
        truncated = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nConnection: close\r\n\r\n{}"
        async with CannedServer([truncated]) as server:
            with pytest.raises(UpstreamProtocolError, match="closed"):
                await _post(UpstreamClient(connect_timeout_s=5), server.url)
    asyncio.run(run())


def test_url_credentials_are_sent_as_basic_auth_and_win_over_a_forwarded_header():
    async def run() -> None:
        async with CannedServer([_ok(b"{}")]) as server:
            url = server.url.replace("http://", "http://user:p%40ss@")
            await _post(UpstreamClient(connect_timeout_s=5), url,
                        headers={"Authorization": "Bearer client", "X-Request-Id": "r1"})
            head = server.requests[0]
            assert f"Authorization: Basic {base64.b64encode(b'user:p@ss').decode()}".encode() \
                in head
            assert b"Bearer client" not in head and b"X-Request-Id: r1\r\n" in head
    asyncio.run(run())


def test_a_kept_alive_connection_dropped_before_answering_is_replaced_once():
    async def run() -> None:
        async with CannedServer([_ok(b'{"a": 1}'), b"", _ok(b'{"b": 2}')]) as server:
            client = UpstreamClient(connect_timeout_s=5)
            await _post(client, server.url)
            assert (await _post(client, server.url)).body == b'{"b": 2}'
            assert server.connections == 2 and len(server.requests) == 3
            client.close()
        # a new connection that closes without answering is not retried
        async with CannedServer([b"", _ok(b"{}")]) as server:
            with pytest.raises(UpstreamProtocolError, match="closed"):
                await _post(UpstreamClient(connect_timeout_s=5), server.url)
            assert server.connections == 1
        # nor is a reused one that closed mid-answer (the request may have run)
        cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nConnection: close\r\n\r\n{"
        async with CannedServer([_ok(b"{}"), cut, _ok(b"{}")]) as server:
            client = UpstreamClient(connect_timeout_s=5)
            await _post(client, server.url)
            with pytest.raises(UpstreamProtocolError, match="closed"):
                await _post(client, server.url)
            client.close()
    asyncio.run(run())
