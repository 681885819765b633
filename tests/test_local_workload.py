"""The multi-turn workload: deterministic generation, and the driver against a real loopback HTTP
server standing in for vLLM or the router (growing history with real outputs, headers, failures).
"""
from __future__ import annotations

import json
from dataclasses import replace
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtune.errors import ConfigError
from kvtune.local.workload import (
    FIRST_PLAIN_TOKEN_ID, HttpTarget, WorkloadConfig, generate, run_workload,
)
from kvtune.spans import CONVERSATION_HEADER

SMALL = WorkloadConfig(n_conversations=4, turns=(2, 3), system_prompt_tokens=16,
                       first_user_tokens=(8, 20), follow_up_tokens=(4, 10),
                       output_tokens=(2, 5), think_time_s=(0.0, 0.01), arrival_rate_per_s=50.0,
                       seed=7)


def test_generation_is_deterministic_and_within_ranges():
    plans = generate(SMALL)
    assert plans == generate(SMALL)
    assert plans != generate(replace(SMALL, seed=8))
    assert len(plans) == SMALL.n_conversations
    assert len({p.conversation_id for p in plans}) == len(plans)
    assert [p.start_s for p in plans] == sorted(p.start_s for p in plans)
    assert plans[0].start_s == 0.0
    assert len({p.system_tokens for p in plans}) == 1  # a shared system prompt
    for p in plans:
        assert 2 <= len(p.turns) <= 3
        assert [t.turn for t in p.turns] == list(range(1, len(p.turns) + 1))
        assert p.turns[0].think_time_s == 0.0
        assert 8 <= len(p.turns[0].user_tokens) <= 20
        for t in p.turns[1:]:
            assert 4 <= len(t.user_tokens) <= 10 and 0.0 <= t.think_time_s <= 0.01
        for t in p.turns:
            assert 2 <= t.max_tokens <= 5
            assert all(FIRST_PLAIN_TOKEN_ID <= x < SMALL.vocab_size for x in t.user_tokens)


@pytest.mark.parametrize("field, value", [
    ("n_conversations", 0), ("turns", (3, 2)), ("first_user_tokens", (0, 4)),
    ("think_time_s", (-1.0, 1.0)), ("arrival_rate_per_s", 0.0), ("system_prompt_tokens", -1),
])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        generate(replace(SMALL, **{field: value}))


def _output_for(prompt, n):
    return [FIRST_PLAIN_TOKEN_ID + (sum(prompt) + i) % 1000 for i in range(n)]


