"""Telemetry never breaks serving: with the OTLP endpoint down and kvtune hooks raising, a real
vLLM pair still serves, its outputs equal a single-instance run, the KV still moves, and each
process logs exactly one kvtune warning.

The hooks are made to raise with the test-only ``KVTUNE_TEST_FAIL_HOOKS`` variable
(:mod:`kvtune.connectors.observer`); the OTLP exporter points at a closed port on 127.0.0.1.
"""
from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtune import spans
from kvtune.connectors.ids import derived_span_context
from kvtune.connectors.observer import ENV_FAIL_HOOKS, Emitter
from _net import free_port

WARNING_TEXT = "kvtune: instrumentation hook"
FAILING_HOOKS = "scheduler.meta,scheduler.finished,worker.read,worker.notify"
"""Hooks on the engine loop of both schedulers and both workers (pull mode)."""
STARTUP_TIMEOUT_S = 900.0
MAX_TOKENS = 8
PROMPTS = (tuple(range(40, 130)), tuple(range(700, 760)))


def test_dead_otlp_endpoint_does_not_raise_in_process() -> None:
    from kvtune import telemetry

    tel = telemetry.setup(spans.Role.DECODE, otlp_endpoint=f"http://127.0.0.1:{free_port()}",
                          otlp_protocol="http/protobuf", batch=False, otlp_timeout_s=2.0)
    try:
        em = Emitter(spans.Role.DECODE, spans.Mode.PULL, "eng", tracer=tel.tracer,
                     telemetry=tel)
        em.emit(spans.SpanName.NOTIFY, derived_span_context("r"), 1, 2)  # export fails quietly
        em.flush()
        assert tel.dropped_spans >= 1
    finally:
        tel.shutdown()


@pytest.mark.vllm
class TestServingSurvivesTelemetryFailures:
    @pytest.fixture(scope="class", autouse=True)
    def patient_startup(self) -> Iterator[None]:
        """Servers have needed over 300 s to start at load average 16 on this 2-core machine."""
        pytest.importorskip("vllm")
        from kvtune.local import server

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(server, "wait_healthy", functools.partial(server.wait_healthy,
                                                                 timeout_s=STARTUP_TIMEOUT_S))
            yield

    @pytest.fixture(scope="class")
    def workdir(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return tmp_path_factory.mktemp("connectors-failure")

    @pytest.fixture(scope="class")
    def reference(self, workdir: Path) -> dict[tuple[int, ...], tuple[int, ...]]:
        pytest.importorskip("vllm")
        from kvtune.local.pair import SingleServer

        with SingleServer(workdir=workdir / "single") as single:
            return {p: single.complete(list(p), MAX_TOKENS).token_ids for p in PROMPTS}

    @pytest.fixture(scope="class")
    def pair(self, workdir: Path, reference: dict) -> Iterator[object]:
        from kvtune.local.pair import LocalPair

        env = {ENV_FAIL_HOOKS: FAILING_HOOKS,
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_BSP_SCHEDULE_DELAY": "100"}
        with LocalPair("pull", connector="kvtune", workdir=workdir / "pull",
                       spans_dir=workdir / "spans", extra_env=env) as p:
            yield p

    def test_outputs_identical_kv_moved_one_warning_per_process(
            self, pair: object, reference: dict, workdir: Path) -> None:
        for i, prompt in enumerate(PROMPTS):
            before = pair.decode_prompt_sources()
            result = pair.complete(list(prompt), MAX_TOKENS, request_id=f"fail-{i}")
            after = pair.decode_prompt_sources()
            assert result.token_ids == reference[prompt]
            assert after.external_kv_transfer_tokens - before.external_kv_transfer_tokens \
                >= len(prompt) - 1
            assert after.local_compute_tokens - before.local_compute_tokens <= 1
        for role in ("prefill", "decode"):
            log = (workdir / "pull" / role / "vllm.log").read_text(errors="replace")
            # vLLM prefixes its subprocesses' output with "(EngineCore pid=N)" / "(Worker pid=N)".
            per_process = Counter(
                m.group(1) for m in re.finditer(r"^\((\w+) pid=\d+\)[^\n]*" + re.escape(WARNING_TEXT),
                                                log, re.MULTILINE))
            unprefixed = sum(1 for line in log.splitlines()
                             if line.startswith(WARNING_TEXT))
            assert sum(per_process.values()) + unprefixed >= 1, f"{role}: no kvtune warning"
            assert all(n == 1 for n in per_process.values()), (role, per_process)
