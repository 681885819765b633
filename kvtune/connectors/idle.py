"""Bounds how often an engine steps while it only holds finished requests' blocks for a remote.

vLLM keeps stepping an engine as long as its scheduler holds finished requests whose blocks a
remote may still read (``Scheduler.has_requests()``: a prefill until the decode's READ, a
bidirectional decode for the whole ``decoder_kv_blocks_ttl``): one step a millisecond, each
a round trip to the worker process, whose shared-memory queue then spins for a second after every
step. A retaining engine so costs about a core for the TTL while serving nothing.

With ``kv_connector_extra_config.kvtune_idle_wait_ms`` (:data:`EXTRA_CONFIG_KEY`) the connector's
scheduler side, once such idle stepping has lasted ``SETTLE_MS``, waits before the next empty
step for up to that many milliseconds, and wakes at once when a request reaches the engine (it
waits on the engine core's own input queue). What waits meanwhile is only the bookkeeping of held
blocks: the notification that frees them and the lease/TTL checks (their granularity becomes the
wait). A remote READ of the held blocks needs no step of this engine over shared memory or RDMA;
over UCX's TCP transport, which needs the target to progress, it can wait up to the bound.

The engine core object is found by walking up the caller's frames once (vLLM calls
``build_connector_meta`` from ``Scheduler.schedule`` inside ``EngineCore.step``); when it is not
there (in-process tests, another vLLM layout) nothing waits.
"""
from __future__ import annotations

import queue
import sys
import time
from typing import Any, Final

from kvtune.errors import ConnectorError

EXTRA_CONFIG_KEY: Final = "kvtune_idle_wait_ms"
"""``kv_connector_extra_config`` key: longest wait between idle steps, in ms (int > 0)."""
MAX_WAIT_MS: Final = 10_000
SETTLE_MS: Final = 200.0
"""Idle stepping shorter than this is left alone (a READ of fresh blocks, a notification)."""
_FRAMES: Final = 12


def wait_ms_from_extra_config(extra: Any) -> int | None:
    """The configured bound, None when absent; a clear error when invalid."""
    if not isinstance(extra, dict) or extra.get(EXTRA_CONFIG_KEY) is None:
        return None
    value = extra[EXTRA_CONFIG_KEY]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_WAIT_MS:
        raise ConnectorError(f"kv_transfer_config.kv_connector_extra_config.{EXTRA_CONFIG_KEY}: "
                             f"expected an int from 1 to {MAX_WAIT_MS} (ms), got {value!r}")
    return value


def _find_callers(depth: int = _FRAMES) -> tuple[Any, Any]:
    """(scheduler, engine core) among the callers' ``self``: the object with
    ``get_num_unfinished_requests`` and the one with an ``input_queue`` that is a Queue."""
    scheduler = engine = None
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            break
        obj = frame.f_locals.get("self")
        if scheduler is None and hasattr(obj, "get_num_unfinished_requests"):
            scheduler = obj
        if engine is None and isinstance(getattr(obj, "input_queue", None), queue.Queue):
            engine = obj
        frame = frame.f_back
    return scheduler, engine


class IdleStepWait:
    """Called once per scheduler step (``build_connector_meta``); waits on idle steps."""

    def __init__(self, wait_ms: int) -> None:
        self.wait_s = wait_ms / 1000
        self._idle_since: float | None = None
        self._looked = False
        self._scheduler: Any = None
        self._queue: queue.Queue[Any] | None = None
        self.waits = 0

    def after_schedule(self, scheduler_output: Any) -> None:
        if not self._looked:
            self._looked = True
            scheduler, engine = _find_callers()
            self._scheduler = scheduler
            self._queue = engine.input_queue if engine is not None else None
        if self._scheduler is None or self._queue is None:
            return
        now = time.monotonic()
        if not self._idle(scheduler_output):
            self._idle_since = None
            return
        if self._idle_since is None:
            self._idle_since = now
            return
        if (now - self._idle_since) * 1000 < SETTLE_MS:
            return
        q = self._queue
        with q.not_empty:
            if not q._qsize():  # the Queue's own emptiness test, under its lock
                self.waits += 1
                q.not_empty.wait(self.wait_s)

    def _idle(self, scheduler_output: Any) -> bool:
        if getattr(scheduler_output, "total_num_scheduled_tokens", 1) != 0:
            return False
        sched = self._scheduler
        if sched.get_num_unfinished_requests() != 0:
            return False
        connector = getattr(sched, "connector", None)
        pending = getattr(connector, "has_pending_push_work", None)
        return not (callable(pending) and pending())
