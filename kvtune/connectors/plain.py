"""vLLM's own NIXL connectors, uninstrumented, with kvtune's NIXL agent settings applied.

The yardstick for kvtune's instrumentation: ``PlainNixlPullConnector`` / ``PlainNixlPushConnector``
are vLLM's ``NixlPullConnector`` / ``NixlPushConnector`` with vLLM's own scheduler and worker; the
differences are the layout settings of ``kv_connector_extra_config`` that kvtune's connectors also
honour: the worker's NIXL agent (``kvtune_nixl_progress_thread``, ``kvtune_progress_delay_us``;
:mod:`kvtune.connectors.progress`) and the wait between idle steps (``kvtune_idle_wait_ms``;
:mod:`kvtune.connectors.idle`). Compared side by side with
``KvtuneNixlPullConnector`` on the same layout, any difference in latency is the instrumentation's.
No kvtune code runs on any request path here.
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
    NixlPushConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
    NixlPushConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from kvtune.connectors.idle import IdleStepWait, wait_ms_from_extra_config
from kvtune.connectors.progress import agent_settings_of
from kvtune.vllm_pd import KV_CONNECTOR_EXTRA_CONFIG


def _idle_wait(vllm_config: Any) -> IdleStepWait | None:
    extra = getattr(vllm_config.kv_transfer_config, KV_CONNECTOR_EXTRA_CONFIG, None)
    wait_ms = wait_ms_from_extra_config(extra)
    return IdleStepWait(wait_ms) if wait_ms is not None else None


class _IdleWaitHook:
    """Mixed into vLLM's scheduler classes (before them in the MRO): the layout's idle wait."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)  # vLLM's scheduler (MRO)
        self._idle_wait = _idle_wait(vllm_config)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        if self._idle_wait is not None:
            self._idle_wait.after_schedule(scheduler_output)
        return meta


class _PlainPullScheduler(_IdleWaitHook, NixlPullConnectorScheduler):
    pass


class _PlainPushScheduler(_IdleWaitHook, NixlPushConnectorScheduler):
    pass


class _PlainPullWorker(NixlPullConnectorWorker):
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        with agent_settings_of(vllm_config, push=False):
            super().__init__(vllm_config, engine_id, kv_cache_config)


class _PlainPushWorker(NixlPushConnectorWorker):
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        with agent_settings_of(vllm_config, push=True):
            super().__init__(vllm_config, engine_id, kv_cache_config)


class PlainNixlPullConnector(NixlPullConnector):
    """vLLM's pull (READ) connector; only its NIXL agent's settings come from kvtune."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = _PlainPullScheduler(vllm_config, self.engine_id,
                                                           kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = _PlainPullWorker(vllm_config, self.engine_id, kv_cache_config)


class PlainNixlPushConnector(NixlPushConnector):
    """vLLM's push (WRITE) connector; only its NIXL agent's settings come from kvtune."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        init_push_connector(self, vllm_config, role, kv_cache_config,
                            _PlainPushScheduler, _PlainPushWorker)


def init_push_connector(connector: NixlPushConnector, vllm_config: Any, role: KVConnectorRole,
                        kv_cache_config: Any, scheduler_cls: type, worker_cls: type) -> None:
    """vLLM's ``NixlPushConnector.__init__`` with other scheduler/worker classes (vLLM's builds
    its own there, so a subclass cannot swap them after ``super().__init__``)."""
    NixlBaseConnector.__init__(connector, vllm_config, role, kv_cache_config)
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        raise ValueError(
            "NixlPushConnector does not support decode_context_parallel_size > 1.")
    connector.connector_scheduler = None
    connector.connector_worker = None
    if role == KVConnectorRole.SCHEDULER:
        connector.connector_scheduler = scheduler_cls(vllm_config, connector.engine_id,
                                                      kv_cache_config)
    elif role == KVConnectorRole.WORKER:
        connector.connector_worker = worker_cls(vllm_config, connector.engine_id, kv_cache_config)
    else:
        raise ValueError(f"Unsupported KVConnectorRole: {role}")
