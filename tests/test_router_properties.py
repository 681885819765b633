"""Property-based tests (hypothesis) of the router's request parsing and conversation stores.

Each property runs ``KVTUNE_FUZZ_EXAMPLES`` examples (500 in the normal test run; a fuzz run sets
more, e.g. ``KVTUNE_FUZZ_EXAMPLES=20000 pytest tests/test_router_properties.py``)."""
from __future__ import annotations

import itertools
import json
import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from kvtune import spans
from kvtune.router.parsing import (CONVERSATION_FIELD, MAX_CLIENT_REQUEST_ID_CHARS, MAX_JSON_DEPTH,
                                   REQUEST_ID_HEADER, RequestRejected, json_depth_exceeds,
                                   parse_request)
from kvtune.router.state import (MAX_CONVERSATION_ID_BYTES, InvalidConversationId,
                                 RedisConversationStore, SqliteConversationStore)
from kvtune.vllm_pd import REMOTE_BLOCK_IDS

pytestmark = pytest.mark.timeout(600)

EXAMPLES = int(os.environ.get("KVTUNE_FUZZ_EXAMPLES", "500"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Text as it reaches the router: any code point, lone surrogates included (JSON "\ud800" escapes,
# and non-UTF-8 header bytes, which aiohttp decodes as surrogates 0xDC80-0xDCFF).
any_text = st.lists(st.one_of(st.characters(), st.integers(0xd800, 0xdfff).map(chr)),
                    max_size=40).map("".join)
header_text = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=300),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x10ffff), max_size=30),
    st.lists(st.integers(0x80, 0xff), min_size=1, max_size=6).map(
        lambda bs: "id-" + "".join(chr(0xdc00 + b) for b in bs)))
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                         any_text)
json_values = st.recursive(json_scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(any_text, children, max_size=4)), max_leaves=30)
conversation_ids = st.one_of(
    any_text, st.integers(), st.booleans(), st.none(), st.floats(allow_nan=False),
    st.text(min_size=MAX_CONVERSATION_ID_BYTES - 2, max_size=MAX_CONVERSATION_ID_BYTES + 2),
    st.lists(any_text, max_size=2), st.dictionaries(any_text, any_text, max_size=2))


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _check_accepted(parsed, headers) -> None:
    """What every accepted request satisfies."""
    assert CONVERSATION_FIELD not in parsed.body
    assert isinstance(parsed.stream, bool)
    assert not json_depth_exceeds(parsed.body, MAX_JSON_DEPTH)
    json.dumps(parsed.body)  # can be forwarded
    if parsed.conversation_id is not None:
        assert isinstance(parsed.conversation_id, str) and parsed.conversation_id
        assert len(parsed.conversation_id.encode("utf-8")) <= MAX_CONVERSATION_ID_BYTES
    if parsed.client_request_id is not None:
        assert _encodable(parsed.client_request_id)
        assert len(parsed.client_request_id) <= MAX_CLIENT_REQUEST_ID_CHARS
    for name in (REQUEST_ID_HEADER, spans.CONVERSATION_HEADER, "Authorization"):
        if name in headers:
            assert _encodable(headers[name])


@PROPERTY
@given(raw=st.binary(max_size=300))
def test_any_bytes_are_parsed_or_rejected_with_400(raw):
    try:
        parsed = parse_request(raw, CIMultiDict())
    except RequestRejected as exc:
        assert exc.status == 400 and str(exc)
    else:
        _check_accepted(parsed, {})


@PROPERTY
@given(value=json_values)
def test_any_json_document_is_parsed_or_rejected_with_400(value):
    raw = json.dumps(value).encode()
    try:
        parsed = parse_request(raw, CIMultiDict())
    except RequestRejected as exc:
        assert exc.status == 400
        if isinstance(value, dict) and not json_depth_exceeds(value, MAX_JSON_DEPTH):
            conv, stream = value.get(CONVERSATION_FIELD), value.get("stream")
            assert conv is not None or stream is not None  # rejected only for a reason it holds
    else:
        assert isinstance(value, dict)
        _check_accepted(parsed, {})


@PROPERTY
@given(conv=conversation_ids, in_header=st.booleans(), request_id=st.none() | header_text,
       auth=st.none() | header_text, stream=st.sampled_from([None, True, False, "false", 0, 1]),
       depth=st.integers(0, MAX_JSON_DEPTH + 3))
