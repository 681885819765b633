"""The router's side of the renewable decode lease, through real HTTP on loopback, against stand-in
vLLM servers whose decode runs kvtune's real lease book and channel
(:class:`kvtune.testing.standin.StandInVllmCluster` with ``lease=True``): its prefill refuses a
readback of released or lapsed blocks and one whose expiry is past the decode's deadline."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from kvtune import spans as sc
from kvtune import vllm_pd as pd
from kvtune.errors import ConfigError
from kvtune.router import RouterInThread
from kvtune.router.client import get, post
from kvtune.router.config import config_from_dict
from kvtune.router.lease import END_HEADER, END_PATH
from kvtune.testing.standin import StandInVllmCluster

pytestmark = pytest.mark.timeout(120)

TTL_S = 7.0
"""The decode's first hold (``decoder_kv_blocks_ttl``): the shortest the router's rules allow
with a renewal every second (min(lease, TTL) - 6 s)."""
LEASE = {"lease_s": TTL_S, "lease_renew_every_s": 0.5, "lease_idle_s": 60.0}


@contextlib.contextmanager
def _leased(tmp_path, lease: dict = LEASE, tracer: object = None
            ) -> Iterator[tuple[StandInVllmCluster, RouterInThread]]:
    """A stand-in 1P1D bidirectional cluster whose decode runs the lease, and a router leasing."""
    with StandInVllmCluster(1, 1, bidirectional=True, decoder_ttl_s=TTL_S, lease=True) as cluster, \
            RouterInThread(cluster.router_config("bidirectional", decoder_ttl_s=TTL_S,
                                                 state=f"sqlite:{tmp_path}/s.db",
                                                 **lease), tracer=tracer) as router:
        yield cluster, router


def _turn(url: str, prompt: str, conv: str, **headers: str) -> tuple[str, int]:
    r = post(url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 3,
                                       "conversation_id": conv}, headers=headers)
    assert r.status == 200, r.body
    return prompt + r.text(), r.status


def _prefill_params(cluster: StandInVllmCluster) -> list[dict]:
    """The ``kv_transfer_params`` each prefill leg was given."""
    return [r.body[pd.KV_TRANSFER_PARAMS] for r in cluster.requests("prefill")]


def test_renewed_blocks_are_offered_after_the_first_ttl_with_the_renewed_expiry(tmp_path) -> None:
    with _leased(tmp_path) as (cluster, router):
        history, _ = _turn(router.url, "hello " * 8, "conv-A")
        book = cluster.decode[0].lease_book
        ((rid, first),) = book.held().items()
        time.sleep(TTL_S + 1.5)  # past the first hold: only renewals keep the blocks
        assert book.held()[rid] > first + 1
        _turn(router.url, history + " more words", "conv-A")
        health = get(router.url + "/health").json()["decode_lease"]
    assert cluster.ledger.lease_refusals == []
    offered = _prefill_params(cluster)[-1]
    assert offered[pd.REMOTE_REQUEST_ID] == rid
    assert offered[pd.REMOTE_BLOCKS_EXPIRY_TIME] > first + TTL_S  # the renewed deadline
    assert cluster.requests("prefill")[-1].pulled_tokens > 0
    assert health["enabled"] and health["renewals_total"] >= 3
    assert list(health["decodes"].values()) == ["lease"]


def test_end_endpoint_forgets_then_releases_and_the_next_turn_recomputes(tmp_path) -> None:
    with _leased(tmp_path) as (cluster, router):
        history, _ = _turn(router.url, "hello " * 8, "conv-B")
        book = cluster.decode[0].lease_book
        ((rid, _first),) = book.held().items()
        ended = post(router.url + END_PATH, {"conversation_id": "conv-B"})
        assert ended.status == 200 and ended.json()["released"] is True
        assert book.renew(rid, 5).error == "released"  # a renewal after release is refused
        _turn(router.url, history + " more", "conv-B")
        health = get(router.url + "/health").json()["decode_lease"]
    assert pd.REMOTE_BLOCK_IDS not in _prefill_params(cluster)[-1]  # nothing offered
    assert cluster.requests("prefill")[-1].pulled_tokens == 0
    assert health["releases_total"] == 1 and health["held"] == 1  # the new turn's blocks


def test_end_header_releases_the_turns_blocks_instead_of_keeping_them(tmp_path, tracer,
                                                                     exporter) -> None:
    with _leased(tmp_path, tracer=tracer) as (cluster, router):
        history, _ = _turn(router.url, "hello " * 8, "conv-C", **{END_HEADER: "1"})
        book = cluster.decode[0].lease_book
        ((rid, _first),) = book.held().items()
        assert book.release(rid).expiry <= book.now()  # already released by the router
        _turn(router.url, history + " more", "conv-C")
    assert pd.REMOTE_BLOCK_IDS not in _prefill_params(cluster)[-1]
    ends = [s.attributes.get(sc.CONVERSATION_END) for s in exporter.get_finished_spans()
            if s.name == sc.SpanName.REQUEST.value]
    assert ends == [True, None]  # the analysis reads the conversation's end from kv.request


def test_leases_past_the_idle_time_lapse_and_are_not_offered(tmp_path) -> None:
    lease = {**LEASE, "lease_idle_s": 1.0}
    with _leased(tmp_path, lease) as (cluster, router):
        history, _ = _turn(router.url, "hello " * 8, "conv-D")
        time.sleep(TTL_S + 1)  # renewals stop after 1 s; the first hold runs out
        _turn(router.url, history + " more", "conv-D")
        health = get(router.url + "/health").json()["decode_lease"]
    assert cluster.ledger.lease_refusals == []
    assert pd.REMOTE_BLOCK_IDS not in _prefill_params(cluster)[-1]
    assert health["lapsed_total"] == 1 and health["held"] == 1  # the second turn's blocks


def test_a_fixed_ttl_decode_is_reported_and_used_within_the_routers_window(tmp_path) -> None:
    with StandInVllmCluster(1, 1, bidirectional=True, decoder_ttl_s=480.0) as cluster, \
            RouterInThread(cluster.router_config("bidirectional", state=f"sqlite:{tmp_path}/s.db",
                                                 lease_s=60.0)) as router:
        history, _ = _turn(router.url, "hello " * 8, "conv-E")
        _turn(router.url, history + " more", "conv-E")
        health = get(router.url + "/health").json()["decode_lease"]
    assert cluster.requests("prefill")[-1].pulled_tokens > 0
    assert list(health["decodes"].values()) == ["fixed_ttl"]
    assert health["held"] == 0


def test_lease_off_by_default_leaves_the_params_alone(tmp_path) -> None:
    with StandInVllmCluster(1, 1, bidirectional=True, lease=True) as cluster, \
            RouterInThread(cluster.router_config("bidirectional",
                                                 state=f"sqlite:{tmp_path}/s.db")) as router:
        history, _ = _turn(router.url, "hello " * 8, "conv-F")
        ((rid, first),) = cluster.decode[0].lease_book.held().items()
        _turn(router.url, history + " more", "conv-F")
        health = get(router.url + "/health").json()["decode_lease"]
    assert _prefill_params(cluster)[-1][pd.REMOTE_BLOCKS_EXPIRY_TIME] == first
    assert health["enabled"] is False and health["renewals_total"] == 0


@pytest.mark.parametrize("body, status, words", [
    ({}, 400, "conversation_id"),
    ({"conversation_id": 7}, 400, "conversation_id"),
    (b"[1]", 400, "JSON object"),
    (b"x" * 5000, 413, "4096"),
])
def test_end_endpoint_refuses_bad_requests(tmp_path, body, status, words) -> None:
    with StandInVllmCluster(1, 1, bidirectional=True) as cluster, \
            RouterInThread(cluster.router_config("bidirectional",
                                                 state=f"sqlite:{tmp_path}/s.db")) as router:
        r = post(router.url + END_PATH, body)
    assert r.status == status and words in r.body.decode()


def test_lease_config_is_checked_and_written_only_when_on() -> None:
    base = {"mode": "bidirectional", "prefill": "http://p:1", "decode": "http://d:1",
            "decoder_ttl_s": 30}
    assert "lease_s" not in config_from_dict(base).to_dict()
    on = config_from_dict({**base, "lease_s": 30})
    assert on.lease_renew_every_s == 10 and on.lease_idle_s == 480
    assert on.params_ttl_s == 510 and on.params_ttl_base_s == 30 - on.margin_s
    assert config_from_dict(on.to_dict()) == on
    with pytest.raises(ConfigError, match="lease_renew_every_s"):
        config_from_dict({**base, "lease_s": 30, "lease_renew_every_s": 25})
    with pytest.raises(ConfigError, match="applies with 'lease_s' only"):
        config_from_dict({**base, "lease_idle_s": 30})
    with pytest.raises(ConfigError, match="lease_s"):
        config_from_dict({**base, "lease_s": -1})


def test_an_unreachable_channel_withholds_the_history_and_the_turn_recomputes(tmp_path) -> None:
    with _leased(tmp_path) as (cluster, router):
        history, _ = _turn(router.url, "hello " * 8, "conv-G")
        channel, cluster.decode[0].lease_channel = cluster.decode[0].lease_channel, None
        channel.close()  # the decode's channel is gone; its blocks stay held until they lapse
        _turn(router.url, history + " more", "conv-G")
        health = get(router.url + "/health").json()["decode_lease"]
    assert pd.REMOTE_BLOCK_IDS not in _prefill_params(cluster)[-1]
    assert health["withheld_total"] == 1 and health["channel_errors_total"] >= 1


def test_records_of_conversations_that_never_return_are_swept() -> None:
    from types import SimpleNamespace

    from kvtune.router.lease import DecodeLeases

    now = [0.0]
    cfg = config_from_dict({"mode": "bidirectional", "prefill": "http://p:1",
                            "decode": "http://d:1", "decoder_ttl_s": 30, "lease_s": 30})
    leases = DecodeLeases(SimpleNamespace(config=cfg), clock=lambda: now[0])
    fixed = {pd.REMOTE_REQUEST_ID: "cmpl-1", pd.REMOTE_BLOCK_IDS: [[1]]}

    async def store(n: int, key: str) -> None:
        for i in range(n):
            await leases.held(key.format(i), fixed, "http://d:1")

    asyncio.run(store(100, "conv-{}"))
    now[0] = cfg.params_ttl_s + 1  # none of those can be offered any more
    asyncio.run(store(1, "conv-new"))
    assert list(leases._held) == ["conv-new"]


def test_a_turn_in_flight_when_its_conversation_ends_releases_its_blocks(tmp_path) -> None:
    with _leased(tmp_path) as (cluster, router):
        cluster.decode[0].delay_s = 1.0  # the turn is still on the decode when the end comes
        turn = threading.Thread(target=_turn, args=(router.url, "hello " * 8, "conv-H"))
        turn.start()
        time.sleep(0.5)
        assert post(router.url + END_PATH, {"conversation_id": "conv-H"}).status == 200
        turn.join(30)
        book = cluster.decode[0].lease_book
        ((rid, _first),) = book.held().items()
        late = book.renew(rid, 5)
        health = get(router.url + "/health").json()["decode_lease"]
    assert late.error == "released"
    assert health["held"] == 0 and health["releases_total"] == 1
