"""End-to-end router tests through real HTTP on loopback, against stand-in vLLM servers
(``StandInVllm...``, which speak vLLM's P/D protocol and check it) — all modes, streaming,
restart, expiry, load, failures and limits."""
from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from opentelemetry.trace import StatusCode

from kvtune import spans
from kvtune.router import RouterInThread, RouterProcess
from kvtune.router.client import get, post
from kvtune.router.server import FAILED_INSTANCE_HEADER, FAILED_LEG_HEADER
from kvtune.testing.standin import StandInVllmCluster
from kvtune.vllm_pd import (
    CONTEXT_KEYS, DO_REMOTE_DECODE, DO_REMOTE_PREFILL, KV_TRANSFER_PARAMS, MODES, PP_SIZE,
    REMOTE_BLOCK_IDS, REMOTE_ENGINE_ID, REMOTE_HOST, REMOTE_NUM_TOKENS, REMOTE_PORT,
    REMOTE_REQUEST_ID, TP_SIZE,
)
from _net import free_port


pytestmark = pytest.mark.timeout(180)


def _plain(params):
    """kv_transfer_params without the keys the router adds."""
    return {k: v for k, v in params.items() if k not in CONTEXT_KEYS}


def _completion(prompt, *, conv=None, stream=False, max_tokens=3):
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if conv is not None:
        body["conversation_id"] = conv
    return body


def _request_spans(exporter):
    return [s for s in exporter.get_finished_spans() if s.name == spans.SpanName.REQUEST.value]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("mode", MODES)
def test_modes_end_to_end(mode, stream, tmp_path, tracer, exporter):
    with StandInVllmCluster(1, 1, bidirectional=mode == "bidirectional") as cluster, \
            RouterInThread(cluster.router_config(mode, state=f"sqlite:{tmp_path}/s.db"),
                           tracer=tracer) as router:
        answers, history = [], ""
        for t in (1, 2):  # turn 2 continues turn 1 (its prompt, then its answer)
            prompt = history + f" turn {t}" + " hello" * 5 * t
            answers.append(post(router.url + "/v1/completions",
                                _completion(prompt, conv="conv-A", stream=stream)))
            history = prompt + answers[-1].text()
        prefill, decode = cluster.requests("prefill"), cluster.requests("decode")

    for a in answers:
        assert a.status == 200, a.body
        assert a.text() == " w0 w1 w2"  # a completion continues its prompt
        if stream:
            assert a.headers["Content-Type"].startswith("text/event-stream")
            assert a.body.rstrip().endswith(b"data: [DONE]")
    assert len(prefill) == len(decode) == 2
    assert all(r.status == 200 for r in prefill + decode)
    request_spans = sorted(_request_spans(exporter), key=lambda s: s.start_time)
    assert len(request_spans) == 2
    for turn, (p, d, span) in enumerate(zip(prefill, decode, request_spans), start=1):
        # Prefill leg: one token, no stream, do_remote_decode; conversation_id stripped.
        assert p.body["max_tokens"] == 1 and p.body["stream"] is False
        assert p.body[KV_TRANSFER_PARAMS][DO_REMOTE_DECODE] is True
        assert "conversation_id" not in p.body and "conversation_id" not in d.body
        assert d.body["stream"] is stream and d.body["max_tokens"] == 3
        # One request id and one traceparent on both legs, as header and inside kv_transfer_params.
        rid = p.headers["X-Request-Id"]
        assert d.headers["X-Request-Id"] == rid
        tp = p.headers["traceparent"]
        assert d.headers["traceparent"] == tp
        assert p.body[KV_TRANSFER_PARAMS][spans.KV_PARAMS_TRACEPARENT] == tp
        assert d.body[KV_TRANSFER_PARAMS][spans.KV_PARAMS_TRACEPARENT] == tp
        for leg in (p, d):
            assert leg.body[KV_TRANSFER_PARAMS][spans.KV_PARAMS_CONVERSATION_ID] == "conv-A"
            assert leg.body[KV_TRANSFER_PARAMS][spans.KV_PARAMS_TURN] == turn
        # The trace the legs carry is the kv.request root span's.
        ctx = span.get_span_context()
        assert tp.split("-")[1:3] == [f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"]
        assert span.parent is None
        attrs = span.attributes
        assert attrs[spans.MODE] == mode and attrs[spans.CONVERSATION_ID] == "conv-A"
        assert attrs[spans.TURN] == turn and attrs[spans.STREAM] is stream
        assert attrs[spans.PREFILL_INSTANCE] == cluster.prefill[0].url
        assert attrs[spans.DECODE_INSTANCE] == cluster.decode[0].url
        assert attrs[spans.PROMPT_TOKENS] == len(p.body["prompt"].split())
        assert attrs[spans.OUTPUT_TOKENS] == 3 and attrs[spans.HTTP_STATUS] == 200
        assert attrs[spans.TTFT_MS] > 0 and attrs[spans.BASE_REQUEST_ID] == rid
        assert span.status.status_code != StatusCode.ERROR
        if mode == "push":
            kv = d.body[KV_TRANSFER_PARAMS]
            assert kv[DO_REMOTE_PREFILL] is True
            assert kv[REMOTE_ENGINE_ID] == cluster.prefill[0].engine_id
            assert kv[REMOTE_PORT] == cluster.prefill[0].kv_port
            assert kv[REMOTE_HOST] == "127.0.0.1"
            assert (kv[TP_SIZE], kv[PP_SIZE]) == (1, 1)
            assert kv[REMOTE_REQUEST_ID] == rid
        else:  # pull and bidirectional: the decode gets exactly what the prefill returned
            assert _plain(d.body[KV_TRANSFER_PARAMS]) == p.returned_kv_params
    if mode == "bidirectional" and not stream:
        # Turn 2's prefill carries what the decode returned at the end of turn 1.
        assert _plain(prefill[1].body[KV_TRANSFER_PARAMS]) == {
            **decode[0].returned_kv_params, DO_REMOTE_DECODE: True}
        assert prefill[1].pulled_tokens > 0
        assert request_spans[1].attributes[spans.REUSE_REMOTE_TOKENS] == \
            decode[0].returned_kv_params[REMOTE_NUM_TOKENS]
    else:
        # vLLM returns no kv_transfer_params in a stream: nothing to carry into turn 2.
        assert REMOTE_BLOCK_IDS not in prefill[1].body[KV_TRANSFER_PARAMS]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_completions(stream, tmp_path):
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db")) as router:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi there"}],
                "max_tokens": 4, "stream": stream,
                "stream_options": {"include_usage": True}}
        if not stream:
            body.pop("stream_options")
        answer = post(router.url + "/v1/chat/completions", body)
        p = cluster.requests("prefill")[0]
    assert answer.status == 200, answer.body
    assert answer.text() == "w0 w1 w2 w3"
    assert p.path == "/v1/chat/completions"
    assert p.body["max_tokens"] == 1 and p.body["max_completion_tokens"] == 1
    assert "stream_options" not in p.body


