"""The router in bidirectional mode in front of a real vLLM prefill/decode pair on CPU
(``kvtune.local.pair.LocalPair``). Slow: run under ``flock /tmp/kvt/vllm.lock``."""
from __future__ import annotations

import importlib.util

import pytest

from kvtune import spans
from kvtune.router import InstanceConfig, RouterConfig, RouterInThread
from kvtune.router.client import get, post
from kvtune.vllm_pd import KV_TRANSFER_PARAMS, REMOTE_BLOCK_IDS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 8
PROMPT_1 = [(7 * i + 3) % 1900 + 50 for i in range(96)]
"""Token ids of turn 1: long enough for several KV blocks."""


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_router_bidirectional_against_real_cpu_pair(tmp_path):
    pair_mod = pytest.importorskip("kvtune.local.pair", reason="kvtune.local.pair (LocalPair) absent")
    from kvtune.local.server import SEED, SERVED_MODEL_NAME
    from kvtune.local.metrics import prompt_token_sources

    def body(prompt, conv):
        return {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "seed": SEED, "ignore_eos": True, "return_token_ids": True,
                "conversation_id": conv}

    # Threshold 1: pull the decode's history whenever it holds tokens the prefill lacks.
    with pair_mod.LocalPair("bidirectional", connector="vllm", workdir=tmp_path / "pair",
                            recompute_threshold=1) as pair:
        config = RouterConfig(prefill=(InstanceConfig(pair.prefill_url),),
                              decode=(InstanceConfig(pair.decode_url),),
                              mode=spans.Mode.BIDIRECTIONAL, state=f"sqlite:{tmp_path}/state.db",
                              port=0, prefill_timeout_s=300, decode_timeout_s=300)
        reference = pair.complete(PROMPT_1, MAX_TOKENS)  # the pair's own P/D flow, no router
        with RouterInThread(config) as router:
            url = router.url + "/v1/completions"
            d0 = prompt_token_sources(pair.decode_url)
            turn1 = post(url, body(PROMPT_1, "real-conv"), timeout_s=600)
            assert turn1.status == 200, turn1.body
            d1 = prompt_token_sources(pair.decode_url)
            answer1 = turn1.json()
            out_ids = answer1["choices"][0]["token_ids"]
            # The decode returned its retained blocks; the router keeps them for turn 2.
            assert answer1[KV_TRANSFER_PARAMS][REMOTE_BLOCK_IDS]
            prompt2 = PROMPT_1 + list(out_ids) + [(11 * i + 5) % 1900 + 50 for i in range(40)]
            p1 = prompt_token_sources(pair.prefill_url)
            turn2 = post(url, body(prompt2, "real-conv"), timeout_s=600)
            p2 = prompt_token_sources(pair.prefill_url)
            # Turn 3 trims the history (as an agent framework stripping a reasoning block does):
            # the decode's blocks encode turn 2's history, which this prompt does not begin with,
            # so the router must not offer them; the turn is served by recomputing.
            out2 = turn2.json()["choices"][0]["token_ids"]
            prompt3 = PROMPT_1[:40] + PROMPT_1[64:] + list(out2) + [(13 * i + 7) % 1900 + 50
                                                                    for i in range(24)]
            turn3 = post(url, body(prompt3, "real-conv"), timeout_s=600)
            p3 = prompt_token_sources(pair.prefill_url)
            health = get(router.url + "/health").json()
        reference3 = pair.complete(prompt3, MAX_TOKENS)  # no conversation: nothing offered
        logs = pair.logs()
    assert turn2.status == 200, turn2.body
    # Same tokens as the pair's own flow (temperature 0, same seed).
    assert answer1["choices"][0]["text"] == reference.text
    assert len(turn2.json()["choices"][0]["token_ids"]) == MAX_TOKENS
    # Turn 1: the decode loaded the prompt's KV over NIXL instead of computing it.
    assert (d1 - d0).external_kv_transfer_tokens > 0, logs
    # Turn 2: the prefill pulled the conversation's history back from the decode.
    assert (p2 - p1).external_kv_transfer_tokens > 0, logs
    # Turn 3 (trimmed history): nothing pulled, the refusal counted, and the answer is the one
    # computed without reuse (greedy, same seed).
    assert turn3.status == 200, turn3.body
    assert (p3 - p2).external_kv_transfer_tokens == 0, logs
    assert sum(health["reuse_refused_total"].values()) == 1, health
    assert turn3.json()["choices"][0]["text"] == reference3.text
