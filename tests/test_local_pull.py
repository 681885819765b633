"""A real vLLM prefill/decode pair on CPU in pull mode: KV moves, outputs match a single instance.

Run under the vLLM lock:
``flock /tmp/kvt/vllm.lock .venv/bin/python -m pytest tests/test_local_pull.py``.
The connector is vLLM's own unless ``KVTUNE_LOCAL_TEST_CONNECTOR=kvtune`` (kvtune's instrumented
subclasses are tested end to end in ``tests/test_connectors*.py``).
"""
from __future__ import annotations

import os

import pytest

from kvtune.local.metrics import wait_for_tokens
from kvtune.local.pair import LocalPair
from kvtune.testing.reference import STANDARD_MAX_TOKENS, standard_prompts
from kvtune.vllm_pd import (
    DO_REMOTE_PREFILL, REMOTE_BLOCK_IDS, REMOTE_ENGINE_ID, REMOTE_PORT, REMOTE_REQUEST_ID,
)

pytestmark = pytest.mark.vllm

CONNECTOR = os.environ.get("KVTUNE_LOCAL_TEST_CONNECTOR", "vllm")


@pytest.fixture(scope="module")
def pair(tmp_path_factory, model_dir, reference):
    work = tmp_path_factory.mktemp("pull-pair")
    with LocalPair("pull", connector=CONNECTOR, workdir=work, spans_dir=work / "spans",
                   model_dir=model_dir) as p:
        yield p




@pytest.mark.parametrize("index", [0, 1])
def test_pull_moves_kv_and_matches_single_instance(pair, reference, index):
    prompt = standard_prompts()[index]
    before = pair.decode_prompt_sources()
    result = pair.complete(prompt, STANDARD_MAX_TOKENS)
    delta = wait_for_tokens(pair.decode_prompt_sources, before, len(prompt))

    assert result.token_ids == reference.outputs[index]
    assert result.prompt_token_ids == tuple(prompt)
    params = result.kv_transfer_params
    assert params[DO_REMOTE_PREFILL] is True
    assert params[REMOTE_ENGINE_ID] == pair.prefill_engine_id
    assert params[REMOTE_PORT] == pair.prefill_side_channel_port
    assert params[REMOTE_BLOCK_IDS] and params[REMOTE_BLOCK_IDS][0]
    # The decode loaded the prompt's KV from the prefill instead of computing it.
    assert delta.external_kv_transfer_tokens >= len(prompt) - 1
    assert delta.local_compute_tokens <= 1
    assert delta.total_tokens == len(prompt)
    assert result.prefill_ms > 0 and result.decode_ms > 0 and result.ttft_ms > 0


def test_traceparent_is_accepted_on_both_legs(pair, reference):
    prompt = standard_prompts()[2]
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    result = pair.complete(prompt, STANDARD_MAX_TOKENS, request_id="kvtune-test-traceparent",
                           traceparent=traceparent)
    assert result.token_ids == reference.outputs[2]
    assert result.request_id == "kvtune-test-traceparent"
    assert "kvtune-test-traceparent" in result.kv_transfer_params[REMOTE_REQUEST_ID]
