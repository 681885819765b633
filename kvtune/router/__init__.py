"""kvtune's KV-aware multi-turn router: an OpenAI-compatible proxy in front of vLLM prefill and
decode instances (pull, push, bidirectional), with durable per-conversation state and one trace per
request. Configuration keys: :mod:`kvtune.router.config`; flows: :mod:`kvtune.router.server`."""
from __future__ import annotations

from kvtune.router.config import InstanceConfig, RouterConfig, config_from_dict, load_config, write_config
from kvtune.router.process import RouterInThread, RouterProcess
from kvtune.router.state import (ConversationStore, RedisConversationStore, SqliteConversationStore,
                                 StateStoreError, TurnStart, open_store)

__all__ = [
    "ConversationStore", "InstanceConfig", "RedisConversationStore", "RouterConfig",
    "RouterInThread", "RouterProcess", "SqliteConversationStore", "StateStoreError", "TurnStart",
    "config_from_dict", "load_config", "open_store", "write_config",
]
