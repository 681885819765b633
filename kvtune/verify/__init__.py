"""``kvtune verify``: prove advice against measured outcomes.

Replay one multi-turn workload (generated, or a recorded ``kvtune.workload/1`` file) through the
kvtune router under several configurations and compare them: TTFT p50/p99 with bootstrap
intervals, reuse captured, decode KV memory held, a paired verdict; and the measured
recompute/pull crossover.

| module | holds |
|---|---|
| ``configs`` | :class:`VerifyConfig`, loading ``defaults`` / tune outputs / config files |
| ``workload_file`` | the recorded workload format |
| ``backends`` | the local pair (restarted per config) or a cluster (operator restarts) |
| ``measure`` | one configuration: router, workload, spans, ``/metrics`` |
| ``stats`` | bootstrap quantiles, paired change, crossover |
| ``crossover`` | the history-length sweep |
| ``verdict`` | comparisons, the verdict sentence, the tune report's entry |
| ``results`` | frozen results and ``verify.json`` |
| ``figures``, ``page`` | the figures and the offline HTML page |
| ``tune_link`` | a verification shown in a tune output directory's report |
| ``run``, ``cli`` | :func:`run_verify` and the command |
"""
from __future__ import annotations

from kvtune.verify.configs import VerifyConfig, load_config
from kvtune.verify.results import VerifyResult, read
from kvtune.verify.run import run_verify

__all__ = ["VerifyConfig", "VerifyResult", "load_config", "read", "run_verify"]
