"""Minimal reproduction of the HTTP 500s seen on this loaded machine (vLLM 0.32.0, CPU build).

A decode's first NIXL handshake with a prefill asks the prefill's side channel for its metadata and
waits 5 s (``zmq.RCVTIMEO = 5000`` in ``NixlBaseConnectorWorker._nixl_handshake``). If the prefill
does not answer within 5 s — here it is stopped with SIGSTOP; on a busy 2-core machine its listener
thread is simply starved — the handshake fails (``handshake_setup_failed``, ``zmq.error.Again``), the
KV load fails, and with vLLM's default ``kv_load_failure_policy: "fail"`` the client gets HTTP 500.
Once the prefill answers again, the next request handshakes and succeeds. kvtune's side of the fix:
``LocalPair`` does every first contact in a retried warm-up (``warmup_transfer=True``).

If this test starts failing because the first decode succeeds, vLLM no longer fails on a slow
first handshake and the retried warm-up may be unnecessary.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvtune.local import client
from kvtune.local.errors import LocalPairError
from kvtune.local.pair import LocalPair, _body
from kvtune.local.tiny_model import make_tiny_model
from kvtune.vllm_pd import DO_REMOTE_DECODE, REMOTE_BLOCK_IDS
from kvtune.testing.reference import random_prompt

pytestmark = pytest.mark.vllm

STOP_S = 8.0
"""How long the prefill is unresponsive: longer than vLLM's 5 s handshake receive timeout."""


def test_first_handshake_with_an_unresponsive_prefill_fails_with_http_500(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.getbasetemp() / "kvtune-local-model")
    work = tmp_path_factory.mktemp("handshake-timeout")
    with LocalPair("pull", connector="vllm", workdir=work, model_dir=model,
                   warmup_transfer=False) as pair:
        prompt = list(random_prompt(60, seed=99))
        headers = {"X-Request-Id": "kvtune-repro"}
        prefill = client.complete(pair.prefill_url, _body(
            prompt, 1, ignore_eos=True, stream=False,
            kv_transfer_params={DO_REMOTE_DECODE: True}), headers=headers, timeout_s=300)
        assert prefill.kv_transfer_params[REMOTE_BLOCK_IDS]
        pgid = pair.prefill.proc.pid  # the prefill server's process group (API server + engine)
        os.killpg(pgid, signal.SIGSTOP)
        resume = threading.Timer(STOP_S, os.killpg, (pgid, signal.SIGCONT))
        try:
            resume.start()
            with pytest.raises(client.HttpError) as err:
                client.complete(pair.decode_url, _body(
                    prompt, 4, ignore_eos=True, stream=False,
                    kv_transfer_params=prefill.kv_transfer_params), headers=headers,
                    timeout_s=120)
        finally:
            resume.join()
            os.killpg(pgid, signal.SIGCONT)
        assert err.value.status == 500
        log = pair.decode.log_path.read_text()
        assert "handshake_setup_failed" in log and "zmq.error.Again" in log
        # Back to normal: the next request handshakes and moves KV.
        before = pair.decode_prompt_sources()
        result = pair.complete(random_prompt(60, seed=98), 4)
        assert len(result.token_ids) == 4
        deadline = time.monotonic() + 30
        while (pair.decode_prompt_sources() - before).external_kv_transfer_tokens < 60:
            assert time.monotonic() < deadline, "decode did not load the prompt's KV"
            time.sleep(0.2)
    with pytest.raises(LocalPairError):
        pair.complete([1, 2, 3], 1)  # stopped pairs refuse requests
