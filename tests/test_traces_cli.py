"""`kvtune traces summary`: the library function on its own, the CLI with it patched and for real."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvtune import cli, spans
from kvtune.traces import cli as traces_cli
from kvtune.traces.summary import TraceSummary, summarize

COLLECTOR = Path(__file__).parent / "fixtures" / "traces" / "collector_file_exporter.jsonl"


def test_summarize_counts_by_service_and_name() -> None:
    s = summarize(COLLECTOR)
    assert isinstance(s, TraceSummary)
    assert s.span_count == 4 and s.trace_count == 1
    assert set(s.counts) == {
        ("kvtune-router", spans.SpanName.REQUEST.value, 1),
        ("kvtune-prefill", spans.SpanName.RDMA.value, 1),
        ("kvtune-prefill", spans.SpanName.DESCRIPTOR_SETUP.value, 1),
        ("kvtune-decode", spans.SpanName.NOTIFY.value, 1),
    }
    assert s.hosts == (("node-a", 4),)
    assert s.clock is not None and s.clock.offsets_ns == {"node-a": 0}
    text = s.format()
    assert "4 spans in 1 traces" in text and "kvtune-prefill" in text and "offset 0 ns" in text


def test_cli_parses_and_calls_summarize(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    calls = []

    def fake(source, *, skip_bad=False):
        calls.append((source, skip_bad))
        return summarize(COLLECTOR)

    monkeypatch.setattr(traces_cli, "summarize", fake)
    assert cli.main(["traces", "summary", "a.jsonl", "b/", "--skip-bad"]) == 0
    assert calls == [(["a.jsonl", "b/"], True)]
    assert "4 spans" in capsys.readouterr().out


def test_cli_for_real_and_error_exit(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["traces", "summary", str(COLLECTOR)]) == 0
    assert spans.SpanName.NOTIFY.value in capsys.readouterr().out
    assert cli.main(["traces", "summary", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_register_sets_run() -> None:
    parser = argparse.ArgumentParser()
    traces_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["traces", "summary", "x"])
    assert args.func is traces_cli.run


def test_cli_fleet_parses_and_calls_fleet_summary(monkeypatch, capsys) -> None:
    from kvtune.traces.tempo_metrics import FleetMetrics

    calls = []

    def fake(source):
        calls.append(source)
        return FleetMetrics(0, 86400, {"hit": 3}, {}, {}, requests=24,
                            missing=("reuse: HTTP 404",))

    monkeypatch.setattr(traces_cli, "fleet_summary", fake)
    assert cli.main(["traces", "fleet", "tempo+http://t:3200?since=1d"]) == 0
    assert calls == ["tempo+http://t:3200?since=1d"]
    out, err = capsys.readouterr()
    assert "{'hit': 3}" in out and "tempo_fleet_metrics_partial" in err and "HTTP 404" in err


def test_cli_fleet_against_the_stand_in_fetches_no_trace(capsys) -> None:
    from tempo_standin import serve

    with serve() as (host, state):
        assert cli.main(["traces", "fleet", f"tempo+http://{host}?since=1h"]) == 0
    assert {p for p, _ in state.requests} == {"/api/metrics/query"}
    assert "reuse decisions" in capsys.readouterr().out
