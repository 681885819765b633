"""A real vLLM prefill/decode pair on this machine (CPU), a tiny local model, and a workload driver.

Importing this package does not import vLLM: the servers run as subprocesses.
"""
from __future__ import annotations

from kvtune.local.tiny_model import make_tiny_model

__all__ = ["make_tiny_model"]
