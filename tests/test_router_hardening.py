"""The router under hostile or unlucky input (issue 18, Router): one regression test per example
found by the audit, through real HTTP on loopback against the stand-in vLLM servers.
``docs/bad-input.md`` lists them."""
from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtune import spans
from kvtune.router import RouterInThread
from kvtune.router.client import get, post
from kvtune.router.parsing import MAX_JSON_DEPTH
from kvtune.router.server import UPSTREAM_REQUEST_ID_HEADER
from kvtune.router.state import MAX_CONVERSATION_ID_BYTES
from kvtune.vllm_pd import KV_TRANSFER_PARAMS, REMOTE_BLOCK_IDS, REMOTE_REQUEST_ID
from kvtune.testing.standin import StandInVllmCluster

pytestmark = pytest.mark.timeout(180)


def _body(prompt="a b c", **extra):
    return {"model": "m", "prompt": prompt, "max_tokens": 2, **extra}


def _raw_http(port: int, head: bytes, body: bytes = b"", timeout_s: float = 30.0) -> tuple[int, dict]:
    """Send one request with raw bytes (headers urllib would not send); (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head_part, _, payload = data.partition(b"\r\n\r\n")
    status = int(head_part.split(b" ", 2)[1])
    return status, json.loads(payload)


@pytest.mark.parametrize("mode", ["pull", "push", "bidirectional"])
def test_20_concurrent_requests_sharing_one_x_request_id(mode, tmp_path, tracer, exporter):
    """Before: in pull mode 19 of 20 failed ("prefill blocks unknown or already read"); in push
    mode the decode's remote_request_id was the client's string."""
    client_id = "same-id-for-everyone"
    with StandInVllmCluster(1, 1, bidirectional=mode == "bidirectional") as cluster, \
            RouterInThread(cluster.router_config(mode, state=f"sqlite:{tmp_path}/s.db"),
                           tracer=tracer) as router:
        def one(i: int):
            return post(router.url + "/v1/completions", _body(f"p{i} x y", conversation_id=f"c{i}"),
                        headers={"X-Request-Id": client_id}, timeout_s=60)

        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(one, range(20)))
        prefill, decode = cluster.requests("prefill"), cluster.requests("decode")
    assert [a.status for a in answers] == [200] * 20, [a.body for a in answers if a.status != 200]
    assert all(a.headers["X-Request-Id"] == client_id for a in answers)  # echoed
    ours = {a.headers[UPSTREAM_REQUEST_ID_HEADER] for a in answers}
    assert len(ours) == 20 and client_id not in ours
    # The legs carry the router's ids, one per request, never the client's.
    assert {p.headers["X-Request-Id"] for p in prefill} == ours
    assert {d.headers["X-Request-Id"] for d in decode} == ours
    if mode == "push":
        assert {d.body[KV_TRANSFER_PARAMS][REMOTE_REQUEST_ID] for d in decode} == ours
    request_spans = [s for s in exporter.get_finished_spans()
                     if s.name == spans.SpanName.REQUEST.value]
    assert {s.attributes[spans.BASE_REQUEST_ID] for s in request_spans} == ours
    assert {s.attributes[spans.CLIENT_REQUEST_ID] for s in request_spans} == {client_id}


def test_lone_surrogate_conversation_id_is_400(tmp_path):
    """Before: HTTP 500 from SQLite (and the span exporter then dropped the whole batch)."""
    with StandInVllmCluster(1, 1, bidirectional=True) as cluster, \
            RouterInThread(cluster.router_config("bidirectional",
                                                 state=f"sqlite:{tmp_path}/s.db")) as router:
        raw = b'{"model": "m", "prompt": "a", "max_tokens": 2, "conversation_id": "ab\\ud800"}'
        bad = post(router.url + "/v1/completions", raw)
        header = post(router.url + "/v1/completions", _body(),
                      headers={spans.CONVERSATION_HEADER: "x\xff"})  # sent as the byte 0xff
        good = post(router.url + "/v1/completions", _body(conversation_id="ok"))
        n_prefill = len(cluster.requests("prefill"))
    assert bad.status == 400, bad.body
    err = bad.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert "conversation_id" in err["message"] and "surrogate" in err["message"]
    assert header.status == 400 and "0xff" in header.json()["error"]["message"]
    assert good.status == 200 and n_prefill == 1


def test_non_utf8_header_values_are_400(tmp_path):
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db")) as router:
        port = int(router.url.rsplit(":", 1)[1])
        body = json.dumps(_body()).encode()
        statuses = {}
        for name in (b"X-Request-Id", spans.CONVERSATION_HEADER.encode(), b"Authorization"):
            statuses[name] = _raw_http(port, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n"
                                       + name + b": ab\xff\xfecd\r\n", body)
        ok = _raw_http(port, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n"
                       b"X-Request-Id: plain-ascii\r\n", body)
        n_prefill = len(cluster.requests("prefill"))
    for name, (status, answer) in statuses.items():
        assert status == 400, (name, answer)
        assert name.decode() in answer["error"]["message"]
        assert "0xff" in answer["error"]["message"]
    assert ok[0] == 200 and n_prefill == 1


def test_deeply_nested_json_is_400_json(tmp_path):
    """Before: aiohttp's plain-text 500 (RecursionError)."""
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db")) as router:
        url = router.url + "/v1/completions"
        very_deep = post(url, b"[" * 200_000 + b"]" * 200_000)
        just_over = post(url, json.dumps(_body(extra=_nest(MAX_JSON_DEPTH))).encode())
        within = post(url, json.dumps(_body(extra=_nest(MAX_JSON_DEPTH - 2))).encode())
        n_prefill = len(cluster.requests("prefill"))
    for answer in (very_deep, just_over):
        assert answer.status == 400, answer.body
        assert answer.headers["Content-Type"].startswith("application/json")
        assert f"deeper than {MAX_JSON_DEPTH}" in answer.json()["error"]["message"]
    assert within.status == 200, within.body
    assert n_prefill == 1


