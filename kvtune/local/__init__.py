"""A real vLLM prefill/decode pair on this machine (CPU), a tiny local model, and a workload driver.

Importing this package does not import vLLM: the servers run as subprocesses.

- ``make_tiny_model(dir)``: a random-weight Qwen3/Llama at toy size with an offline tokenizer.
- ``LocalPair(mode, ...)``: prefill + decode vLLM servers and the P/D flow of pull, push or
  bidirectional mode; ``SingleServer`` for reference outputs.
- ``generate`` / ``run_workload``: a multi-turn agent-like workload and its driver.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtune.local.errors import LocalPairError
    from kvtune.local.pair import LocalPair, PairResult, SingleServer
    from kvtune.local.tiny_model import make_tiny_model
    from kvtune.local.workload import (
        ConversationPlan, HttpTarget, PairTarget, RequestResult, WorkloadConfig, generate,
        run_workload,
    )

_HOMES = {
    "LocalPairError": "errors", "LocalPair": "pair", "PairResult": "pair", "SingleServer": "pair",
    "make_tiny_model": "tiny_model", "ConversationPlan": "workload", "HttpTarget": "workload",
    "PairTarget": "workload", "RequestResult": "workload", "WorkloadConfig": "workload",
    "generate": "workload", "run_workload": "workload",
}
"""Where each public name lives. They are imported on first use, so that importing one light
module of this package (``kvtune.local.layout``, which the recommendations read) does not import
the pair, the router and aiohttp with it (0.3 s in each notebook kernel of `kvtune tune`)."""

__all__ = [
    "ConversationPlan", "HttpTarget", "LocalPair", "LocalPairError", "PairResult", "PairTarget",
    "RequestResult", "SingleServer", "WorkloadConfig", "generate", "make_tiny_model",
    "run_workload",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvtune.local' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvtune.local.{home}"), name)
    globals()[name] = value
    return value