def test_conversation_header_counts_turns(tmp_path):
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db")) as router:
        for _ in range(3):
            assert post(router.url + "/v1/completions", _completion("a b c"),
                        headers={spans.CONVERSATION_HEADER: "hdr-conv"}).status == 200
        assert post(router.url + "/v1/completions", _completion("a b c")).status == 200
        turns = [r.body[KV_TRANSFER_PARAMS].get(spans.KV_PARAMS_TURN)
                 for r in cluster.requests("prefill")]
        convs = [r.body[KV_TRANSFER_PARAMS].get(spans.KV_PARAMS_CONVERSATION_ID)
                 for r in cluster.requests("prefill")]
    assert turns == [1, 2, 3, None]
    assert convs == ["hdr-conv"] * 3 + [None]


def test_restart_after_sigkill_keeps_decode_params(tmp_path):
    with StandInVllmCluster(1, 1, bidirectional=True) as cluster:
        config = cluster.router_config("bidirectional", state=f"sqlite:{tmp_path}/state.db")
        first = RouterProcess(config, workdir=tmp_path / "r1")
        first.start()
        try:
            assert post(first.url + "/v1/completions", _completion("one two three", conv="c")).status == 200
        finally:
            first.kill()  # SIGKILL: no shutdown, no flush
        assert first.proc is not None and first.proc.returncode == -9
        with RouterProcess(config, workdir=tmp_path / "r2") as second:
            answer = post(second.url + "/v1/completions",
                          _completion("one two three w0 w1 w2 four", conv="c"))
        turn1_decode = cluster.requests("decode")[0]
        turn2_prefill = cluster.requests("prefill")[1]
    assert answer.status == 200, answer.body
    sent = turn2_prefill.body[KV_TRANSFER_PARAMS]
    assert _plain(sent) == {**turn1_decode.returned_kv_params, DO_REMOTE_DECODE: True}
    assert sent[spans.KV_PARAMS_TURN] == 2
    assert turn2_prefill.pulled_tokens == len("one two three w0 w1 w2".split())


