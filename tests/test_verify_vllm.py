"""``kvtune verify`` on the real local vLLM pair (CPU): two configurations, 8 requests each, the
pair restarted per configuration, requests through kvtune's router. Slow (two pair starts); run
alone:
``flock /tmp/kvtune-heavy.lock .venv/bin/python -m pytest -m vllm tests/test_verify_vllm.py``."""
from __future__ import annotations

import pytest

from kvtune import cli
from kvtune.verify import results

pytestmark = pytest.mark.vllm


def test_verify_defaults_against_bidirectional_on_the_local_pair(tmp_path, capsys):
    out = tmp_path / "verify"
    rc = cli.main(["verify", "--config", "defaults", "--config", "bidi=defaults:bidirectional",
                   "--conversations", "4", "--turns", "2", "2", "--think-time", "0.3", "1.0",
                   "--rate", "2", "--starts", "1", "--max-starts", "1", "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err[-3000:]
    res = results.read(out / results.RESULT_FILE)
    assert (out / results.PAGE_FILE).stat().st_size > 100_000  # plotly.js inline
    defaults, bidi = res.configs
    for c in res.configs:
        assert len(c.requests) == 8 and c.n_failed == 0 and c.starts == 1
        assert all(r.ttft_ms is not None and r.ttft_ms > 0 for r in c.requests)
        assert c.ttft_p50 is not None and c.memory
    # pull never pulls history back from the decode; bidirectional turns 2 did (prefill counters)
    assert defaults.reused_tokens == 0
    assert bidi.reused_tokens > 0 and bidi.reuse_captured_share > 0
    (comp,) = res.comparisons
    assert comp.p50 is not None and comp.p50.n_pairs == 8
    assert comp.verdict in capsys.readouterr().out
