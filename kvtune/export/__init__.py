"""Write a recommendation as the files vLLM and the kvtune router take as they are."""
from __future__ import annotations

from kvtune.export.files import (FILES, NEVER_THRESHOLD_TOKENS, kv_transfer_configs,
                                 router_config, serve_args, write)
from kvtune.export.model import PLACEHOLDER, ModelName, resolve as model_name

__all__ = ["FILES", "NEVER_THRESHOLD_TOKENS", "PLACEHOLDER", "ModelName", "kv_transfer_configs",
           "model_name", "router_config", "serve_args", "write"]