def test_expired_params_are_not_sent(tmp_path):
    # Params live decoder_ttl_s - margin_s = 1 s.
    with StandInVllmCluster(1, 1, bidirectional=True) as cluster, \
            RouterInThread(cluster.router_config("bidirectional", state=f"sqlite:{tmp_path}/s.db",
                                                 decoder_ttl_s=1.5, margin_s=0.5)) as router:
        url = router.url + "/v1/completions"
        assert post(url, _completion("a b c", conv="x")).status == 200
        time.sleep(1.6)  # past the router's TTL (measured from when turn 1's params were stored)
        assert post(url, _completion("a b c w0 w1 w2 d e f", conv="x")).status == 200
        # Control: a turn right after the previous one does carry its params.
        assert post(url, _completion("a b c w0 w1 w2 d e f w0 w1 w2 g h", conv="x")).status == 200
        prefill, decode = cluster.requests("prefill"), cluster.requests("decode")
    assert REMOTE_BLOCK_IDS not in prefill[1].body[KV_TRANSFER_PARAMS]
    assert prefill[1].body[KV_TRANSFER_PARAMS][spans.KV_PARAMS_TURN] == 2
    # If the control turn ran slower than 1 s on a loaded machine its params expired too;
    # only assert the positive case when they could still be valid.
    if REMOTE_BLOCK_IDS in prefill[2].body[KV_TRANSFER_PARAMS]:
        assert _plain(prefill[2].body[KV_TRANSFER_PARAMS]) == {
            **decode[1].returned_kv_params, DO_REMOTE_DECODE: True}


def test_concurrent_conversations_keep_their_own_state(tmp_path, tracer, exporter):
    n_conv, n_turns = 12, 4
    with StandInVllmCluster(2, 2, bidirectional=True) as cluster, \
            RouterInThread(cluster.router_config("bidirectional", state=f"sqlite:{tmp_path}/s.db"),
                           tracer=tracer) as router:
        url = router.url + "/v1/completions"

        def conversation(i: int) -> list[int]:
            statuses, history = [], f"conv{i}"
            for t in range(1, n_turns + 1):
                history += f" t{t}"
                a = post(url, _completion(history, conv=f"conv-{i}"), timeout_s=60)
                statuses.append(a.status)
                history += a.text()
            return statuses

        with ThreadPoolExecutor(n_conv) as pool:
            results = list(pool.map(conversation, range(n_conv)))
        prefill, decode = cluster.requests("prefill"), cluster.requests("decode")
    assert all(s == 200 for r in results for s in r), results
    assert len(prefill) == len(decode) == n_conv * n_turns
    # What each decode returned, by (conversation, turn).
    returned = {}
    for d in decode:
        kv = d.body[KV_TRANSFER_PARAMS]
        returned[(kv[spans.KV_PARAMS_CONVERSATION_ID], kv[spans.KV_PARAMS_TURN])] = d.returned_kv_params
    assert len(returned) == n_conv * n_turns
    for p in prefill:
        kv = p.body[KV_TRANSFER_PARAMS]
        conv, turn = kv[spans.KV_PARAMS_CONVERSATION_ID], kv[spans.KV_PARAMS_TURN]
        assert p.body["prompt"].startswith(conv.replace("-", "") + " ")  # turn label on its own prompt
        assert p.body["prompt"].endswith(f"t{turn}")
        if turn == 1:
            assert REMOTE_BLOCK_IDS not in kv
        else:  # no lost state, no crossed state: the previous turn of the same conversation
            assert _plain(kv) == {**returned[(conv, turn - 1)], DO_REMOTE_DECODE: True}
            assert p.pulled_tokens > 0
    # Both instances of each role were used, and every request has its root span.
    assert {d.server for d in decode} == {s.name for s in cluster.decode}
    assert {p.server for p in prefill} == {s.name for s in cluster.prefill}
    assert len(_request_spans(exporter)) == n_conv * n_turns


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there now


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_dead_upstream_gives_502_naming_the_leg(leg, mode, tmp_path, tracer, exporter):
    from kvtune.router.config import InstanceConfig
    with StandInVllmCluster(1, 1, bidirectional=mode == "bidirectional") as cluster:
        config = cluster.router_config(mode, state=f"sqlite:{tmp_path}/s.db", connect_timeout_s=5)
        dead = _dead_url()
        if leg == "prefill":
            config = config.replace(prefill=(InstanceConfig(dead, engine_id="p", kv_port=1),))
        else:
            config = config.replace(decode=(InstanceConfig(dead),))
        with RouterInThread(config, tracer=tracer) as router:
            for stream in (False, True):
                answer = post(router.url + "/v1/completions", _completion("a b", stream=stream))
                assert answer.status == 502, answer.body
                assert answer.headers[FAILED_LEG_HEADER] == leg
                assert answer.headers[FAILED_INSTANCE_HEADER] == dead
                err = answer.json()["error"]
                assert err["leg"] == leg and err["instance"] == dead and leg in err["message"]
    for span in _request_spans(exporter):
        assert span.status.status_code == StatusCode.ERROR
        assert span.attributes[spans.HTTP_STATUS] == 502


