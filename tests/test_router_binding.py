"""A conversation's held KV goes only to its own continuation (issue 29): the router binds the
decode's stored params to the history they encode and offers them only to a prompt that begins
with exactly that history; a tenant key scopes conversation ids. Through real HTTP on loopback,
against the stand-in vLLM servers (which check the P/D protocol and keep a ledger of blocks)."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_settings import PROPERTY
from kvtune import spans
from kvtune.errors import ConfigError
from kvtune.router import RouterInThread
from kvtune.router import binding
from kvtune.router.client import get, post
from kvtune.router.server import UPSTREAM_REQUEST_ID_HEADER
from kvtune.testing.standin import StandInVllmCluster
from kvtune.vllm_pd import KV_PARAMS_HISTORY, KV_TRANSFER_PARAMS, REMOTE_BLOCK_IDS

pytestmark = pytest.mark.timeout(900)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _offered(cluster, router_id: str):
    """The block ids the prefill leg of request ``router_id`` was offered (None: none)."""
    (p,) = [r for r in cluster.requests("prefill") if r.headers["X-Request-Id"] == router_id]
    blocks = p.body[KV_TRANSFER_PARAMS].get(REMOTE_BLOCK_IDS)
    assert KV_PARAMS_HISTORY not in p.body[KV_TRANSFER_PARAMS]  # the router's key never leaves
    return None if blocks is None else tuple(map(tuple, blocks))


def _returned(cluster, router_id: str):
    (d,) = [r for r in cluster.requests("decode") if r.headers["X-Request-Id"] == router_id]
    return tuple(map(tuple, d.returned_kv_params[REMOTE_BLOCK_IDS]))


def _refusals(exporter):
    return [e for s in exporter.get_finished_spans() for e in s.events
            if e.name == spans.EventName.REUSE_REFUSED.value]


# --- the property -----------------------------------------------------------------------------
words = st.lists(st.sampled_from(["a", "b", "w0", "w1", "x", "é", "日本", "\u00a0", ""]),
                 min_size=1, max_size=4).map(" ".join)
steps = st.lists(st.tuples(st.sampled_from([0, 1]),
                           st.sampled_from(["continue", "trim", "edit", "restart"]), words,
                           st.booleans()),
                 min_size=1, max_size=6)


def test_property_no_request_is_offered_another_historys_blocks():
    """Two parties name the same conversation id, each with its own history (they differ from
    the first word), interleaving turns that continue, trim, edit or restart their history, in
    JSON or SSE, completions or chat. Every block set offered to a prefill was produced by the
    same party, by a turn whose prompt and answer are exactly the start of the offered prompt;
    a turn that continues the held history is offered exactly its blocks, even after another
    party's (refused) turns in between (no denial of reuse); and a plain continuation is offered
    its blocks (the property is not vacuous)."""
    offered_total = itertools.count()
    conv_ids = itertools.count()
    with StandInVllmCluster(1, 1, bidirectional=True, sse_format="0.33") as cluster, \
            RouterInThread(cluster.router_config("bidirectional", state=":memory:")) as router:

        @PROPERTY
        @given(chat=st.booleans(), steps=steps)
        def run(chat, steps):
            conv = f"shared-{next(conv_ids)}"
            endpoint = CHAT if chat else COMPLETIONS
            # Each party's history: a prompt string, or a list of chat messages.
            histories: list = [[] if chat else f"party{p}" for p in (0, 1)]
            produced: dict[tuple, tuple[int, object]] = {}  # blocks -> (party, history after)
            stored: tuple | None = None  # the blocks the router holds for the id, by the model
            for party, action, new, stream in steps:
                history = histories[party]
                if action == "trim" and chat:
                    history = history[:-1]  # drops the assistant's answer
                elif action == "trim":
                    history = history[:max(len(f"party{party}"), len(history) - 3)]
                elif action == "edit" and chat and history:
                    history = [{**history[0], "content": history[0]["content"] + "!"}, *history[1:]]
                elif action == "edit" and not chat:
                    history = f"party{party}!" + history[len(f"party{party}"):]
                elif action == "restart":
                    history = [] if chat else f"party{party}"
                if chat:
                    prompt: object = [*history, {"role": "user", "content": f"party{party} {new}"}]
                    body = {"model": "m", "messages": prompt, "max_tokens": 2}
                else:
                    prompt = f"{history} {new}"
                    body = {"model": "m", "prompt": prompt, "max_tokens": 2}
                answer = post(router.url + endpoint, {**body, "stream": stream,
                                                      "conversation_id": conv}, timeout_s=60)
                assert answer.status == 200, answer.body
                rid = answer.headers[UPSTREAM_REQUEST_ID_HEADER]
                offered = _offered(cluster, rid)
                if offered is not None:
                    next(offered_total)
                    owner, held = produced[offered]
                    assert owner == party, "offered another party's blocks"
                    if chat:
                        assert prompt[:len(held)] == held
                    else:
                        assert prompt.startswith(held)
                # The owner's continuation is offered its blocks, whatever turns came between
                # (a refused turn leaves them stored); any other prompt is offered nothing.
                held = produced[stored][1] if stored is not None else None
                continues = held is not None and (prompt[:len(held)] == held if chat
                                                  else prompt.startswith(held))
                assert offered == (stored if continues else None), (offered, stored, continues)
                text = answer.text()
                after = [*prompt, {"role": "assistant", "content": text}] if chat else prompt + text
                produced[_returned(cluster, rid)] = (party, after)
                if stored is None or continues:
                    stored = _returned(cluster, rid)
                histories[party] = after

        run()
    assert next(offered_total) > 0


# --- examples ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_another_clients_turn_and_an_edited_history_get_no_blocks(stream, tmp_path, tracer,
                                                                  exporter):
    """Before: a second client naming the victim's conversation id with an unrelated prompt had
    the victim's decode blocks offered to its prefill (issue 29)."""
    with StandInVllmCluster(1, 1, bidirectional=True, sse_format="0.33") as cluster, \
            RouterInThread(cluster.router_config("bidirectional", state=f"sqlite:{tmp_path}/s.db"),
                           tracer=tracer) as router:
        url = router.url + COMPLETIONS

        def turn(prompt: str) -> tuple[str, str]:
            a = post(url, {"model": "m", "prompt": prompt, "max_tokens": 2, "stream": stream,
                           "conversation_id": "victim"})
            assert a.status == 200, a.body
            return a.headers[UPSTREAM_REQUEST_ID_HEADER], prompt + a.text()

        first, history = turn("secret plan")
        attacker, _ = turn("tell me everything")
        # Before: the attacker's turn consumed the victim's params and stored its own, so the
        # victim's continuation recomputed (denial of reuse). Now they are left for the victim.
        after_attacker, history = turn(history + " next")
        own, _ = turn(history + " and then")  # a plain continuation: offered
        edited, _ = turn(history.replace("secret", "public") + " more")
        health = get(router.url + "/health").json()
        assert _offered(cluster, attacker) is None
        assert _offered(cluster, after_attacker) == _returned(cluster, first)
        assert _offered(cluster, own) == _returned(cluster, after_attacker)
        assert _offered(cluster, edited) is None
    assert health["reuse_refused_total"][spans.ReuseRefusal.HISTORY_DIFFERS.value] == 2
    reasons = [e.attributes[spans.REUSE_REFUSED_REASON] for e in _refusals(exporter)]
    assert reasons == [spans.ReuseRefusal.HISTORY_DIFFERS.value] * 2
    assert all("left stored" in e.attributes[spans.REUSE_REFUSED_DETAIL]
               for e in _refusals(exporter))
    assert all(e.attributes[spans.REUSE_REMOTE_TOKENS] > 0 for e in _refusals(exporter))


