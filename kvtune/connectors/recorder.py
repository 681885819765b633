"""Finished spans recorded on vLLM's threads, built and exported on one background thread.

On the engine loop a connector hook only appends a tuple of plain values (names, ids, ns
timestamps, a parent context, an attribute builder) to a deque: :meth:`SpanRecorder.record`.
A daemon thread (``kvtune-span-builder``) drains the deque every ``interval_s`` or as soon as
``batch`` records wait, and turns each record into an OpenTelemetry span (start, attributes,
end, hand-off to the telemetry's batch processor) through the record's own ``build`` callable.

* Nothing is lost at exit or on close: :meth:`SpanRecorder.drain` builds what is queued on the
  caller's thread (the emitter's ``flush``, vLLM's connector ``shutdown`` and an ``atexit`` hook
  call it before the telemetry's exporters flush).
* A build that raises is counted in ``failures`` and logged once (then at debug level); the
  other records are still built. Serving never sees it.
* The queue is bounded (``max_pending``): beyond it new records are dropped and counted in
  ``dropped``, so a stuck exporter cannot grow an engine's memory.
* After ``fork`` the child starts with an empty queue and its own thread (made on first use).
"""
from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Any, Final

_logger = logging.getLogger("kvtune.connectors")

DEFAULT_INTERVAL_S: Final = 0.05
"""How often the builder thread wakes to drain the queue (at most this much later a span is built)."""
DEFAULT_BATCH: Final = 256
"""Records that wake the builder thread early."""
DEFAULT_MAX_PENDING: Final = 100_000
"""Records held before new ones are dropped (counted in ``dropped``)."""
THREAD_NAME: Final = "kvtune-span-builder"

Record = tuple[Any, ...]
"""``(build, ...)``: ``build(record)`` makes and ends one span (one tuple: one allocation on the
engine thread)."""


class SpanRecorder:
    """A bounded queue of span records and the daemon thread that builds them.

    ``interval_s`` None: no thread; records wait for :meth:`drain` (benches, tests).
    """

    def __init__(self, interval_s: float | None = DEFAULT_INTERVAL_S, batch: int = DEFAULT_BATCH,
                 max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if interval_s is not None and interval_s <= 0:
            raise ValueError(f"SpanRecorder interval_s: expected > 0 or None, got {interval_s!r}")
        if batch < 1 or max_pending < 1:
            raise ValueError(f"SpanRecorder batch and max_pending: expected >= 1, got {batch!r}, "
                             f"{max_pending!r}")
        self.interval_s = interval_s
        self.batch = batch
        self.max_pending = max_pending
        self._queue: deque[Record] = deque()
        self._build_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self.dropped = 0
        """Records dropped because ``max_pending`` were already waiting."""
        self.failures = 0
        """Records whose build raised (the span is lost, nothing else)."""
        self.built = 0
        """Records built so far."""

    # --- engine threads ---------------------------------------------------------------------
    def record(self, record: Record) -> None:
        """Queue ``record[0](record)`` for the builder thread (an append and two tests)."""
        q = self._queue
        n = len(q)
        if n >= self.max_pending:
            self.dropped += 1
            return
        q.append(record)
        if self._thread is None and self.interval_s is not None:
            self._start()
        elif n + 1 == self.batch:
            self._wake.set()

    def pending(self) -> int:
        """Records waiting to be built."""
        return len(self._queue)

    # --- builder ----------------------------------------------------------------------------
    def drain(self) -> int:
        """Build every record queued so far, on the caller's thread; returns how many."""
        n = 0
        q = self._queue
        with self._build_lock:
            while True:
                try:
                    record = q.popleft()
                except IndexError:
                    break
                n += 1
                try:
                    record[0](record)
                except Exception:  # telemetry never breaks the host
                    self._failed()
        self.built += n
        return n

    def close(self) -> None:
        """Stop the builder thread after it built everything queued (idempotent)."""
        self._closed = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)
        self.drain()

    def _failed(self) -> None:
        self.failures += 1
        if self.failures == 1:
            _logger.warning("kvtune: building a span on the %s thread failed; serving is "
                            "unaffected and later failures are counted, logged at debug level",
                            THREAD_NAME, exc_info=True)
        else:
            _logger.debug("kvtune: building a span failed", exc_info=True)

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is not None or self._closed:
                return
            thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread = thread
            thread.start()

    def _run(self) -> None:
        interval = self.interval_s
        while not self._closed:
            self._wake.wait(interval)
            self._wake.clear()
            try:
                self.drain()
            except Exception:  # pragma: no cover - drain guards each build already
                _logger.debug("kvtune: span builder loop failed", exc_info=True)

    def _after_fork_in_child(self) -> None:
        self._queue = deque()
        self._build_lock = threading.Lock()
        self._wake = threading.Event()
        self._start_lock = threading.Lock()
        self._thread = None


_PROCESS: SpanRecorder | None = None
_PROCESS_LOCK = threading.Lock()


def process_recorder() -> SpanRecorder:
    """The recorder of this process (one builder thread however many connectors)."""
    global _PROCESS
    rec = _PROCESS
    if rec is None:
        with _PROCESS_LOCK:
            if _PROCESS is None:
                _PROCESS = SpanRecorder()
            rec = _PROCESS
    return rec


def _reset_after_fork() -> None:
    if _PROCESS is not None:
        _PROCESS._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
