"""End to end: the renewable decode lease on a real vLLM prefill/decode pair on CPU (bidirectional,
kvtune's connectors, the decode's ``decoder_kv_blocks_ttl`` short). A conversation the router keeps
renewing has its history read back after that TTL would have lapsed; a conversation ended through
the router's end endpoint has its blocks released, and its next turn recomputes the history and
succeeds. The decode's ``kv.retention`` spans say so (renewals; reused / ended).

Run with both locks, one engine workload at a time (see /tmp/runs/HELPER_RULES.md or
``kvtune/local/README.md``): ``flock -x ENGINE_LOCK flock -s HEAVY_LOCK pytest -m vllm
tests/test_lease_e2e.py``. One pair; it starts in ~30-90 s and the test waits ~20 s on purpose.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtune import spans, vllm_pd as pd

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")
from kvtune.local import server  # noqa: E402
from kvtune.local.pair import LocalPair  # noqa: E402
from kvtune.traces import load  # noqa: E402

TTL_S = 12.0
"""The decode's first hold (``decoder_kv_blocks_ttl``): what vLLM alone would keep the blocks for."""
LEASE = {"lease_s": 20.0, "lease_renew_every_s": 3.0, "lease_idle_s": 300.0}
"""Renewals of 20 s every 3 s (the router's rule: at most min(20, 12) - 6 s apart)."""
PAST_TTL_S = TTL_S + 6.0
"""How long after turn 1 the renewed conversation's turn 2 comes: well past the first TTL."""
MAX_TOKENS = 8
PROMPT_A = tuple(range(20, 116))      # 96 tokens; with 8 out, 103 of history >= threshold 64
PROMPT_B = tuple(range(200, 296))
EXTRA = tuple(range(500, 540))
SPANS_WAIT_S = 120.0
STARTUP_TIMEOUT_S = 900.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPair]:
    workdir = tmp_path_factory.mktemp("lease-e2e")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server, "wait_healthy", functools.partial(server.wait_healthy,
                                                             timeout_s=STARTUP_TIMEOUT_S))
        with LocalPair("bidirectional", connector="kvtune", workdir=workdir / "work",
                       spans_dir=workdir / "spans", extra_env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
                       ttl_s=TTL_S, role_kv_extra_config={"decode": {pd.LEASE_PORT: 0, pd.LEASE_MAX_S: 60}},
                       router_overrides=LEASE) as p:
            yield p


def _retention(spans_dir: Path, request_id: str, logs: object) -> object:
    tid = spans.transfer_id(request_id, spans.Direction.REVERSE)
    deadline = time.monotonic() + SPANS_WAIT_S
    while True:
        if any(spans_dir.glob("*.jsonl")):
            df = load(spans_dir)
            rows = df[(df[spans.TRANSFER_ID] == tid)
                      & (df["name"] == spans.SpanName.RETENTION.value)]
            if len(rows):
                return rows.iloc[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no kv.retention span for {tid}\n{logs() if callable(logs) else ''}")
        time.sleep(0.5)


def test_renewed_history_is_read_back_after_the_ttl_and_an_ended_one_is_recomputed(
        pair: LocalPair) -> None:
    a1 = pair.complete(list(PROMPT_A), MAX_TOKENS, request_id="lease-a1", conversation="lease-A")
    t_a1 = time.monotonic()
    assert isinstance((a1.decode_kv_transfer_params or {}).get(pd.PARAMS_LEASE_PORT), int)
    b1 = pair.complete(list(PROMPT_B), MAX_TOKENS, request_id="lease-b1", conversation="lease-B")
    assert pair.end_conversation("lease-B")["released"] is True

    time.sleep(max(0.0, t_a1 + PAST_TTL_S - time.monotonic()))
    turn2_a = list(PROMPT_A + a1.token_ids + EXTRA)
    p0 = pair.prefill_prompt_sources()
    a2 = pair.complete(turn2_a, MAX_TOKENS, request_id="lease-a2", conversation="lease-A")
    p1 = pair.prefill_prompt_sources()
    # Read back from the decode past the first TTL: only the renewals kept those blocks.
    assert p1.external_kv_transfer_tokens - p0.external_kv_transfer_tokens >= len(PROMPT_A)

    turn2_b = list(PROMPT_B + b1.token_ids + EXTRA)
    b2 = pair.complete(turn2_b, MAX_TOKENS, request_id="lease-b2", conversation="lease-B")
    p2 = pair.prefill_prompt_sources()
    # Released: nothing offered, nothing read; the prefill computed the whole history itself.
    assert p2.external_kv_transfer_tokens == p1.external_kv_transfer_tokens
    assert len(b2.token_ids) == MAX_TOKENS

    # The read-back turn answers what a turn that recomputes everything answers.
    alone = pair.complete(turn2_a, MAX_TOKENS, request_id="lease-a2-alone")
    assert a2.token_ids == alone.token_ids

    health = pair.router_health()["decode_lease"]
    assert health["enabled"] and list(health["decodes"].values()) == ["lease"]
    assert health["renewals_total"] >= 3 and health["releases_total"] == 1
    assert health["withheld_total"] == 0

    spans_dir = pair.spans_dir
    assert spans_dir is not None
    kept = _retention(spans_dir, "lease-a1", pair.logs)
    assert kept[spans.RETENTION_OUTCOME] == spans.RetentionOutcome.REUSED.value
    assert kept[spans.RETENTION_RENEWALS] >= 3
    assert kept[spans.RETENTION_LEASE_S] == LEASE["lease_s"]
    assert kept[spans.RETENTION_TTL_S] == TTL_S
    ended = _retention(spans_dir, "lease-b1", pair.logs)
    assert ended[spans.RETENTION_OUTCOME] == spans.RetentionOutcome.ENDED.value


def test_a_lease_the_router_forgets_lapses_and_the_next_turn_recomputes(pair: LocalPair) -> None:
    """The router restarted with its store (or died): the stored params outlive the leases, which
    nobody renews. The decode frees the blocks at the first TTL; the next turn's renewal is refused
    and the router withholds the history instead of sending a read the prefill must decline."""
    prompt = tuple(range(600, 696))
    c1 = pair.complete(list(prompt), MAX_TOKENS, request_id="lease-c1", conversation="lease-C")
    t_c1 = time.monotonic()
    assert pair._router is not None
    leases = pair._router.router.leases
    before = pair.router_health()["decode_lease"]
    leases._held.clear()  # what a router restart loses: the leases, not the stored params
    assert pair.conversation_params("lease-C") is not None
    time.sleep(max(0.0, t_c1 + TTL_S + 3.0 - time.monotonic()))
    p0 = pair.prefill_prompt_sources()
    c2 = pair.complete(list(prompt + c1.token_ids + EXTRA), MAX_TOKENS, request_id="lease-c2",
                       conversation="lease-C")
    p1 = pair.prefill_prompt_sources()
    assert len(c2.token_ids) == MAX_TOKENS
    assert p1.external_kv_transfer_tokens == p0.external_kv_transfer_tokens  # nothing read
    after = pair.router_health()["decode_lease"]
    assert after["withheld_total"] == before["withheld_total"] + 1
    assert pair.spans_dir is not None
    lapsed = _retention(pair.spans_dir, "lease-c1", pair.logs)
    assert lapsed[spans.RETENTION_OUTCOME] == spans.RetentionOutcome.LAPSED.value