def test_chat_history_with_its_reasoning_stripped_is_not_offered_the_blocks():
    """vLLM issue #43094: the held KV encodes the reasoning; a history without it must not get it."""
    body = {"messages": [{"role": "user", "content": "q"}]}
    reply = binding.Reply.from_answer({"choices": [{"message": {
        "role": "assistant", "content": "42", "reasoning_content": "think think",
        "tool_calls": [], "refusal": None}}]})
    history, why = binding.history_of(body, True, reply)
    assert history is not None, why
    kept = {"role": "assistant", "content": "42", "reasoning_content": "think think"}
    stored = binding.bind({REMOTE_BLOCK_IDS: [[1]]}, history)
    follow = {"messages": [*body["messages"], kept, {"role": "user", "content": "more"}]}
    assert binding.offer(stored, follow, True).params == {REMOTE_BLOCK_IDS: [[1]]}
    stripped = {"messages": [*body["messages"], {"role": "assistant", "content": "42"},
                             {"role": "user", "content": "more"}]}
    refused = binding.offer(stored, stripped, True)
    assert refused.params is None and refused.refusal == spans.ReuseRefusal.HISTORY_DIFFERS


def test_token_prompts_bind_to_returned_token_ids_or_keep_nothing():
    body = {"prompt": [5, 6, 7]}
    with_ids = binding.Reply.from_answer({"choices": [{"text": " x", "token_ids": [9]}]})
    history, _ = binding.history_of(body, False, with_ids)
    assert history is not None and history.length == 4
    stored = binding.bind({REMOTE_BLOCK_IDS: [[1]]}, history)
    assert binding.offer(stored, {"prompt": [5, 6, 7, 9, 1]}, False).params is not None
    assert binding.offer(stored, {"prompt": [5, 6, 7, 8, 1]}, False).params is None
    assert binding.offer(stored, {"prompt": "5 6 7 9 1"}, False).params is None
    without, why = binding.history_of(body, False, binding.Reply.from_answer(
        {"choices": [{"text": " x"}]}))
    assert without is None and "return_token_ids" in why
    several, why = binding.history_of({"prompt": "p", "n": 2}, False, with_ids)
    assert several is None and "several" in why
    unbound = binding.offer({REMOTE_BLOCK_IDS: [[1]]}, {"prompt": "p"}, False)
    assert unbound.params is None and unbound.refusal == spans.ReuseRefusal.UNBOUND


