"""The connector classes vLLM loads: ``--kv-transfer-config '{"kv_connector":
"KvtuneNixlPullConnector", "kv_connector_module_path": "kvtune.connectors", ...}'``.

They are vLLM's ``NixlPullConnector`` / ``NixlPushConnector`` with kvtune's scheduler and worker
subclasses in place of vLLM's. When :func:`kvtune.connectors.compat.check` finds a mismatch they
are exactly vLLM's connectors (a warning says so), or they refuse to start when
``kv_connector_extra_config.kvtune_strict`` is true.
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
    NixlPushConnector,
)

from kvtune.connectors import compat
from kvtune.connectors.plain import init_push_connector
from kvtune.connectors.scheduler import KvtunePullScheduler, KvtunePushScheduler
from kvtune.connectors.worker import KvtunePullWorker, KvtunePushWorker


def _instrument(vllm_config: Any) -> bool:
    """Whether to build kvtune's subclasses (raises ConnectorError in strict mode on a mismatch)."""
    cfg = vllm_config.kv_transfer_config
    strict = bool(cfg.get_from_extra_config(compat.STRICT_KEY, False)) if cfg is not None else False
    return compat.check(strict=strict).instrumentable


@compat.instrumented
class KvtuneNixlPullConnector(NixlPullConnector):
    """vLLM's pull (READ) NIXL connector, emitting kvtune's spans (pull and bidirectional)."""

    @compat.overrides("construction")
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        if not _instrument(vllm_config):
            super().__init__(vllm_config, role, kv_cache_config)
            return
        # NixlPullConnector.__init__ with kvtune's scheduler/worker classes.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvtunePullScheduler(vllm_config, self.engine_id,
                                                           kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KvtunePullWorker(vllm_config, self.engine_id, kv_cache_config)


@compat.instrumented
class KvtuneNixlPushConnector(NixlPushConnector):
    """vLLM's push (WRITE) NIXL connector, emitting kvtune's spans."""

    @compat.overrides("construction")
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        if not _instrument(vllm_config):
            super().__init__(vllm_config, role, kv_cache_config)
            return
        init_push_connector(self, vllm_config, role, kv_cache_config,
                            KvtunePushScheduler, KvtunePushWorker)
