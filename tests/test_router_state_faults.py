"""The Redis conversation store under faults: a real ``redis-server``, and a fault-injecting proxy
(``tests/redis_faults.py``) between it and the store.

What must hold whatever fails: a conversation never receives another conversation's params (the
prefill would pull another conversation's KV), never receives params that were already handed out,
and the store recovers (the next calls work, on a fresh connection).
"""
from __future__ import annotations

import itertools

import pytest

from redis_faults import FAULT_KINDS, RedisFaultProxy, redis_server
from kvtune.errors import RouterError
from kvtune.router.state import RedisConversationStore, StateStoreError
from kvtune.vllm_pd import DO_REMOTE_DECODE, REMOTE_BLOCK_IDS, REMOTE_REQUEST_ID

pytestmark = pytest.mark.timeout(300)

CONVS = ("conv0", "conv1", "conv2")
ROUNDS = 2
BEGIN_TURN_PIPELINE = ("MULTI", "INCR", "PEXPIRE", "GET", "DEL", "EXEC")
STALL_TIMEOUT_S = 0.3
"""The store's socket timeout in stall scenarios (the proxy holds a reply back until it gives up)."""


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    try:
        with redis_server(tmp_path_factory.mktemp("redis")) as port:
            yield port
    except FileNotFoundError:
        pytest.skip("no redis-server binary on this machine: the Redis store is not tested here")


@pytest.fixture
def proxy(redis_port):
    p = RedisFaultProxy(redis_port)
    yield p
    p.close()


def _params(conv: str, n: int) -> dict:
    return {DO_REMOTE_DECODE: True, REMOTE_BLOCK_IDS: [[n, n + 1]], "marker_conv": conv,
            "marker_n": n, REMOTE_REQUEST_ID: f"cmpl-{conv}-{n}-0"}


class Outcome:
    def __init__(self) -> None:
        self.crossed = 0
        self.reused = 0
        self.errors = 0
        self.served_with_params = 0
        self.recovery_from = 0
        """Index of the first command of the recovery round."""


def _scenario(url: str, prefix: str, timeout_s: float, proxy: RedisFaultProxy,
              accepting: bool = False) -> Outcome:
    """Rounds of begin_turn + store_params over three conversations (and a clear_params), then a
    clean round that must work; counts crossed and re-used params. ``accepting``: every
    begin_turn passes an ``accept`` (the router's path: read, then claim by compare-and-delete)."""
    accept = (lambda params: True) if accepting else None
    out = Outcome()
    counter = itertools.count(1)
    store = None
    for _ in range(2):  # the fault may hit the constructor's PING/SELECT: then build it again
        try:
            store = RedisConversationStore(url, params_ttl_s=60, prefix=prefix, timeout_s=timeout_s)
            break
        except RouterError:
            out.errors += 1
    assert store is not None
    # Params a conversation may legitimately get back: stored since its last successful begin_turn.
    allowed: dict[str, list[dict]] = {c: [] for c in CONVS}
    try:
        for r in range(ROUNDS):
            for conv in CONVS:
                try:
                    start = store.begin_turn(conv, accept)
                except StateStoreError:
                    out.errors += 1
                else:
                    got = start.kv_transfer_params
                    if got is not None:
                        out.served_with_params += 1
                        if got.get("marker_conv") != conv:
                            out.crossed += 1
                        elif dict(got) not in allowed[conv]:
                            out.reused += 1
                    allowed[conv] = []
                p = _params(conv, next(counter))
                allowed[conv].append(p)
                try:
                    store.store_params(conv, p, "http://d0")
                except StateStoreError:
                    out.errors += 1
            if r == 0:
                try:
                    store.clear_params(CONVS[0])
                except StateStoreError:
                    out.errors += 1
        # Recovery: with the fault spent, every call works and returns exactly what was stored.
        out.recovery_from = len(proxy.commands)
        for conv in CONVS:
            store.begin_turn(conv, accept)
            p = _params(conv, next(counter))
            store.store_params(conv, p, "http://d0")
            assert store.begin_turn(conv, accept).kv_transfer_params == p
    finally:
        store.close()
    return out


def test_fault_at_every_position_of_every_pipeline_never_crosses_conversations(proxy):
    # db 1: each (re)connection sends SELECT, so the connection hand-shake is a pipeline too.
    url = proxy.url + "/1"
    proxy.reset()
    clean = _scenario(url, "clean:", 5.0, proxy)
    assert (clean.crossed, clean.reused, clean.errors) == (0, 0, 0)
    n_commands = clean.recovery_from  # faults go before the recovery round, which must work
    seen = list(proxy.commands)[:n_commands]
    # Every position of every pipeline the store sends appears among the commands faulted below.
    assert ["SELECT", "PING"] == seen[:2]
    begin = [i for i in range(len(seen)) if tuple(seen[i:i + 6]) == BEGIN_TURN_PIPELINE]
    assert len(begin) == ROUNDS * len(CONVS)
    in_begin = {b + k for b in begin for k in range(6)}
    assert seen.count("SET") == ROUNDS * len(CONVS)
    assert [c for i, c in enumerate(seen) if i not in in_begin and c == "DEL"] == ["DEL"]  # clear

    totals = {k: Outcome() for k in FAULT_KINDS}
    fired = 0
    for kind in FAULT_KINDS:
        for at in range(n_commands):
            if kind == "stall" and not (seen[at] == "SET" or at in range(begin[0], begin[0] + 6)):
                continue  # stalls cost a timeout each: one begin_turn pipeline and every SET
            proxy.reset()
            proxy.arm(kind, at)
            outcome = _scenario(url, f"{kind}-{at}:", STALL_TIMEOUT_S if kind == "stall" else 5.0,
                                proxy)
            fired += proxy.fired
            t = totals[kind]
            t.crossed += outcome.crossed
            t.reused += outcome.reused
            t.errors += outcome.errors
            t.served_with_params += outcome.served_with_params
    summary = {k: (t.crossed, t.reused, t.errors, t.served_with_params) for k, t in totals.items()}
    print(f"{fired} faults injected over {n_commands} command positions; "
          f"(crossed, reused, store errors, turns served with params) per kind: {summary}")
    assert all(t.crossed == 0 for t in totals.values()), summary
    assert all(t.reused == 0 for t in totals.values()), summary
    # The faults did happen and did surface as store errors, and params were still carried.
    assert fired >= n_commands * (len(FAULT_KINDS) - 1)
    assert all(t.errors > 0 for t in totals.values()), summary
    assert all(t.served_with_params > 0 for t in totals.values()), summary