def test_a_tenant_cannot_name_another_tenants_conversation(tmp_path, tracer, exporter):
    with StandInVllmCluster(1, 1, bidirectional=True) as cluster, \
            RouterInThread(cluster.router_config("bidirectional", state=f"sqlite:{tmp_path}/s.db",
                                                 tenant_header="X-Tenant"),
                           tracer=tracer) as router:
        url = router.url + COMPLETIONS

        def turn(tenant: str | None, prompt: str):
            headers = {"X-Tenant": tenant} if tenant else {}
            return post(url, {"model": "m", "prompt": prompt, "max_tokens": 2,
                              "conversation_id": "c1"}, headers=headers)

        first = turn("tenant-a", "hello")
        # Tenant b sends exactly tenant a's continuation under the same id: a new conversation.
        other = turn("tenant-b", "hello" + first.text() + " again")
        own = turn("tenant-a", "hello" + first.text() + " again")
        missing = turn(None, "hello")
        assert _offered(cluster, other.headers[UPSTREAM_REQUEST_ID_HEADER]) is None
        assert _offered(cluster, own.headers[UPSTREAM_REQUEST_ID_HEADER]) is not None
    assert missing.status == 400 and "X-Tenant" in missing.json()["error"]["message"]
    turns = sorted(s.attributes.get(spans.TURN) for s in exporter.get_finished_spans()
                   if s.name == spans.SpanName.REQUEST.value and spans.TURN in s.attributes)
    assert turns == [1, 1, 2]  # tenant b's turn was its own first


def test_tenant_header_must_be_a_header_name():
    with StandInVllmCluster(1, 1) as cluster:
        with pytest.raises(ConfigError, match="tenant_header"):
            cluster.router_config("bidirectional", tenant_header="X Tenant\r\n")


def test_tenant_keys_scope_store_keys():
    assert binding.store_key("c", None) == "c"
    a, b = binding.store_key("c", "t1"), binding.store_key("c", "t2")
    assert a != b and a != "c" and binding.store_key("c", "t1") == a
    # length-prefixed: ("t1", "1c") and ("t11", "c") are different keys
    assert binding.store_key("1c", "t1") != binding.store_key("c", "t11")
