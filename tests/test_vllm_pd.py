"""kvtune.vllm_pd: the P/D protocol's names, builders and rules, checked against the installed
vLLM (its NIXL connector sources, its ``KVTransferConfig``, and its real schedulers fed what the
builders make)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from kvtune import spans
from kvtune import vllm_pd as pd
from kvtune.errors import ConfigError, KvtuneError

PREFILL_ENGINE = "pd-test-prefill"
DECODE_ENGINE = "pd-test-decode"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


# --- builders and rules, no vLLM ----------------------------------------------------------------
@pytest.mark.parametrize("mode", pd.MODES)
@pytest.mark.parametrize("connector", ["kvtune", "vllm", "plain"])
def test_kv_transfer_config_per_role_mode_and_family(mode, connector):
    p = pd.kv_transfer_config("prefill", mode, connector=connector, engine_id=PREFILL_ENGINE,
                              extra_config={pd.KV_RECOMPUTE_THRESHOLD: 8})
    d = pd.kv_transfer_config("decode", spans.Mode(mode), connector=connector)
    assert p[pd.KV_CONNECTOR] == d[pd.KV_CONNECTOR] == pd.CONNECTOR_CLASSES[(connector, mode)]
    assert (p[pd.KV_ROLE], d[pd.KV_ROLE]) == (pd.KV_PRODUCER, pd.KV_CONSUMER)
    assert p["engine_id"] == PREFILL_ENGINE and "engine_id" not in d
    assert p.get(pd.KV_CONNECTOR_MODULE_PATH) == pd.CONNECTOR_MODULES[connector]
    assert "kv_buffer_device" not in p
    assert p[pd.KV_CONNECTOR_EXTRA_CONFIG][pd.KV_RECOMPUTE_THRESHOLD] == 8
    bidi = mode == "bidirectional"
    for cfg in (p, d):
        assert cfg[pd.KV_CONNECTOR_EXTRA_CONFIG].get(pd.BIDIRECTIONAL_KV_XFER) is (True if bidi
                                                                                  else None)
    # The caller's own value of the switch wins (the export writes false explicitly).
    off = pd.kv_transfer_config("decode", mode, extra_config={pd.BIDIRECTIONAL_KV_XFER: False})
    assert off[pd.KV_CONNECTOR_EXTRA_CONFIG][pd.BIDIRECTIONAL_KV_XFER] is False


@pytest.mark.parametrize("args, kwargs, match", [
    (("router", "pull"), {}, "role"),
    (("prefill", "probe"), {}, "mode"),
    (("prefill", "pushpull"), {}, "mode"),
    (("decode", "pull"), {"connector": "lmcache"}, "connector"),
    (("decode", "pull"), {"kv_role": "kv_decoder"}, "kv_role"),
])
def test_kv_transfer_config_refuses_bad_input_naming_it(args, kwargs, match):
    with pytest.raises(ConfigError, match=match) as err:
        pd.kv_transfer_config(*args, **kwargs)
    assert isinstance(err.value, KvtuneError)


@pytest.mark.parametrize("mode", pd.MODES)
def test_kv_both_on_either_server_and_each_requests_leg(mode):
    for role in pd.KV_ROLES:
        cfg = pd.kv_transfer_config(role, mode, kv_role=pd.KV_BOTH)
        assert cfg[pd.KV_ROLE] == pd.KV_BOTH
        assert cfg[pd.KV_CONNECTOR] == pd.kv_transfer_config(role, mode)[pd.KV_CONNECTOR]
    assert pd.engine_role(pd.KV_PRODUCER) is spans.Role.PREFILL
    assert pd.engine_role(pd.KV_CONSUMER) is spans.Role.DECODE
    assert pd.engine_role(pd.KV_BOTH) is None  # per request
    # vLLM's rule: do_remote_decode makes a prefill ("P node"), whatever else the params say.
    assert pd.leg_role(pd.prefill_leg_params()) is spans.Role.PREFILL
    assert pd.leg_role({pd.DO_REMOTE_DECODE: True, pd.DO_REMOTE_PREFILL: False,
                        pd.REMOTE_BLOCK_IDS: [[1]]}) is spans.Role.PREFILL
    assert pd.leg_role(pd.push_decode_leg_params(engine_id="p", host="h", port=1,
                                                 request_id="r")) is spans.Role.DECODE
    assert pd.leg_role({}) is None and pd.leg_role(None) is None
    assert pd.leg_role({spans.KV_PARAMS_TRACEPARENT: TRACEPARENT}) is None


def test_leg_builders():
    assert pd.prefill_leg_params() == {pd.DO_REMOTE_DECODE: True}
    retained = {pd.DO_REMOTE_DECODE: True, pd.REMOTE_BLOCK_IDS: [[3, 4]],
                pd.REMOTE_NUM_TOKENS: 150, pd.REMOTE_ENGINE_ID: DECODE_ENGINE}
    assert pd.prefill_leg_params(retained) == retained
    assert pd.prefill_leg_params({**retained, pd.DO_REMOTE_DECODE: False}) == retained
    answer = {pd.DO_REMOTE_PREFILL: True, pd.REMOTE_BLOCK_IDS: [[1]]}
    assert pd.pull_decode_leg_params(answer) == answer
    assert pd.pull_decode_leg_params(answer) is not answer
    with pytest.raises(ConfigError, match=pd.DO_REMOTE_PREFILL):
        pd.pull_decode_leg_params({pd.DO_REMOTE_DECODE: True})
    push = pd.push_decode_leg_params(engine_id=PREFILL_ENGINE, host="127.0.0.1", port="5601",
                                     request_id="r-1", tp_size=2)
    assert push == {pd.DO_REMOTE_PREFILL: True, pd.REMOTE_ENGINE_ID: PREFILL_ENGINE,
                    pd.REMOTE_HOST: "127.0.0.1", pd.REMOTE_PORT: 5601, pd.TP_SIZE: 2,
                    pd.PP_SIZE: 1, pd.REMOTE_REQUEST_ID: "r-1"}
    assert pd.REMOTE_BLOCK_IDS not in push  # the prefill learns the decode's blocks itself
    assert pd.holds_blocks(retained) and not pd.holds_blocks(push)
    assert not pd.holds_blocks({pd.REMOTE_BLOCK_IDS: []}) and not pd.holds_blocks(None)
    assert pd.offered_tokens(retained) == 150
    assert pd.offered_tokens({pd.REMOTE_NUM_TOKENS: True}) is None
    assert pd.offered_tokens(None) is None


def test_with_context_replaces_carriers_echoed_from_an_earlier_turn():
    echoed = {pd.DO_REMOTE_DECODE: True, spans.KV_PARAMS_TRACEPARENT: "old",
              spans.KV_PARAMS_CONVERSATION_ID: "c", spans.KV_PARAMS_TURN: 1}
    assert pd.with_context(echoed) == {pd.DO_REMOTE_DECODE: True}
    out = pd.with_context(echoed, traceparent=TRACEPARENT, conversation_id="c", turn=2)
    assert out == {pd.DO_REMOTE_DECODE: True, spans.KV_PARAMS_TRACEPARENT: TRACEPARENT,
                   spans.KV_PARAMS_CONVERSATION_ID: "c", spans.KV_PARAMS_TURN: 2}
    assert echoed[spans.KV_PARAMS_TURN] == 1  # the input is not changed


@pytest.mark.parametrize("ttl_s, margin_s", [(480, 30.0), (120, 30.0), (44, 11.0), (24, 6.0),
                                             (10, 6.0), (7, 6.0)])
def test_router_margin_and_its_inverse(ttl_s, margin_s):
    assert pd.router_margin_s(ttl_s) == pytest.approx(margin_s)
    router_ttl = ttl_s - margin_s
    assert pd.router_ttl_s(ttl_s) == pytest.approx(router_ttl)
    assert pd.decoder_ttl_for_router_ttl_s(router_ttl) == pytest.approx(ttl_s)


@pytest.mark.parametrize("ttl_s", [0.5, 4, 5, 6])
def test_a_ttl_inside_vllms_readback_margin_is_never_offered(ttl_s):
    """vLLM declines a readback whose blocks expire within 5 s (and the request fails): the router
    keeps that plus a second of slack, so these TTLs leave it nothing to offer."""
    assert pd.MIN_ROUTER_MARGIN_S == pd.READBACK_SAFETY_MARGIN_S + pd.READBACK_SLACK_S
    assert pd.router_ttl_s(ttl_s) == 0.0 and pd.router_margin_s(ttl_s) == ttl_s


def test_progress_delay_applies_to_pull_only():
    assert pd.progress_delay_applies("pull") and pd.progress_delay_applies(spans.Mode.PULL)
    assert not any(pd.progress_delay_applies(m) for m in ("push", "bidirectional",
                                                          spans.Mode.PUSH))


def test_router_config_and_ttl_recommendation_use_the_one_margin():
    from kvtune.router.config import DEFAULT_DECODER_TTL_S, RouterConfig, InstanceConfig

    assert DEFAULT_DECODER_TTL_S == pd.DEFAULT_DECODER_KV_BLOCKS_TTL_S
    cfg = RouterConfig(prefill=(InstanceConfig("http://127.0.0.1:1"),),
                       decode=(InstanceConfig("http://127.0.0.1:2"),), decoder_ttl_s=44.0)
    assert cfg.params_ttl_s == pytest.approx(44.0 - pd.router_margin_s(44.0))


# --- against the installed vLLM's NIXL connector sources -----------------------------------------
def _nixl_sources() -> str:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    nixl = Path(list(spec.submodule_search_locations)[0]) / "distributed" / "kv_transfer" / \
        "kv_connector" / "v1" / "nixl"
    files = sorted(nixl.glob("*.py"))
    assert files, f"no NIXL connector sources under {nixl}"
    return "\n".join(f.read_text() for f in files)


def test_every_param_key_is_one_vllm_reads_or_writes():
    src = _nixl_sources()
    for key in pd.PARAM_KEYS:
        read = re.search(rf'params(\.get\(|\[)"{key}"', src)
        written = re.search(rf'^\s+{key}=', src, re.M)
        assert read or written, f"{key}: neither read nor written by vLLM's NIXL connectors"


@pytest.mark.parametrize("key, default", [
    (pd.KV_RECOMPUTE_THRESHOLD, pd.DEFAULT_KV_RECOMPUTE_THRESHOLD_TOKENS),
    (pd.DECODER_KV_BLOCKS_TTL, pd.DEFAULT_DECODER_KV_BLOCKS_TTL_S),
    (pd.KV_LEASE_DURATION, pd.DEFAULT_KV_LEASE_DURATION_S),
    (pd.NUM_THREADS, pd.DEFAULT_NUM_THREADS),
    (pd.BIDIRECTIONAL_KV_XFER, False),
])
def test_defaults_are_vllms(key, default):
    found = set(re.findall(rf'get_from_extra_config\(\s*"{key}",\s*([\w.]+)', _nixl_sources()))
    assert found == {str(default)}, (key, found)


def test_push_registration_timeout_defaults_to_the_decode_ttl():
    src = _nixl_sources()
    assert re.search(rf'"{pd.PUSH_REGISTRATION_TIMEOUT}",\s*self\.{pd.DECODER_KV_BLOCKS_TTL}', src)


# --- vLLM's real schedulers fed what the builders make --------------------------------------------
def _vllm() -> Any:
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    return torch


def _connector(role: str, mode: str, **extra: Any) -> Any:
    torch = _vllm()
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as nixl
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    cfg = pd.kv_transfer_config(role, mode, connector="vllm",
                                engine_id=PREFILL_ENGINE if role == "prefill" else DECODE_ENGINE,
                                extra_config=extra)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layer_names=["l0"], kv_cache_spec=spec)])
    cls = getattr(nixl, cfg[pd.KV_CONNECTOR])
    return cls(VllmConfig(kv_transfer_config=KVTransferConfig(**cfg)), KVConnectorRole.SCHEDULER,
               kv_cache)


def _request(rid: str, n_tokens: int, params: dict[str, Any]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, list(range(1, n_tokens + 1)),
                   SamplingParams(max_tokens=4, extra_args={pd.KV_TRANSFER_PARAMS: params}), None)


def _blocks(*ids: int) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(blocks=([KVCacheBlock(block_id=i) for i in ids],))


def _finish(conn: Any, req: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
    from vllm.v1.request import RequestStatus

    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return conn.request_finished(req, [block_ids])


def test_vllm_kv_transfer_config_reads_what_the_builder_writes():
    _vllm()
    from vllm.config import KVTransferConfig

    for (role, kv_role), both in zip([*pd.KV_ROLES.items()] * 2, [False] * 2 + [True] * 2):
        cfg = KVTransferConfig(**pd.kv_transfer_config(
            role, "bidirectional", connector="vllm", engine_id="e", kv_buffer_device="cpu",
            extra_config={pd.KV_RECOMPUTE_THRESHOLD: 8, pd.DECODER_KV_BLOCKS_TTL: 30},
            kv_role=pd.KV_BOTH if both else None))
        assert cfg.kv_role == (pd.KV_BOTH if both else kv_role)
        assert cfg.engine_id == "e" and cfg.kv_buffer_device == "cpu"
        assert cfg.get_from_extra_config(pd.BIDIRECTIONAL_KV_XFER, None) is True
        assert cfg.get_from_extra_config(pd.KV_RECOMPUTE_THRESHOLD, None) == 8
        assert cfg.get_from_extra_config(pd.DECODER_KV_BLOCKS_TTL, None) == 30


def test_pull_then_bidirectional_reuse_through_vllms_schedulers():
    prefill = _connector("prefill", "bidirectional", kv_recompute_threshold=8)
    decode = _connector("decode", "bidirectional", decoder_kv_blocks_ttl=60)

    # Turn 1, prefill leg: vLLM's producer answers with what the decode needs.
    p_req = _request("cmpl-t1-0-00000001", 40, pd.with_context(pd.prefill_leg_params(),
                                                                 traceparent=TRACEPARENT))
    assert prefill.get_num_new_matched_tokens(p_req, 0) == (0, False)
    prefill.update_state_after_alloc(p_req, _blocks(1, 2, 3), 0)
    delay, answer = _finish(prefill, p_req, [1, 2, 3])
    assert delay and answer[pd.DO_REMOTE_PREFILL] is True and not answer[pd.DO_REMOTE_DECODE]
    assert answer[pd.REMOTE_ENGINE_ID] == PREFILL_ENGINE
    assert answer[pd.REMOTE_REQUEST_ID] == p_req.request_id
    assert pd.holds_blocks(answer)

    # Turn 1, decode leg: given the answer, vLLM's consumer loads the prompt's KV remotely.
    d_req = _request("cmpl-t1-0-00000002", 40, pd.with_context(
        pd.pull_decode_leg_params(answer), traceparent=TRACEPARENT, conversation_id="c", turn=1))
    n_remote, is_async = decode.get_num_new_matched_tokens(d_req, 0)
    assert is_async and n_remote == 40
    decode.update_state_after_alloc(d_req, _blocks(7, 8, 9), n_remote)
    assert d_req.request_id in decode.connector_scheduler._reqs_need_recv  # vLLM will READ

    # End of turn 1 on the decode: it retains the blocks and says so.
    delay, retained = _finish(decode, d_req, [7, 8, 9])
    assert delay and pd.holds_blocks(retained)
    assert retained[pd.DO_REMOTE_DECODE] is True and retained[pd.REMOTE_ENGINE_ID] == DECODE_ENGINE
    assert retained[pd.REMOTE_BLOCKS_EXPIRY_TIME] is not None
    history = pd.offered_tokens(retained)
    assert history == d_req.num_computed_tokens
    # (Turn 2's pull back through the prefill's scheduler is covered end to end by
    # tests/test_local_bidirectional.py; here vLLM's producer did not match the offered history
    # in-process, not investigated.)


def test_push_decode_leg_is_what_vllms_push_consumer_registers():
    decode = _connector("decode", "push")
    params = pd.push_decode_leg_params(engine_id=PREFILL_ENGINE, host="127.0.0.1", port=5601,
                                       request_id="r-push", tp_size=1, pp_size=1)
    req = _request("cmpl-r-push-0-00000004", 40, pd.with_context(params, traceparent=TRACEPARENT))
    n, is_async = decode.get_num_new_matched_tokens(req, 0)
    assert is_async and n > 0
    decode.update_state_after_alloc(req, _blocks(4, 5, 6), n)
    reg = decode.connector_scheduler._push_pending_registrations[req.request_id]
    assert (reg[pd.REMOTE_ENGINE_ID], reg[pd.REMOTE_HOST], reg[pd.REMOTE_PORT]) == \
        (PREFILL_ENGINE, "127.0.0.1", 5601)
    assert (reg["remote_tp_size"], reg["remote_pp_size"]) == (1, 1)
