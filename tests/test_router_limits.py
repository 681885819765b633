"""Limits that keep one upstream or one client from holding the router (issue 29), through real
HTTP on loopback: a decode stand-in trickling a stream that never ends is cut off at
``stream_deadline_s``; one client address cannot take more than ``max_connections_per_client`` of
the router's connections. ``docs/bad-input.md`` lists them."""
from __future__ import annotations

import json
import socket
import time

import pytest

from kvtune import spans
from kvtune.errors import ConfigError
from kvtune.router import RouterInThread
from kvtune.router.client import get, parse_sse, post
from kvtune.router.server import STREAM_DEADLINE_ERROR
from kvtune.testing.standin import StandInVllmCluster

pytestmark = pytest.mark.timeout(180)

TRICKLE_S = 0.05
"""The stand-in sends a word this often: far inside the idle timeout below."""
DEADLINE_S = 1.0
"""The router's stream deadline in the test (the stand-in would trickle for 60 s)."""
OTHER_CLIENT = "127.0.0.2"
"""A second client address on the loopback network (Linux answers all of 127.0.0.0/8)."""


def _body(**extra):
    return {"model": "m", "prompt": "a b c", "max_tokens": 2, **extra}


def test_a_trickling_stream_is_cut_off_at_the_deadline(tmp_path, tracer, exporter):
    """Before: only an idle timeout existed, so an upstream sending a word every 50 ms held the
    request (and its connections) for as long as it liked."""
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db",
                                                 stream_idle_timeout_s=30.0,
                                                 stream_deadline_s=DEADLINE_S),
                           tracer=tracer) as router:
        cluster.decode[0].trickle_s = TRICKLE_S
        answer = post(router.url + "/v1/completions", _body(stream=True), timeout_s=90)
        aborted = False
        for _ in range(200):  # the stand-in sees its client go away (bounded wait, order only)
            aborted = cluster.decode[0].streams_aborted == 1
            if aborted:
                break
            time.sleep(0.05)
        health = get(router.url + "/health").json()
        cluster.decode[0].trickle_s = None
        after = post(router.url + "/v1/completions", _body(stream=True), timeout_s=60)
    events = parse_sse(answer.body)
    assert answer.status == 200 and b"[DONE]" not in answer.body
    assert any(e.get("choices") for e in events)  # the words before the cut reached the client
    error = events[-1]["error"]
    assert error["type"] == "upstream_timeout" and error["code"] == 504
    assert "stream_deadline_s" in error["message"] and error["leg"] == "decode"
    assert aborted  # the upstream connection was closed, not left streaming
    assert health["stream_deadlines_total"] == 1
    assert after.status == 200 and b"[DONE]" in after.body
    (span, _) = [s for s in exporter.get_finished_spans()
                 if s.name == spans.SpanName.REQUEST.value]
    assert span.status.status_code.name == "ERROR"
    assert span.attributes[spans.ERROR_TYPE] == STREAM_DEADLINE_ERROR


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _ask(s: socket.socket) -> tuple[int, dict]:
    """One request on an open connection, answered with ``Connection: close``: (status, JSON)."""
    body = json.dumps(_body()).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(payload)


def test_one_client_cannot_fill_the_connection_cap(tmp_path):
    """Before: one global cap only, so one client holding idle connections locked every other
    client out (503)."""
    share = 3
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db",
                                                 max_connections=8,
                                                 max_connections_per_client=share)) as router:
        port = int(router.url.rsplit(":", 1)[1])
        held = [_connect(port) for _ in range(share)]
        try:
            time.sleep(0.2)  # let the router accept them (order only; nothing timed is asserted)
            with _connect(port) as extra:
                status, answer = _ask(extra)
            with _connect(port, OTHER_CLIENT) as other:
                other_status, _ = _ask(other)
            mine_status, _ = _ask(held[0])  # a connection within the share is served
        finally:
            for s in held:
                s.close()
        with _connect(port, OTHER_CLIENT) as h:  # 127.0.0.1 may still hold its share a moment
            h.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := h.recv(65536):
                data += chunk
        health = json.loads(data.partition(b"\r\n\r\n")[2])
    assert status == 429 and answer["error"]["type"] == "too_many_connections"
    assert "max_connections_per_client (3)" in answer["error"]["message"]
    assert other_status == 200 and mine_status == 200
    assert health["connections"]["refused_per_client_total"] == 1
    assert health["connections"]["refused_total"] == 0


def test_per_client_share_defaults_to_a_quarter_and_is_checked():
    with StandInVllmCluster(1, 1) as cluster:
        assert cluster.router_config(max_connections=1024).connections_per_client == 256
        assert cluster.router_config(max_connections=2).connections_per_client == 1
        assert cluster.router_config(max_connections_per_client=5).connections_per_client == 5
        for bad in (0, -1):
            with pytest.raises(ConfigError, match="max_connections_per_client"):
                cluster.router_config(max_connections_per_client=bad)
        with pytest.raises(ConfigError, match="stream_deadline_s"):
            cluster.router_config(stream_deadline_s=float("inf"))


@pytest.mark.parametrize("complete", [False, True], ids=["partial", "whole"])
def test_a_body_that_stops_coming_is_answered_408(complete, tmp_path, monkeypatch):
    from kvtune.router import server
    monkeypatch.setattr(server, "BODY_READ_TIMEOUT_S", 0.5)
    body = json.dumps({"model": "m", "prompt": "a b", "max_tokens": 2}).encode()
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db")) as router:
        port = int(router.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                         + (body if complete else body[:10]))
            head = sock.recv(65536).split(b"\r\n", 1)[0]
    assert head == (b"HTTP/1.1 200 OK" if complete else b"HTTP/1.1 408 Request Timeout")
