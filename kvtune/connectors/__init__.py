"""Instrumented vLLM NIXL connectors: vLLM's own pull and push connectors, emitting one span per
phase of every KV transfer (see :mod:`kvtune.spans`).

Load them in vLLM with ``--kv-transfer-config '{"kv_connector": "KvtuneNixlPullConnector",
"kv_connector_module_path": "kvtune.connectors", ...}'`` (or ``KvtuneNixlPushConnector``). vLLM is
imported only when one of the two classes is first looked up; :mod:`kvtune.connectors.ids` and
:mod:`kvtune.connectors.compat` import without it.
"""
from __future__ import annotations

from typing import Any

from kvtune.connectors.ids import base_request_id

__all__ = ["KvtuneNixlPullConnector", "KvtuneNixlPushConnector", "base_request_id"]

_LAZY = ("KvtuneNixlPullConnector", "KvtuneNixlPushConnector")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvtune.connectors import connector
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
