"""A real vLLM prefill/decode pair on this machine (CPU), a tiny local model, and a workload driver.

Importing this package does not import vLLM: the servers run as subprocesses.

- ``make_tiny_model(dir)``: a random-weight Qwen3/Llama at toy size with an offline tokenizer.
- ``LocalPair(mode, ...)``: prefill + decode vLLM servers and the P/D flow of pull, push or
  bidirectional mode; ``SingleServer`` for reference outputs.
- ``generate`` / ``run_workload``: a multi-turn agent-like workload and its driver.
"""
from __future__ import annotations

from kvtune.local.errors import LocalPairError
from kvtune.local.pair import LocalPair, PairResult, SingleServer
from kvtune.local.tiny_model import make_tiny_model
from kvtune.local.workload import (
    ConversationPlan, HttpTarget, PairTarget, RequestResult, WorkloadConfig, generate, run_workload,
)

__all__ = [
    "ConversationPlan", "HttpTarget", "LocalPair", "LocalPairError", "PairResult", "PairTarget",
    "RequestResult", "SingleServer", "WorkloadConfig", "generate", "make_tiny_model",
    "run_workload",
]
