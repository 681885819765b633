"""Fixtures shared by the tests: the local vLLM pair's model and reference outputs
(tests/test_local_*.py), a tracer recording into an in-memory exporter (the router tests), a
synthetic spans file (the tune, lab and report tests)."""
from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvtune.local.tiny_model import make_tiny_model
from kvtune.testing.reference import standard_reference


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny local model, built once per test session (cached under the session's basetemp)."""
    return make_tiny_model(tmp_path_factory.getbasetemp() / "kvtune-local-model")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir):
    """Single-instance outputs of the standard prompts and conversations (cached on disk)."""
    return standard_reference(tmp_path_factory.getbasetemp() / "kvtune-local-reference",
                              model_dir=model_dir)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    """The spans ``tracer`` finished, in memory."""
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter):
    """A tracer of its own provider (not the global one), exporting each span to ``exporter``."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("kvtune-tests")
    provider.shutdown()


@pytest.fixture(scope="session")
def spans_file(tmp_path_factory) -> Path:
    """A bidirectional synthetic workload's spans as OTLP JSON lines, written once per session."""
    from kvtune.testing import synthetic
    path = tmp_path_factory.mktemp("spans") / "spans.jsonl"
    synthetic.write_otlp_json(synthetic.SyntheticCase().spans(mode="bidirectional"), path)
    return path


# --- the connector suite per vLLM release (`make test` runs it on each supported release) -------
CONNECTOR_SUITE = ("test_connectors_scheduler.py", "test_connectors_unit.py",
                   "test_connectors_nixl.py")
"""In-process connector tests (real NIXL agents, no engines): the suite run on every release."""
EXPECT_VLLM_ENV = "KVTUNE_EXPECT_VLLM"
"""Set (to e.g. ``0.33.0``) by ``make test`` for the other release: the run fails unless it imported
that vLLM and ran the whole connector suite without skips."""


def _connector_counts(config: pytest.Config) -> dict[str, int]:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter is not None else {}
    counts = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        counts[outcome] = sum(1 for rep in stats.get(outcome, [])
                              if getattr(rep, "nodeid", "").split("::")[0].rsplit("/", 1)[-1]
                              in CONNECTOR_SUITE)
    return counts


def _vllm_version() -> str:
    import sys
    mod = sys.modules.get("vllm")
    return str(getattr(mod, "__version__", "?")) if mod is not None else "not imported"


def _expectation_problem(config: pytest.Config) -> str | None:
    import os
    expected = os.environ.get(EXPECT_VLLM_ENV)
    if not expected:
        return None
    counts = _connector_counts(config)
    if _vllm_version() != expected:
        return f"{EXPECT_VLLM_ENV}={expected} but the tests imported vLLM {_vllm_version()}"
    if counts["skipped"] or not counts["passed"]:
        return (f"{EXPECT_VLLM_ENV}={expected}: {counts['skipped']} connector test(s) skipped, "
                f"{counts['passed']} passed; the suite must run whole on this release")
    return None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    counts = _connector_counts(terminalreporter.config)
    if not any(counts.values()):
        return
    terminalreporter.write_line(
        f"kvtune connector suite on vLLM {_vllm_version()}: {counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped, {counts['error']} errors",
        bold=True)
    problem = _expectation_problem(terminalreporter.config)
    if problem:
        terminalreporter.write_line(f"FAILED: {problem}", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == 0 and _expectation_problem(session.config):
        session.exitstatus = 1
