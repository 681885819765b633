"""Streamed bidirectional turns (issue 17): the router takes ``kv_transfer_params`` from the SSE
chunk that carries them (vLLM 0.33: the stream's last chunk), relays every byte unchanged, and
carries the history into the next turn; with vLLM 0.32's SSE (none in the stream) it says so once
per conversation, in a span event and in ``/health``. Through stand-ins speaking each format."""
from __future__ import annotations

import json

import pytest

from kvtune import spans
from kvtune.router import RouterInThread
from kvtune.router.client import get, parse_sse, post
from kvtune.router.server import UPSTREAM_REQUEST_ID_HEADER
from kvtune.testing.standin import StandInVllmCluster
from kvtune.vllm_pd import (CONTEXT_KEYS, DO_REMOTE_DECODE, KV_TRANSFER_PARAMS, REMOTE_BLOCK_IDS,
                             REMOTE_NUM_TOKENS)

pytestmark = pytest.mark.timeout(180)

TURNS = 4


def _plain(params):
    return {k: v for k, v in params.items() if k not in CONTEXT_KEYS}


def _turn_body(endpoint: str, history: str | list, conv: str) -> dict:
    body = {"model": "m", "max_tokens": 3, "stream": True, "conversation_id": conv,
            "stream_options": {"include_usage": True}}
    if endpoint == "/v1/chat/completions":
        body["messages"] = list(history)
    else:
        body["prompt"] = history
    return body


def _conversation(url: str, endpoint: str, conv: str, turns: int = TURNS):
    """Each turn continues the last: its prompt (or messages), the answer, a new part."""
    chat = endpoint == "/v1/chat/completions"
    answers: list = []
    history: str | list = [] if chat else f"{conv} start"
    for t in range(1, turns + 1):
        if chat:
            history = [*history, {"role": "user", "content": f"{conv} t{t}"}]
        else:
            history += f" t{t}"
        a = post(url + endpoint, _turn_body(endpoint, history, conv), timeout_s=60)
        answers.append(a)
        if chat:
            history = [*history, {"role": "assistant", "content": a.text()}]
        else:
            history += a.text()
    return answers


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_bidirectional_conversation_carries_history_with_033_sse(
        endpoint, tmp_path, tracer, exporter):
    with StandInVllmCluster(1, 1, bidirectional=True, sse_format="0.33") as cluster, \
            RouterInThread(cluster.router_config("bidirectional", state=f"sqlite:{tmp_path}/s.db"),
                           tracer=tracer) as router:
        answers = _conversation(router.url, endpoint, "agent-1")
        health = get(router.url + "/health").json()
        prefill, decode = cluster.requests("prefill"), cluster.requests("decode")
        sent = dict(cluster.decode[0].sent_streams)
    assert [a.status for a in answers] == [200] * TURNS, [a.body for a in answers]
    assert len(prefill) == len(decode) == TURNS
    # The client gets exactly the bytes the decode sent, the kv_transfer_params chunk included.
    for a in answers:
        assert a.body == sent[a.headers[UPSTREAM_REQUEST_ID_HEADER]]
        events = parse_sse(a.body)
        finals = [e for e in events if e.get(KV_TRANSFER_PARAMS)]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    # Turn 1 has no history; turns 2-4 hold the previous turn's decode params.
    assert REMOTE_BLOCK_IDS not in prefill[0].body[KV_TRANSFER_PARAMS]
    for t in range(1, TURNS):
        assert _plain(prefill[t].body[KV_TRANSFER_PARAMS]) == {
            **decode[t - 1].returned_kv_params, DO_REMOTE_DECODE: True}
        assert prefill[t].pulled_tokens > 0
        assert prefill[t].status == 200
    assert health["streamed_bidirectional"] == {"turns_with_kv_transfer_params": TURNS,
                                                "turns_without_kv_transfer_params": 0}
    request_spans = [s for s in exporter.get_finished_spans()
                     if s.name == spans.SpanName.REQUEST.value]
    assert not [e for s in request_spans for e in s.events
                if e.name == spans.EventName.STREAM_PARAMS_ABSENT.value]
    assert sorted(s.attributes.get(spans.REUSE_REMOTE_TOKENS) or 0 for s in request_spans)[1:] == \
        sorted(d.returned_kv_params[REMOTE_NUM_TOKENS] for d in decode[:-1])


