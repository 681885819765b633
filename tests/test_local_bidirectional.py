"""A real vLLM pair on CPU in bidirectional mode: a two-turn conversation whose second prefill
pulls the conversation's history back from the decode instead of recomputing it.

Run under the vLLM lock: ``flock /tmp/kvt/vllm.lock .venv/bin/python -m pytest
tests/test_local_bidirectional.py``. The connector is vLLM's own unless
``KVTUNE_LOCAL_TEST_CONNECTOR=kvtune``.
"""
from __future__ import annotations

import os

import pytest

from kvtune.local.metrics import wait_for_tokens
from kvtune.local.pair import LocalPair
from kvtune.local.workload import PairTarget, WorkloadConfig, generate, run_workload
from kvtune.vllm_pd import (
    DO_REMOTE_DECODE, REMOTE_BLOCKS_EXPIRY_TIME, REMOTE_BLOCK_IDS, REMOTE_ENGINE_ID,
    REMOTE_NUM_TOKENS,
)
from kvtune.testing.reference import STANDARD_MAX_TOKENS, standard_conversations

pytestmark = pytest.mark.vllm

CONNECTOR = os.environ.get("KVTUNE_LOCAL_TEST_CONNECTOR", "vllm")
TTL_S = 300
"""Decode-side retention, long enough that the second turn always finds the history."""
RECOMPUTE_THRESHOLD = 1
"""Pull any history of at least one token. With vLLM's default (64) the second turn would be
recomputed: the prefill's own prefix cache holds the first 128-token block of the history, which
leaves 171 - 128 = 43 history tokens to pull, under 64."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory, model_dir, reference):
    work = tmp_path_factory.mktemp("bidirectional-pair")
    with LocalPair("bidirectional", connector=CONNECTOR, workdir=work, spans_dir=work / "spans",
                   model_dir=model_dir, ttl_s=TTL_S,
                   recompute_threshold=RECOMPUTE_THRESHOLD) as p:
        yield p




def test_two_turns_pull_history_back_and_match_single_instance(pair, reference):
    conv = standard_conversations()[0]
    expected = reference.conversation_outputs[0]
    prompts = conv.prompts(expected)

    # Turn 1: an ordinary pull; the decode keeps the conversation's blocks and says so.
    d0 = pair.decode_prompt_sources()
    first = pair.complete(prompts[0], STANDARD_MAX_TOKENS, conversation="conv-a")
    d1 = wait_for_tokens(pair.decode_prompt_sources, d0, len(prompts[0]))
    assert first.token_ids == expected[0]
    assert d1.external_kv_transfer_tokens >= len(prompts[0]) - 1
    assert d1.local_compute_tokens <= 1
    retained = first.decode_kv_transfer_params
    assert retained[DO_REMOTE_DECODE] is True
    assert retained[REMOTE_ENGINE_ID] == pair.decode_engine_id
    assert retained[REMOTE_BLOCK_IDS] and retained[REMOTE_BLOCK_IDS][0]
    assert retained[REMOTE_NUM_TOKENS] == len(prompts[0]) + len(expected[0]) - 1
    assert retained[REMOTE_BLOCKS_EXPIRY_TIME] is not None
    assert pair.conversation_params("conv-a") == retained

    # Turn 2: the prefill is offered the decode's blocks and pulls the history back.
    p1 = pair.prefill_prompt_sources()
    d1_abs = pair.decode_prompt_sources()
    second = pair.complete(prompts[1], STANDARD_MAX_TOKENS, conversation="conv-a")
    p_delta = wait_for_tokens(pair.prefill_prompt_sources, p1, len(prompts[1]))
    d_delta = wait_for_tokens(pair.decode_prompt_sources, d1_abs, len(prompts[1]))
    assert second.token_ids == expected[1]
    # Prefill-side evidence: history tokens came over the connector, not from local compute.
    assert p_delta.external_kv_transfer_tokens > 0
    assert p_delta.total_tokens == len(prompts[1])
    history_not_local = retained[REMOTE_NUM_TOKENS] - p_delta.local_cache_hit_tokens
    assert p_delta.external_kv_transfer_tokens == history_not_local
    assert p_delta.local_compute_tokens == len(prompts[1]) - retained[REMOTE_NUM_TOKENS]
    # ...and the decode again did not recompute the (longer) prompt.
    assert d_delta.local_compute_tokens <= 1
    assert d_delta.total_tokens == len(prompts[1])


def test_new_conversation_after_forget_starts_fresh(pair, reference):
    conv = standard_conversations()[0]
    prompts = conv.prompts(reference.conversation_outputs[0])
    pair.complete(prompts[0], STANDARD_MAX_TOKENS, conversation="conv-b")
    assert pair.conversation_params("conv-b") is not None
    pair.forget("conv-b")
    assert pair.conversation_params("conv-b") is None
    p1 = pair.prefill_prompt_sources()
    result = pair.complete(prompts[1], STANDARD_MAX_TOKENS, conversation="conv-b")
    p_delta = wait_for_tokens(pair.prefill_prompt_sources, p1, len(prompts[1]))
    assert result.token_ids == reference.conversation_outputs[0][1]
    assert p_delta.external_kv_transfer_tokens == 0  # nothing offered: no reverse pull


def test_multi_turn_workload_through_the_pair(pair):
    config = WorkloadConfig(n_conversations=2, turns=(2, 2), system_prompt_tokens=32,
                            first_user_tokens=(40, 60), follow_up_tokens=(10, 20),
                            output_tokens=(4, 8), think_time_s=(0.5, 1.0), seed=3)
    plans = generate(config)
    before = pair.prefill_prompt_sources()
    results = run_workload(plans, PairTarget(pair), time_scale=0.2, progress=False)
    assert len(results) == 4 and all(r.ok for r in results), [r.error for r in results]
    for r in results:
        assert r.output_tokens == next(t.max_tokens for p in plans
                                       if p.conversation_id == r.conversation_id
                                       for t in p.turns if t.turn == r.turn)
    # Second turns were offered the decode's blocks and pulled history back.
    delta = pair.prefill_prompt_sources() - before
    assert delta.external_kv_transfer_tokens > 0
