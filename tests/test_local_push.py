"""A real vLLM prefill/decode pair on CPU in push mode: the prefill WRITEs the prompt's KV into the
decode's blocks, and outputs match a single instance.

Run under the vLLM lock:
``flock /tmp/kvt/vllm.lock .venv/bin/python -m pytest tests/test_local_push.py``.
The connector is vLLM's own unless ``KVTUNE_LOCAL_TEST_CONNECTOR=kvtune`` (kvtune's instrumented
subclasses are tested end to end in ``tests/test_connectors*.py``).
"""
from __future__ import annotations

import os

import pytest

from kvtune.local.metrics import wait_for_tokens
from kvtune.local.pair import LocalPair
from kvtune.testing.reference import STANDARD_MAX_TOKENS, standard_prompts
from kvtune.vllm_pd import DO_REMOTE_PREFILL, REMOTE_ENGINE_ID, REMOTE_PORT, REMOTE_REQUEST_ID

pytestmark = pytest.mark.vllm

CONNECTOR = os.environ.get("KVTUNE_LOCAL_TEST_CONNECTOR", "vllm")


@pytest.fixture(scope="module")
def pair(tmp_path_factory, model_dir, reference):
    work = tmp_path_factory.mktemp("push-pair")
    with LocalPair("push", connector=CONNECTOR, workdir=work, spans_dir=work / "spans",
                   model_dir=model_dir) as p:
        yield p




@pytest.mark.parametrize("index", [0, 2])
def test_push_moves_kv_and_matches_single_instance(pair, reference, index):
    prompt = standard_prompts()[index]
    before = pair.decode_prompt_sources()
    result = pair.complete(prompt, STANDARD_MAX_TOKENS, request_id=f"kvtune-test-push-{index}")
    delta = wait_for_tokens(pair.decode_prompt_sources, before, len(prompt))

    assert result.token_ids == reference.outputs[index]
    params = result.kv_transfer_params  # what the decode was told: the prefill, named up front
    assert params[DO_REMOTE_PREFILL] is True
    assert params[REMOTE_ENGINE_ID] == pair.prefill_engine_id
    assert params[REMOTE_PORT] == pair.prefill_side_channel_port
    assert params[REMOTE_REQUEST_ID] == result.request_id
    # The decode received the prompt's KV (written by the prefill) instead of computing it.
    assert delta.external_kv_transfer_tokens >= len(prompt) - 1
    assert delta.local_compute_tokens <= 1
    assert delta.total_tokens == len(prompt)
    assert result.prefill_ms > 0 and result.decode_ms > 0 and result.ttft_ms > 0


def test_push_with_traceparent_matches_single_instance(pair, reference):
    prompt = standard_prompts()[1]
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    result = pair.complete(prompt, STANDARD_MAX_TOKENS, traceparent=traceparent)
    assert result.token_ids == reference.outputs[1]
