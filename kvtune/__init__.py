"""kvtune: observe and tune KV-cache transfer in vLLM prefill/decode disaggregated serving."""
from __future__ import annotations

__version__ = "0.1.0"
