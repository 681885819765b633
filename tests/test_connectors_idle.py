"""The idle-step wait (``kvtune_idle_wait_ms``): when it waits, when it does not, what wakes it.

The engine core and scheduler here are stand-ins with the two things the wait reads (vLLM's
``EngineCoreProc.input_queue`` and ``Scheduler.get_num_unfinished_requests``), called the way vLLM
calls ``build_connector_meta``: from the scheduler's ``schedule``, inside the engine's step.
"""
from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest

from kvtune.connectors import idle
from kvtune.connectors.idle import EXTRA_CONFIG_KEY, IdleStepWait, wait_ms_from_extra_config
from kvtune.errors import ConnectorError


class _Scheduler:
    def __init__(self, wait: IdleStepWait) -> None:
        self.wait = wait
        self.unfinished = 0
        self.connector = SimpleNamespace(has_pending_push_work=lambda: False)

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished

    def schedule(self, tokens: int) -> None:
        self.wait.after_schedule(SimpleNamespace(total_num_scheduled_tokens=tokens))


class _EngineCore:
    def __init__(self, scheduler: _Scheduler) -> None:
        self.input_queue: queue.Queue = queue.Queue()
        self.scheduler = scheduler

    def step(self, tokens: int = 0) -> None:
        self.scheduler.schedule(tokens)


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setattr(idle, "SETTLE_MS", 0.0)
    return _EngineCore(_Scheduler(IdleStepWait(wait_ms=10_000)))


def test_busy_steps_never_wait(engine) -> None:
    wait = engine.scheduler.wait
    for _ in range(3):
        engine.step(tokens=5)  # a forward pass
    engine.scheduler.unfinished = 1  # a request waits for remote KV: poll every step
    for _ in range(3):
        engine.step(tokens=0)
    engine.scheduler.unfinished = 0
    engine.scheduler.connector.has_pending_push_work = lambda: True
    for _ in range(3):
        engine.step(tokens=0)
    assert wait.waits == 0


def test_idle_steps_wait_until_a_request_arrives(engine) -> None:
    wait = engine.scheduler.wait
    engine.step()  # first idle step starts the idle period
    assert wait.waits == 0
    threading.Timer(0.3, engine.input_queue.put, args=("request",)).start()
    t0 = time.monotonic()
    engine.step()  # waits (bound 10 s) until the request is queued
    assert wait.waits == 1
    assert time.monotonic() - t0 < wait.wait_s, "the wait did not wake on the new request"
    engine.step()  # the queue holds a request: no wait
    assert wait.waits == 1


def test_wait_ends_at_its_bound(monkeypatch) -> None:
    monkeypatch.setattr(idle, "SETTLE_MS", 0.0)
    engine = _EngineCore(_Scheduler(IdleStepWait(wait_ms=50)))
    engine.step()
    engine.step()
    engine.step()
    assert engine.scheduler.wait.waits == 2


def test_without_an_engine_core_nothing_waits(monkeypatch) -> None:
    monkeypatch.setattr(idle, "SETTLE_MS", 0.0)
    sched = _Scheduler(IdleStepWait(wait_ms=10_000))
    for _ in range(3):
        sched.schedule(0)  # no caller holds an input queue (in-process use)
    assert sched.wait.waits == 0


@pytest.mark.parametrize("extra, expected", [({}, None), ({EXTRA_CONFIG_KEY: None}, None),
                                              ({EXTRA_CONFIG_KEY: 1500}, 1500), (None, None)])
def test_wait_from_extra_config(extra, expected) -> None:
    assert wait_ms_from_extra_config(extra) == expected


@pytest.mark.parametrize("bad", [0, -5, "100", True, 2.5, 10_001])
def test_bad_wait_names_the_field(bad) -> None:
    with pytest.raises(ConnectorError, match=EXTRA_CONFIG_KEY) as info:
        wait_ms_from_extra_config({EXTRA_CONFIG_KEY: bad})
    assert repr(bad) in str(info.value)