def _nest(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def test_conversation_id_length_is_capped(tmp_path):
    """Before: 4 MiB ids grew the SQLite file to 50 MB in six requests."""
    db = tmp_path / "s.db"
    with StandInVllmCluster(1, 1, bidirectional=True) as cluster, \
            RouterInThread(cluster.router_config("bidirectional", state=f"sqlite:{db}")) as router:
        url = router.url + "/v1/completions"
        huge = [post(url, _body(conversation_id=f"{i}" + "x" * (4 * 1024 * 1024)))
                for i in range(6)]
        at_cap = post(url, _body(conversation_id="é" * (MAX_CONVERSATION_ID_BYTES // 2)))
        over = post(url, _body(conversation_id="y" * (MAX_CONVERSATION_ID_BYTES + 1)))
    assert [a.status for a in huge] == [400] * 6
    assert f"at most {MAX_CONVERSATION_ID_BYTES} UTF-8 bytes" in huge[0].json()["error"]["message"]
    assert at_cap.status == 200, at_cap.body
    assert over.status == 400
    state_bytes = sum(p.stat().st_size for p in tmp_path.glob("s.db*"))
    assert state_bytes < 1024 * 1024, state_bytes


def test_stream_flag_must_be_boolean(tmp_path):
    """A string "false" is truthy: the router would open a stream the client did not ask for."""
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db")) as router:
        answer = post(router.url + "/v1/completions", _body(stream="false"))
    assert answer.status == 400 and "'stream'" in answer.json()["error"]["message"]


def test_client_trickling_headers_is_disconnected(tmp_path):
    """Before: a client sending a header byte now and then held its connection forever."""
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db",
                                                 header_timeout_s=1.0)) as router:
        port = int(router.url.rsplit(":", 1)[1])
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Slow: ")
        closed = False
        for _ in range(200):  # up to ~20 s of trickling, far beyond the 1 s deadline
            try:
                s.sendall(b"x")
                s.settimeout(0.1)
                if s.recv(1) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except OSError:
                closed = True
                break
        s.close()
        health = get(router.url + "/health").json()
        ok = post(router.url + "/v1/completions", _body())
    assert closed
    assert health["connections"]["header_timeouts_total"] >= 1
    assert ok.status == 200


def test_connections_over_the_cap_get_503(tmp_path):
    cap = 4
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db",
                                                 max_connections=cap,
                                                 max_connections_per_client=cap)) as router:
        port = int(router.url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(cap)]
        try:
            time.sleep(0.2)  # let the router accept them (order only; nothing timed is asserted)
            status, answer = _raw_http(port, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n",
                                       json.dumps(_body()).encode())
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 20
        while True:  # the router notices the closed connections
            try:
                after = post(router.url + "/v1/completions", _body(), timeout_s=10)
                if after.status == 200 or time.monotonic() > deadline:
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)
        health = get(router.url + "/health").json()
        n_prefill = len(cluster.requests("prefill"))
    assert status == 503 and answer["error"]["type"] == "server_busy"
    assert after.status == 200
    assert health["connections"]["refused_total"] >= 1
    assert n_prefill == 1


def test_store_failure_serves_the_turn_without_history(tmp_path, tracer, exporter):
    """Redis goes away between two turns: the turn is served (no history) and the span says why."""
    from redis_faults import redis_server
    try:
        ctx = redis_server(tmp_path / "redis")
        port = ctx.__enter__()
    except FileNotFoundError:
        pytest.skip("no redis-server binary on this machine")
    stopped = False
    try:
        with StandInVllmCluster(1, 1, bidirectional=True) as cluster, \
                RouterInThread(cluster.router_config("bidirectional",
                                                     state=f"redis://127.0.0.1:{port}/0"),
                               tracer=tracer) as router:
            url = router.url + "/v1/completions"
            first = post(url, _body(conversation_id="c"))
            ctx.__exit__(None, None, None)
            stopped = True
            second = post(url, _body("a b c w0 w1 d", conversation_id="c"))
            health = get(router.url + "/health").json()
            prefill = cluster.requests("prefill")
    finally:
        if not stopped:
            ctx.__exit__(None, None, None)
    assert first.status == 200 and second.status == 200, second.body
    assert REMOTE_BLOCK_IDS not in prefill[1].body[KV_TRANSFER_PARAMS]
    assert health["state_errors_total"] >= 1
    request_spans = sorted((s for s in exporter.get_finished_spans()
                            if s.name == spans.SpanName.REQUEST.value), key=lambda s: s.start_time)
    events = [e for e in request_spans[1].events if e.name == spans.EventName.STATE_ERROR.value]
    assert events and events[0].attributes[spans.ERROR_TYPE] == "StateStoreError"
    assert "begin_turn" in events[0].attributes[spans.EXCEPTION_MESSAGE]