def test_upstream_errors_and_timeouts(tmp_path):
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db",
                                                 decode_timeout_s=1.0,
                                                 stream_idle_timeout_s=1.0)) as router:
        url = router.url + "/v1/completions"
        cluster.decode[0].fail_status = 500
        a = post(url, _completion("a b"))
        assert a.status == 502 and a.headers[FAILED_LEG_HEADER] == "decode"
        cluster.decode[0].fail_status = 400  # a client error upstream is passed through
        a = post(url, _completion("a b"))
        assert a.status == 400 and a.headers[FAILED_LEG_HEADER] == "decode"
        assert "failing on purpose" in a.json()["error"]["message"]
        cluster.decode[0].fail_status = None
        cluster.decode[0].delay_s = 10.0  # longer than the router's bounded wait
        for stream in (False, True):
            t0 = time.monotonic()
            a = post(url, _completion("a b", stream=stream), timeout_s=60)
            assert a.status == 502 and a.headers[FAILED_LEG_HEADER] == "decode", a.body
            assert time.monotonic() - t0 < 9.0  # the router gave up, not the stand-in finished
        cluster.decode[0].delay_s = 0.0
        assert post(url, _completion("a b")).status == 200  # still serving
        health = get(router.url + "/health").json()
    assert health["decode"][0]["in_flight"] == 0 and health["prefill"][0]["in_flight"] == 0
    assert health["decode"][0]["failures_total"] >= 4


def test_push_prefill_failure_cancels_decode(tmp_path):
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("push", state=f"sqlite:{tmp_path}/s.db")) as router:
        cluster.prefill[0].fail_status = 503
        for stream in (False, True):
            t0 = time.monotonic()
            a = post(router.url + "/v1/completions", _completion("a b", stream=stream), timeout_s=60)
            assert a.status == 502 and a.headers[FAILED_LEG_HEADER] == "prefill", a.body
            # The decode stand-in would wait 60 s for a push that never comes: it was cancelled.
            assert time.monotonic() - t0 < 30.0
        assert get(router.url + "/health").json()["decode"][0]["in_flight"] == 0


def test_request_size_limit_413(tmp_path):
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db",
                                                 max_body_bytes=4096)) as router:
        big = post(router.url + "/v1/completions", _completion("x " * 5000))
        small = post(router.url + "/v1/completions", _completion("x " * 100))
        n_prefill = len(cluster.requests("prefill"))
    assert big.status == 413 and big.json()["error"]["type"] == "request_too_large"
    assert small.status == 200
    assert n_prefill == 1  # the big one never reached an upstream


def test_bad_requests_400(tmp_path):
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db")) as router:
        assert post(router.url + "/v1/completions", b"{not json").status == 400
        assert post(router.url + "/v1/completions", b"[1, 2]").status == 400
        assert post(router.url + "/v1/completions",
                    {"prompt": "a", "conversation_id": {"x": 1}}).status == 400


def test_models_and_health(tmp_path):
    with StandInVllmCluster(1, 2) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db")) as router:
        models = get(router.url + "/v1/models")
        health = get(router.url + "/health")
    assert models.status == 200 and models.json()["data"][0]["id"] == "standin-model"
    h = health.json()
    assert h["status"] == "ok" and h["mode"] == "pull"
    assert [d["url"] for d in h["decode"]] == [s.url for s in cluster.decode]


def test_binds_loopback_by_default(tmp_path):
    with StandInVllmCluster(1, 1) as cluster:
        config = cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db")
        assert config.host == "127.0.0.1"
        with RouterProcess(config, workdir=tmp_path / "r") as proc:
            assert proc.url.startswith("http://127.0.0.1:")
            assert get(proc.url + "/health").status == 200
        assert proc.proc is not None and proc.proc.returncode == 0  # SIGTERM: clean exit