class StandInCompletions(BaseHTTPRequestHandler):
    """Deterministic output from the prompt; fails every request of conversation ``fail_conv``."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        conv = self.headers.get(CONVERSATION_HEADER)
        with self.server.lock:
            self.server.seen.append((conv, self.headers.get("X-Request-Id"), body))
        if conv == self.server.fail_conv:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"engine dead")
            return
        out = _output_for(body["prompt"], body["max_tokens"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for t in out:
            self.wfile.write(f'data: {json.dumps({"choices": [{"text": "x", "token_ids": [t]}]})}'
                             f"\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture()
def standin():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StandInCompletions)
    httpd.seen, httpd.lock, httpd.fail_conv = [], threading.Lock(), None
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_driver_sends_growing_history_with_real_outputs(standin):
    plans = generate(SMALL)
    url = f"http://127.0.0.1:{standin.server_address[1]}"
    results = run_workload(plans, HttpTarget(url), time_scale=0.0, progress=False)

    assert len(results) == sum(len(p.turns) for p in plans)
    assert all(r.ok for r in results)
    assert len({r.request_id for r in results}) == len(results)
    assert [r.sent_s for r in results] == sorted(r.sent_s for r in results)
    sent = {rid: (conv, body) for conv, rid, body in standin.seen}
    for plan in plans:
        mine = sorted((r for r in results if r.conversation_id == plan.conversation_id),
                      key=lambda r: r.turn)
        assert [r.turn for r in mine] == [t.turn for t in plan.turns]
        history = list(plan.system_tokens)
        for r, tp in zip(mine, plan.turns):
            conv, body = sent[r.request_id]
            assert conv == plan.conversation_id
            assert body["prompt"] == history + list(tp.user_tokens)
            assert body["max_tokens"] == tp.max_tokens and body["temperature"] == 0.0
            assert r.output_token_ids == tuple(_output_for(body["prompt"], tp.max_tokens))
            assert r.prompt_tokens == len(body["prompt"]) and r.output_tokens == tp.max_tokens
            assert r.ttft_ms is not None and 0 < r.ttft_ms <= r.latency_ms
            history = body["prompt"] + list(r.output_token_ids)


def test_unlinked_conversations_send_each_turn_under_its_own_id(standin):
    import dataclasses

    plans = generate(SMALL)
    plans = [dataclasses.replace(plans[0], link_turns=False), *plans[1:]]
    url = f"http://127.0.0.1:{standin.server_address[1]}"
    results = run_workload(plans, HttpTarget(url), time_scale=0.0, progress=False)
    sent = {rid: conv for conv, rid, _ in standin.seen}
    for r in results:
        plan = next(p for p in plans if p.conversation_id == r.conversation_id)
        want = (plan.conversation_id if plan.link_turns
                else f"{plan.conversation_id}.t{r.turn}")
        assert sent[r.request_id] == want
    # the unlinked conversation still carries its history (only the router's link is cut)
    mine = sorted((r for r in results if r.conversation_id == plans[0].conversation_id),
                  key=lambda r: r.turn)
    assert len(mine) == len(plans[0].turns) >= 2 and mine[1].prompt_tokens > mine[0].prompt_tokens


def test_a_failed_request_ends_only_its_conversation(standin):
    plans = generate(SMALL)
    standin.fail_conv = plans[1].conversation_id
    url = f"http://127.0.0.1:{standin.server_address[1]}"
    results = run_workload(plans, HttpTarget(url), time_scale=0.0, progress=False)

    failed = [r for r in results if r.conversation_id == standin.fail_conv]
    assert len(failed) == 1 and failed[0].turn == 1 and not failed[0].ok
    assert "500" in failed[0].error and "engine dead" in failed[0].error
    others = [r for r in results if r.conversation_id != standin.fail_conv]
    assert all(r.ok for r in others)
    assert len(others) == sum(len(p.turns) for p in plans if p is not plans[1])


def test_driver_arguments_are_checked():
    with pytest.raises(ConfigError, match="time_scale"):
        run_workload(generate(SMALL), HttpTarget("http://127.0.0.1:1"), time_scale=-1)
    with pytest.raises(ConfigError, match="max_concurrency"):
        run_workload(generate(SMALL), HttpTarget("http://127.0.0.1:1"), max_concurrency=0)


def test_turn_major_sends_every_turn_k_before_any_turn_k_plus_one_batch_by_batch(standin):
    import dataclasses

    plans = generate(SMALL)
    plans = [dataclasses.replace(p, batch=0 if i < 2 else 1) for i, p in enumerate(plans)]
    standin.fail_conv = plans[0].conversation_id
    url = f"http://127.0.0.1:{standin.server_address[1]}"
    results = run_workload(plans, HttpTarget(url), turn_major=True, progress=False)
    order = [(r.conversation_id, r.turn) for r in sorted(results, key=lambda r: r.sent_s)]
    ids = [p.conversation_id for p in plans]
    batch0 = [(c, t) for c, t in order if c in ids[:2]]
    batch1 = [(c, t) for c, t in order if c in ids[2:]]
    # one batch after the other; inside each, turn by turn in the plans' order
    assert order == batch0 + batch1
    assert batch0 == [(ids[0], 1)] + [(ids[1], t.turn) for t in plans[1].turns]
    want = [(c, k) for k in range(1, 4) for c in ids[2:]
            if k <= len(plans[ids.index(c)].turns)]
    assert batch1 == want
    # the failed conversation (turn 1) ended; its history never went on
    assert [r.ok for r in results if r.conversation_id == ids[0]] == [False]
