"""The lab's regimes (kvtune.local.regime): what each one's caches hold against its traffic."""
from __future__ import annotations

import dataclasses

import pytest

from kvtune.errors import ConfigError
from kvtune.local.regime import (BLOCK_TOKENS, DEFAULT_REGIME, FLEET, FLEET_FIRST_PROMPT_TOKENS,
                                 REGIMES, WARM, log_spaced, regime)
from kvtune.tune.sources import workload_plans


def test_fleet_prefill_holds_a_fraction_of_the_histories_the_decode_holds_them_all():
    assert DEFAULT_REGIME is FLEET and FLEET.turn_major
    working = FLEET.working_set_blocks()
    assert working >= 3 * FLEET.prefill_kv_blocks  # later turns find their history evicted
    assert FLEET.decode_kv_blocks >= 2 * working  # bidirectional retention of every one fits
    # between two turns of any conversation, the others' prompts pass through the prefill
    plans = workload_plans(FLEET)
    for p in plans:
        others = sum(len(q.turns[0].user_tokens) for q in plans if q is not p)
        assert others >= 2 * FLEET.prefill_kv_blocks * BLOCK_TOKENS
    assert FLEET.conversations == FLEET.verify_conversations  # tune and verify: the same gaps


def test_warm_prefill_keeps_every_history():
    assert WARM.prefill_kv_blocks >= 2 * WARM.working_set_blocks()
    assert not WARM.turn_major and WARM.parallel_conversations == 2


def test_fleet_sizes_spread_in_log_and_every_prefix_spans_the_range():
    sizes = FLEET.first_prompt_tokens
    assert (min(sizes), max(sizes)) == FLEET_FIRST_PROMPT_TOKENS == (512, 2560)
    assert sorted(log_spaced(512, 2560, 32)) == sorted(sizes) and len(set(sizes)) == len(sizes)
    first4 = sorted(sizes[:4])
    assert first4[0] <= 640 and first4[-1] >= 1700
    # tune's and verify's traffic: the same sizes, other tokens
    a, b = workload_plans(FLEET, seed=0), workload_plans(FLEET, seed=1)
    assert [len(p.turns[0].user_tokens) for p in a] == [len(p.turns[0].user_tokens) for p in b]
    assert a[0].turns[0].user_tokens != b[0].turns[0].user_tokens


def test_bad_regimes_are_refused_naming_what():
    with pytest.raises(ConfigError, match=r"expected one of \['fleet', 'warm'\]"):
        regime("cold")
    assert regime("fleet") is FLEET and regime(WARM) is WARM and set(REGIMES) == {"fleet", "warm"}
    with pytest.raises(ConfigError, match="prefill_kv_blocks - 1.*max_model_len"):
        dataclasses.replace(FLEET, prefill_kv_blocks=24)  # vLLM would refuse to start
    with pytest.raises(ConfigError, match="longest conversation"):
        dataclasses.replace(FLEET, first_prompt_tokens=(64, 3000))