ACCEPTING_PIPELINE = ("MULTI", "INCR", "PEXPIRE", "GET", "EXEC")


def test_faults_in_the_accepting_begin_turn_never_cross_or_reuse(proxy):
    """The router's path (issue 29: refused params stay stored): begin_turn reads in MULTI/EXEC
    and claims accepted params with a compare-and-delete EVAL. A fault at every position of
    either: never another conversation's params, never params handed out twice."""
    url = proxy.url + "/1"
    proxy.reset()
    clean = _scenario(url, "accepting-clean:", 5.0, proxy, accepting=True)
    assert (clean.crossed, clean.reused, clean.errors) == (0, 0, 0)
    n_commands = clean.recovery_from
    seen = list(proxy.commands)[:n_commands]
    begin = [i for i in range(len(seen)) if tuple(seen[i:i + 5]) == ACCEPTING_PIPELINE]
    assert len(begin) == ROUNDS * len(CONVS)
    assert seen.count("EVAL") == clean.served_with_params > 0
    totals = Outcome()
    for kind in FAULT_KINDS:
        for at in range(n_commands):
            if kind == "stall" and seen[at] != "EVAL" and at not in range(begin[0], begin[0] + 5):
                continue  # stalls cost a timeout each: one read pipeline and every claim
            proxy.reset()
            proxy.arm(kind, at)
            outcome = _scenario(url, f"accepting-{kind}-{at}:",
                                STALL_TIMEOUT_S if kind == "stall" else 5.0, proxy, accepting=True)
            totals.crossed += outcome.crossed
            totals.reused += outcome.reused
            totals.errors += outcome.errors
    assert (totals.crossed, totals.reused) == (0, 0) and totals.errors > 0


def test_oom_during_begin_turn_leaves_no_stale_replies(redis_port):
    """The issue's reproduction: one begin_turn while Redis answers -OOM (maxmemory 1), then reset.
    Before the fix the connection stayed out of step: later calls raised stale errors while their
    writes succeeded, and begin_turn("conv2") returned conv0's params."""
    url = f"redis://127.0.0.1:{redis_port}/0"
    store = RedisConversationStore(url, params_ttl_s=60, prefix="oom:")
    admin = RedisConversationStore(url, params_ttl_s=60, prefix="oom-admin:")
    p0 = _params("conv0", 0)
    try:
        store.begin_turn("conv0")
        store.store_params("conv0", p0, "http://d0")
        admin._exchange([("CONFIG", "SET", "maxmemory", "1")])
        try:
            with pytest.raises(StateStoreError, match="OOM"):
                store.begin_turn("conv1")
        finally:
            admin._exchange([("CONFIG", "SET", "maxmemory", "0")])
        assert store.begin_turn("conv2").kv_transfer_params is None
        # conv1's turn never happened (EXEC aborted): it starts at 1; conv0 still has its params.
        assert store.begin_turn("conv1").turn == 1
        again = store.begin_turn("conv0")
        assert again.kv_transfer_params == p0 and again.turn == 2
        for i in range(5):  # no stale error, no stale reply, on any later call
            store.store_params("conv2", _params("conv2", i), "http://d0")
            assert store.begin_turn("conv2").kv_transfer_params == _params("conv2", i)
    finally:
        store.close()
        admin.close()


def test_redis_restart_mid_use_recovers(redis_port, tmp_path):
    """A dropped connection (the server goes away, then comes back on the same port): the store
    reports the failure, then works on a new connection by itself."""
    with redis_server(tmp_path / "a") as port:
        store = RedisConversationStore(f"redis://127.0.0.1:{port}/0", params_ttl_s=60, timeout_s=2)
        store.begin_turn("c")
    try:
        with pytest.raises(StateStoreError):
            store.begin_turn("c")
        with redis_server(tmp_path / "b", port=port):
            assert store.begin_turn("c").turn == 1  # a fresh server: a fresh counter
            store.store_params("c", _params("c", 1), "http://d0")
            assert store.begin_turn("c").kv_transfer_params == _params("c", 1)
    finally:
        store.close()


def test_params_stored_under_another_conversation_are_refused(redis_port):
    """Defence in depth: each entry names its conversation; an entry found under the wrong key
    (however it got there) is refused, never handed out."""
    url = f"redis://127.0.0.1:{redis_port}/0"
    store = RedisConversationStore(url, params_ttl_s=60, prefix="misfiled:")
    try:
        store.store_params("a", _params("a", 1), "http://d0")
        raw = store._exchange([("GET", store._k("params", "a"))])[0]
        store._exchange([("SET", store._k("params", "b"), raw)])
        with pytest.raises(StateStoreError, match="name conversation 'a'"):
            store.begin_turn("b")
        assert store.begin_turn("a").kv_transfer_params == _params("a", 1)
    finally:
        store.close()
