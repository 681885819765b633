"""kvtune verify end to end without engines: the real router (a subprocess per configuration, its
spans on disk) in front of vLLM stand-ins, through the cluster backend (what an operator is told to
restart), then the JSON and the page. Stand-ins have no ``/metrics``: reuse and memory are n/a."""
from __future__ import annotations


import pytest

from kvtune.local.workload import WorkloadConfig, generate
from kvtune.testing.standin import StandInVllmCluster
from kvtune.verify import results
from kvtune.verify.backends import ClusterBackend
from kvtune.verify.configs import load_config
from kvtune.verify.run import run_verify
from kvtune.vllm_pd import BIDIRECTIONAL_KV_XFER, KV_TRANSFER_PARAMS, REMOTE_BLOCK_IDS

SMALL = WorkloadConfig(n_conversations=3, turns=(2, 2), system_prompt_tokens=4,
                       first_user_tokens=(4, 8), follow_up_tokens=(2, 4), output_tokens=(2, 3),
                       think_time_s=(0.0, 0.05), arrival_rate_per_s=50.0, seed=3)


def test_verify_through_router_and_standins(tmp_path):
    told = []
    with StandInVllmCluster(bidirectional=True) as cluster:
        backend = ClusterBackend([s.instance() for s in cluster.prefill],
                                 [s.instance() for s in cluster.decode],
                                 confirm=lambda cfg, text: told.append((cfg.name, text)))
        res = run_verify([load_config("defaults"), load_config("bidi=defaults:bidirectional")],
                         backend, generate(SMALL), tmp_path / "out", workload="small",
                         starts=2, progress=False)
    # two starts each, in alternating order (A B A B): a start's offset is not read as an effect
    assert [name for name, _ in told] == ["defaults", "bidi", "defaults", "bidi"]
    assert BIDIRECTIONAL_KV_XFER in told[1][1] and cluster.decode[0].instance().url in told[1][1]
    assert [c.config.name for c in res.configs] == ["defaults", "bidi"]
    for c in res.configs:
        assert len(c.requests) == 12 and c.n_failed == 0 and c.starts == 2
        assert sorted({r.start for r in c.requests}) == [0, 1]
        # TTFT comes from the router's kv.request spans, matched by the client's request id
        assert all(r.ttft_ms is not None and r.ttft_ms > 0 for r in c.requests)
        assert c.ttft_p50 is not None and c.ttft_p50.n == 12
        assert c.reused_tokens is None and c.reuse_captured_share is None  # no /metrics here
        assert c.turn2plus_prompt_tokens == sum(r.prompt_tokens for r in c.requests if r.turn > 1)
    (comp,) = res.comparisons
    assert (comp.baseline, comp.candidate) == ("defaults", "bidi") and comp.p50.n_pairs == 12
    assert comp.p50.starts == 2 and comp.p50.detectable_pct is not None
    assert comp.verdict.startswith("bidi ") and "smallest detectable effect" in comp.verdict
    # bidirectional turns 2 were offered the decode's retained history by the router (3 a start)
    bidi_prefills = [r for r in cluster.requests("prefill")
                     if (r.body.get(KV_TRANSFER_PARAMS) or {}).get(REMOTE_BLOCK_IDS)]
    assert len(bidi_prefills) == 6
    back = results.read(tmp_path / "out" / results.RESULT_FILE)
    assert back == res
    page = (tmp_path / "out" / results.PAGE_FILE).read_text()
    assert comp.verdict.split(" (")[0] in page and "plot-comparison" in page


def test_cluster_backend_needs_both_roles():
    from kvtune.errors import ConfigError
    with pytest.raises(ConfigError, match="prefill and one decode"):
        ClusterBackend([], [], confirm=lambda c, t: None)


@pytest.mark.parametrize("aim, budget_s, rounds", [
    (1e-9, None, 3),   # the run can never detect so small an effect: rounds up to max_starts
    (1e9, None, 2),    # it detects any effect after the first starts: none added
    (1e-9, 0.0, 2),    # another round would end past the budget: none added
])
def test_more_starts_while_the_detectable_effect_is_above_the_aim(tmp_path, aim, budget_s,
                                                                   rounds):
    from kvtune.verify.run import MoreStarts
    told = []
    with StandInVllmCluster(bidirectional=True) as cluster:
        backend = ClusterBackend([s.instance() for s in cluster.prefill],
                                 [s.instance() for s in cluster.decode],
                                 confirm=lambda cfg, text: told.append(cfg.name))
        res = run_verify([load_config("defaults"), load_config("bidi=defaults:bidirectional")],
                         backend, generate(SMALL), tmp_path / "out", workload="small", starts=2,
                         more_starts=MoreStarts(aim, max_starts=3, budget_s=budget_s),
                         progress=False)
    assert told == ["defaults", "bidi"] * rounds  # whole rounds, still alternating
    assert [c.starts for c in res.configs] == [rounds, rounds]
    assert res.comparisons[0].p50.starts == rounds


def test_a_round_is_added_only_if_it_and_a_separate_sweep_fit_the_budget():
    from kvtune.verify.run import fits_budget
    # three rounds took 210 s (70 s each): one more ends at 280 s, with a sweep of its own 350 s
    assert fits_budget(210.0, 3, 1, 360.0) and fits_budget(210.0, 3, 2, 360.0)
    assert not fits_budget(280.0, 4, 2, 360.0)  # 420 s: the sweep would end past six minutes
    assert fits_budget(280.0, 4, 1, 360.0)      # the sweep rode on a start: 350 s
    assert fits_budget(1e9, 3, 2, None)