def test_a_kvtune_folder_in_the_working_directory_does_not_shadow_the_router(tmp_path,
                                                                              monkeypatch):
    shadow = tmp_path / "cwd" / "kvtune"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise SystemExit('shadowed kvtune imported')\n")
    monkeypatch.chdir(shadow.parent)
    with StandInVllmCluster(1, 1) as cluster:
        config = cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db")
        with RouterProcess(config, workdir=tmp_path / "r") as proc:
            assert get(proc.url + "/health").status == 200


def test_router_process_writes_spans_with_telemetry(tmp_path):
    """The CLI path sets up kvtune.telemetry: KVTUNE_SPANS_DIR receives kv.request spans."""
    from kvtune.traces import load
    spans_dir = tmp_path / "spans"
    with StandInVllmCluster(1, 1) as cluster:
        config = cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db")
        with RouterProcess(config, workdir=tmp_path / "r",
                           env={"KVTUNE_SPANS_DIR": str(spans_dir)}) as proc:
            rid = f"req-{uuid.uuid4().hex[:8]}"
            answer = post(proc.url + "/v1/completions", _completion("a b c", conv="tele"),
                          headers={"X-Request-Id": rid})
            assert answer.status == 200
        tp = cluster.requests("decode")[0].headers["traceparent"]
        upstream_id = cluster.requests("decode")[0].headers["X-Request-Id"]
    df = load(str(spans_dir))
    rows = df[df["name"] == spans.SpanName.REQUEST.value]
    assert len(rows) == 1
    row = rows.iloc[0]
    assert row["service"] == spans.service_name(spans.Role.ROUTER)
    # The legs carry the router's own id; the client's is echoed and kept as an attribute.
    assert answer.headers["X-Request-Id"] == rid
    assert row[spans.BASE_REQUEST_ID] == upstream_id != rid
    assert row["attrs"][spans.CLIENT_REQUEST_ID] == rid and row[spans.CONVERSATION_ID] == "tele"
    assert tp.split("-")[1] == row["trace_id"]


def test_load_aware_choice_prefers_idle_instances():
    from kvtune.router.config import InstanceConfig
    from kvtune.router.pool import InstancePool
    pool = InstancePool("decode", [InstanceConfig(f"http://127.0.0.1:{p}") for p in (1, 2, 3)])
    with pool.lease(0), pool.lease(0), pool.lease(2):
        assert pool.choose() == 1
        with pool.lease(1), pool.lease(1):
            assert pool.choose() == 2
    # All idle: every instance gets its turn.
    assert {pool.choose() for _ in range(3)} == {0, 1, 2}
    assert [s.in_flight for s in pool.snapshot()] == [0, 0, 0]
    assert [s.requests_total for s in pool.snapshot()] == [2, 2, 1]


def test_stand_in_refuses_protocol_mistakes():
    """The stand-ins check the protocol (so the router tests above can fail)."""
    with StandInVllmCluster(1, 1, bidirectional=True) as cluster:
        p, d = cluster.prefill[0].url, cluster.decode[0].url
        assert post(p + "/v1/completions", _completion("a")).status == 400  # no kv params
        assert post(d + "/v1/completions", {**_completion("a"), KV_TRANSFER_PARAMS: {
            DO_REMOTE_PREFILL: True, REMOTE_BLOCK_IDS: [[999]],
            REMOTE_REQUEST_ID: "nope"}}).status == 400  # blocks never issued
        ok = post(p + "/v1/completions", {**_completion("a", max_tokens=1),
                                         KV_TRANSFER_PARAMS: {DO_REMOTE_DECODE: True}})
        params = ok.json()[KV_TRANSFER_PARAMS]
        assert post(d + "/v1/completions", {**_completion("a"), KV_TRANSFER_PARAMS: params}).status == 200
        # Read once: a second decode with the same blocks is refused.
        assert post(d + "/v1/completions", {**_completion("a"), KV_TRANSFER_PARAMS: params}).status == 400


def test_client_disconnect_releases_upstream(tmp_path):
    with StandInVllmCluster(1, 1) as cluster, \
            RouterInThread(cluster.router_config("pull", state=f"sqlite:{tmp_path}/s.db")) as router:
        cluster.decode[0].delay_s = 60.0
        with pytest.raises(OSError):  # the client gives up after 1 s
            post(router.url + "/v1/completions", _completion("a b"), timeout_s=1.0)
        deadline = time.monotonic() + 20.0  # far less than the decode's 60 s
        while time.monotonic() < deadline:
            if get(router.url + "/health").json()["decode"][0]["in_flight"] == 0:
                break
            time.sleep(0.1)
        assert get(router.url + "/health").json()["decode"][0]["in_flight"] == 0
        cluster.decode[0].delay_s = 0.0
