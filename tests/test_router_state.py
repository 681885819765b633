"""The router's conversation stores: SQLite (always) and Redis (when a redis-server binary exists)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from kvtune.errors import RouterError
from kvtune.router.state import (ConversationStore, RedisConversationStore, SqliteConversationStore,
                                 open_store)
from kvtune.vllm_pd import (
    DO_REMOTE_DECODE, KV_TRANSFER_PARAMS, REMOTE_BLOCK_IDS, REMOTE_ENGINE_ID, REMOTE_NUM_TOKENS,
    REMOTE_REQUEST_ID,
)
from _net import free_port

pytestmark = pytest.mark.timeout(60)

PARAMS = {DO_REMOTE_DECODE: True, REMOTE_BLOCK_IDS: [[1, 2]], REMOTE_ENGINE_ID: "d0",
          REMOTE_REQUEST_ID: "cmpl-x-0", REMOTE_NUM_TOKENS: 20}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary on this machine: the Redis store is not tested here")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(params=["sqlite", "redis"])
def make_store(request, tmp_path):
    clock = FakeClock()
    created = []

    def make(ttl_s: float = 10.0, retention_s: float = 3600.0) -> ConversationStore:
        if request.param == "sqlite":
            store = SqliteConversationStore(tmp_path / "state.db", params_ttl_s=ttl_s,
                                            retention_s=retention_s, clock=clock)
        else:
            url = request.getfixturevalue("redis_url")
            store = RedisConversationStore(url, params_ttl_s=ttl_s, retention_s=retention_s,
                                           clock=clock, prefix=f"t{time.monotonic_ns()}:")
        created.append(store)
        return store

    make.clock = clock  # type: ignore[attr-defined]
    yield make
    for store in created:
        store.close()


def test_turns_count_and_params_are_handed_out_once(make_store):
    store = make_store()
    assert isinstance(store, ConversationStore)
    first = store.begin_turn("c1")
    assert (first.turn, first.kv_transfer_params, first.expired) == (1, None, False)
    store.store_params("c1", PARAMS, "http://d0")
    second = store.begin_turn("c1")
    assert second.turn == 2 and second.kv_transfer_params == PARAMS
    assert second.decode_instance == "http://d0" and not second.expired
    # The prefill consumes the decode's blocks: the same params are never offered twice.
    third = store.begin_turn("c1")
    assert third.turn == 3 and third.kv_transfer_params is None and not third.expired
    # Conversations do not share state.
    assert store.begin_turn("c2").turn == 1


def test_params_refused_by_accept_stay_stored_for_the_turn_that_takes_them(make_store):
    """Issue 29: a turn that is refused the stored params (not its history) must leave them for
    the turn whose history they encode, not consume them."""
    store = make_store()
    store.begin_turn("c")
    store.store_params("c", PARAMS, "http://d0")
    seen = []

    def refuse(params):
        seen.append(params)
        return False

    left = store.begin_turn("c", refuse)
    assert seen == [PARAMS] and left.kept and left.kv_transfer_params is None and left.turn == 2
    taken = store.begin_turn("c", lambda params: True)
    assert not taken.kept and taken.kv_transfer_params == PARAMS and taken.turn == 3
    assert taken.decode_instance == "http://d0"
    again = store.begin_turn("c", lambda params: True)  # handed out once, accept or not
    assert again.kv_transfer_params is None and not again.kept
    make_store.clock.now += 100.0
    store.store_params("c", PARAMS, "http://d0")
    make_store.clock.now += 10.0
    expired = store.begin_turn("c", lambda params: pytest.fail("expired params are not offered"))
    assert expired.expired and expired.kv_transfer_params is None


def test_redis_claim_lost_to_a_newer_entry_hands_out_nothing(redis_url):
    """Between the read and the compare-and-delete another turn stores new params: this turn
    gets none (it recomputes) and the newer entry stays."""
    store = RedisConversationStore(redis_url, params_ttl_s=10.0, prefix=f"r{time.monotonic_ns()}:")
    try:
        store.begin_turn("c")
        store.store_params("c", PARAMS, "http://d0")
        newer = {**PARAMS, REMOTE_BLOCK_IDS: [[7]]}

        def racing(params):
            store.store_params("c", newer, "http://d1")
            return True

        lost = store.begin_turn("c", racing)
        assert lost.kv_transfer_params is None and not lost.kept
        assert store.begin_turn("c").kv_transfer_params == newer
    finally:
        store.close()


def test_params_expire_before_the_decode_ttl(make_store):
    store = make_store(ttl_s=10.0)
    store.begin_turn("c")
    expires_at = store.store_params("c", PARAMS, "http://d0")
    assert expires_at == make_store.clock.now + 10.0
    make_store.clock.now += 10.0  # exactly at expiry: no longer valid
    start = store.begin_turn("c")
    assert start.kv_transfer_params is None and start.expired and start.turn == 2


def test_params_just_before_expiry_are_sent(make_store):
    store = make_store(ttl_s=10.0)
    store.begin_turn("c")
    store.store_params("c", PARAMS, "http://d0")
    make_store.clock.now += 9.9
    assert store.begin_turn("c").kv_transfer_params == PARAMS


def test_sqlite_state_survives_reopen(tmp_path):
    clock = FakeClock()
    store = SqliteConversationStore(tmp_path / "s.db", params_ttl_s=60, clock=clock)
    store.begin_turn("c")
    store.store_params("c", PARAMS, "http://d0")
    # No close(): a crashed process does not close its connection either.
    again = SqliteConversationStore(tmp_path / "s.db", params_ttl_s=60, clock=clock)
    start = again.begin_turn("c")
    assert start.turn == 2 and start.kv_transfer_params == PARAMS
    mode = again._db.execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    store.close()
    again.close()


def test_sqlite_retention_forgets_old_conversations(tmp_path):
    clock = FakeClock()
    store = SqliteConversationStore(tmp_path / "s.db", params_ttl_s=60, retention_s=100, clock=clock)
    store.begin_turn("c")
    store.begin_turn("c")
    clock.now += 101
    assert store.begin_turn("c").turn == 1
    store.close()


def test_clear_params(make_store):
    store = make_store()
    store.begin_turn("c")
    store.store_params("c", PARAMS, "http://d0")
    store.clear_params("c")
    assert store.begin_turn("c").kv_transfer_params is None


def test_open_store_specs(tmp_path):
    s = open_store(f"sqlite:{tmp_path}/a/b.db", params_ttl_s=5)
    assert isinstance(s, SqliteConversationStore) and (tmp_path / "a" / "b.db").exists()
    s.close()
    with pytest.raises(RouterError, match="expected 'sqlite:PATH'"):
        open_store("postgres://x", params_ttl_s=5)
    with pytest.raises(RouterError, match="cannot reach Redis"):
        open_store(f"redis://127.0.0.1:{free_port()}/0", params_ttl_s=5)


def test_router_with_redis_state_carries_params_across_restart(redis_url, tmp_path):
    from kvtune.router import RouterProcess
    from kvtune.router.client import post
    from kvtune.testing.standin import StandInVllmCluster
    with StandInVllmCluster(1, 1, bidirectional=True) as cluster:
        config = cluster.router_config("bidirectional", state=redis_url)
        conv = f"redis-conv-{time.monotonic_ns()}"
        body = {"model": "m", "prompt": "a b c", "max_tokens": 2, "conversation_id": conv}
        first = RouterProcess(config, workdir=tmp_path / "r1")
        first.start()
        try:
            assert post(first.url + "/v1/completions", body).status == 200
        finally:
            first.kill()
        with RouterProcess(config, workdir=tmp_path / "r2") as second:
            assert post(second.url + "/v1/completions", {**body, "prompt": "a b c w0 w1 d"}).status == 200
        returned = cluster.requests("decode")[0].returned_kv_params
        sent = cluster.requests("prefill")[1].body[KV_TRANSFER_PARAMS]
    assert sent[REMOTE_BLOCK_IDS] == returned[REMOTE_BLOCK_IDS]
    assert cluster.prefill[0].received[1].pulled_tokens == 5  # min(3 + 2 held, 6 in prompt)