def test_streamed_turns_without_params_are_reported_once_per_conversation(tmp_path, tracer,
                                                                          exporter):
    """vLLM 0.32's SSE: nothing to carry; the router says so once per conversation."""
    with StandInVllmCluster(1, 1, bidirectional=True, sse_format="0.32") as cluster, \
            RouterInThread(cluster.router_config("bidirectional", state=f"sqlite:{tmp_path}/s.db"),
                           tracer=tracer) as router:
        a1 = _conversation(router.url, "/v1/completions", "conv-a", turns=3)
        a2 = _conversation(router.url, "/v1/completions", "conv-b", turns=2)
        health = get(router.url + "/health").json()
        prefill = cluster.requests("prefill")
        sent = dict(cluster.decode[0].sent_streams)
    assert all(a.status == 200 for a in a1 + a2)
    for a in a1 + a2:  # relayed unchanged here too
        assert a.body == sent[a.headers[UPSTREAM_REQUEST_ID_HEADER]]
    assert all(REMOTE_BLOCK_IDS not in p.body[KV_TRANSFER_PARAMS] for p in prefill)
    streams = health["streamed_bidirectional"]
    assert streams["turns_with_kv_transfer_params"] == 0
    assert streams["turns_without_kv_transfer_params"] == 5
    assert "0.33" in streams["note"]
    events = [(s.attributes[spans.CONVERSATION_ID], e) for s in exporter.get_finished_spans()
              for e in s.events if e.name == spans.EventName.STREAM_PARAMS_ABSENT.value]
    assert sorted(c for c, _ in events) == ["conv-a", "conv-b"]
    assert all(e.attributes[spans.DECODE_INSTANCE] == cluster.decode[0].url for _, e in events)


def test_non_streamed_turns_are_not_counted_as_streams(tmp_path):
    with StandInVllmCluster(1, 1, bidirectional=True, sse_format="0.32") as cluster, \
            RouterInThread(cluster.router_config("bidirectional",
                                                 state=f"sqlite:{tmp_path}/s.db")) as router:
        body = {"model": "m", "prompt": "a b", "max_tokens": 2, "conversation_id": "j"}
        assert post(router.url + "/v1/completions", body).status == 200
        assert post(router.url + "/v1/completions", {**body, "prompt": "a b w0 w1 c"}).status == 200
        health = get(router.url + "/health").json()
        prefill = cluster.requests("prefill")
    assert REMOTE_BLOCK_IDS in prefill[1].body[KV_TRANSFER_PARAMS]
    assert health["streamed_bidirectional"] == {"turns_with_kv_transfer_params": 0,
                                                "turns_without_kv_transfer_params": 0}


def test_sse_watcher_bounds_its_buffer_and_finds_params_after_a_huge_line():
    from kvtune.router.server import SSE_MAX_LINE_BYTES, _SseWatcher
    w = _SseWatcher()
    huge = b"data: " + b"x" * (SSE_MAX_LINE_BYTES + 10)
    for i in range(0, len(huge), 1 << 20):  # 1 MiB chunks, no newline for over 16 MiB
        w.feed(huge[i:i + (1 << 20)])
        assert len(w._buf) <= SSE_MAX_LINE_BYTES + (1 << 20)
    event = {"choices": [{"text": "t"}], KV_TRANSFER_PARAMS: {REMOTE_BLOCK_IDS: [[1]]}}
    final = b"\n\ndata: " + json.dumps(event).encode() + b"\n"
    for byte in final:  # and split anywhere
        w.feed(bytes([byte]))
    assert w.kv_transfer_params == {REMOTE_BLOCK_IDS: [[1]]}
    assert w.content_events == 1