@example(conv="\ud800\udc00", in_header=False, request_id=None, auth=None, stream=None, depth=0)
def test_completion_requests_field_by_field(conv, in_header, request_id, auth, stream, depth):
    nested: object = "leaf"
    for _ in range(depth):
        nested = [nested]
    body = {"model": "m", "prompt": "p", "max_tokens": 2, "extra": nested}
    if stream is not None:
        body["stream"] = stream
    headers = CIMultiDict()
    if conv is not None and in_header:
        if not isinstance(conv, str):
            conv = str(conv)
        headers[spans.CONVERSATION_HEADER] = conv
    elif conv is not None:
        body[CONVERSATION_FIELD] = conv
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
    if auth is not None:
        headers["Authorization"] = auth
    raw = json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \ud800 escapes
    if isinstance(conv, str) and not in_header:
        # what the router reads: JSON joins an escaped surrogate pair into one character
        # ('\ud800\udc00' arrives as U+10000, a valid id)
        conv = json.loads(json.dumps(conv))
    expect_ok = (
        depth + 1 <= MAX_JSON_DEPTH
        and (stream is None or isinstance(stream, bool))
        and (request_id is None or (_encodable(request_id)
                                    and len(request_id) <= MAX_CLIENT_REQUEST_ID_CHARS))
        and (auth is None or _encodable(auth))
        and (conv is None or (isinstance(conv, (str, int)) and not isinstance(conv, bool)
                              and str(conv) != "" and _encodable(str(conv))
                              and len(str(conv).encode("utf-8")) <= MAX_CONVERSATION_ID_BYTES)))
    try:
        parsed = parse_request(raw, headers, forwarded_headers=("Authorization",))
    except RequestRejected as exc:
        assert not expect_ok, f"rejected a valid request: {exc}"
        assert exc.status == 400
    else:
        assert expect_ok, "accepted an invalid request"
        _check_accepted(parsed, headers)
        assert parsed.conversation_id == (None if conv is None else str(conv))
        assert parsed.client_request_id == (request_id or None)


# --- conversation stores -------------------------------------------------------------------------
store_conv_ids = st.one_of(
    st.sampled_from(["a", "b", "é", "😀"]),
    st.text(min_size=1, max_size=12),
    st.sampled_from(["", "x\ud800", "y" * (MAX_CONVERSATION_ID_BYTES + 1)]))  # invalid ones
ops = st.lists(st.tuples(st.sampled_from(["begin", "store", "clear", "wait"]), store_conv_ids,
                         st.floats(0, 8)), max_size=25)
TTL_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _valid(conv: str) -> bool:
    return bool(conv) and _encodable(conv) and len(conv.encode("utf-8")) <= MAX_CONVERSATION_ID_BYTES


def _run_against_model(store, clock: Clock, sequence) -> None:
    """Replay ``sequence`` on ``store`` and on a dict model; they must agree at every step."""
    turns: dict[str, int] = {}
    params: dict[str, tuple[dict, float]] = {}
    counter = itertools.count()
    for op, conv, dt in sequence:
        if op == "wait":
            clock.now += dt
            continue
        if not _valid(conv):
            with pytest.raises(InvalidConversationId):
                {"begin": store.begin_turn, "clear": store.clear_params,
                 "store": lambda c: store.store_params(c, {"x": 1}, "d")}[op](conv)
            continue
        if op == "begin":
            start = store.begin_turn(conv)
            turns[conv] = turns.get(conv, 0) + 1
            held = params.pop(conv, None)
            expect = held[0] if held is not None and held[1] > clock.now else None
            assert start.turn == turns[conv]
            assert start.kv_transfer_params == expect  # never another conversation's, never twice
            assert start.expired == (held is not None and expect is None)
            assert start.conversation_id == conv
        elif op == "store":
            p = {"owner": conv, "n": next(counter), REMOTE_BLOCK_IDS: [[1, 2]]}
            expires = store.store_params(conv, p, "http://d")
            assert expires == clock.now + TTL_S
            params[conv] = (p, expires)
        else:
            store.clear_params(conv)
            params.pop(conv, None)


@PROPERTY
@given(sequence=ops)
def test_sqlite_store_matches_a_model(sequence):
    clock = Clock()
    store = SqliteConversationStore(":memory:", params_ttl_s=TTL_S, clock=clock)
    try:
        _run_against_model(store, clock, sequence)
    finally:
        store.close()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    from redis_faults import redis_server
    try:
        with redis_server(tmp_path_factory.mktemp("redis")) as port:
            yield f"redis://127.0.0.1:{port}/0"
    except FileNotFoundError:
        pytest.skip("no redis-server binary on this machine: the Redis store is not tested here")


def test_redis_store_matches_a_model(redis_url):
    n = itertools.count()

    @PROPERTY
    @given(sequence=ops)
    def run(sequence):
        clock = Clock()
        store = RedisConversationStore(redis_url, params_ttl_s=TTL_S, clock=clock,
                                       prefix=f"prop{next(n)}:")
        try:
            _run_against_model(store, clock, sequence)
        finally:
            store.close()

    run()
