"""NIXL's progress thread: spinning by default, sleeping with ``kvtune_progress_delay_us``.

Real NIXL agents in this process (UCX over loopback/shared memory): the thread a default agent
starts is runnable all the time (it spins), the thread of an agent built under
``progress_delay`` sleeps, and a READ between two sleeping agents still completes with the
right bytes.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

from kvtune.errors import ConnectorError, KvtuneError

pytest.importorskip("nixl")
pytest.importorskip("vllm")

from kvtune.connectors.progress import (
    EXTRA_CONFIG_KEY,
    THREAD_KEY,
    AgentSettings,
    _agent_module,
    agent_settings,
    delay_from_extra_config,
    progress_delay,
    settings_of,
    thread_from_extra_config,
)
from kvtune.vllm_pd import BIDIRECTIONAL_KV_XFER, KV_CONSUMER, KV_PRODUCER

SAMPLES = 60


@pytest.mark.parametrize("extra, expected", [({}, None), ({EXTRA_CONFIG_KEY: None}, None),
                                              ({EXTRA_CONFIG_KEY: 0}, 0),
                                              ({EXTRA_CONFIG_KEY: 1000}, 1000), (None, None)])
def test_delay_from_extra_config(extra, expected) -> None:
    assert delay_from_extra_config(extra) == expected


@pytest.mark.parametrize("bad", ["1000", -1, True, 1.5, 2_000_000])
def test_bad_delay_names_the_field(bad) -> None:
    with pytest.raises(ConnectorError, match=EXTRA_CONFIG_KEY) as info:
        delay_from_extra_config({EXTRA_CONFIG_KEY: bad})
    assert isinstance(info.value, KvtuneError) and repr(bad) in str(info.value)


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _running_share(tids: set[int]) -> float:
    """Share of samples in which one of ``tids`` is running or runnable (state R)."""
    hits = 0
    for _ in range(SAMPLES):
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state == "R":
                hits += 1
                break
        time.sleep(0.01)
    return hits / SAMPLES


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    before = _threads()
    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    time.sleep(0.2)
    return agent, _threads() - before


def test_default_agent_spins_and_delayed_agent_sleeps() -> None:
    spinning, spin_tids = _agent("kvtune-test-spin")
    assert spin_tids, "NIXL started no thread for its UCX backend"
    spin_share = _running_share(spin_tids)
    del spinning
    module = _agent_module()
    real = module.nixlBind
    with progress_delay(1000):
        assert module.nixlBind is not real
        sleeping, sleep_tids = _agent("kvtune-test-sleep")
    assert module.nixlBind is real  # restored: later agents are NIXL's default again
    sleep_share = _running_share(sleep_tids)
    print(f"progress thread runnable in {spin_share:.0%} of samples by default, "
          f"{sleep_share:.0%} with a 1000 us delay", file=sys.stderr)
    assert spin_share >= 0.8
    assert sleep_share <= 0.3
    del sleeping


def _read_and_notify(a, b, reader: str, target: str) -> None:
    """One 64 KiB READ by ``a`` from ``b`` with a notification; both sides call NIXL until the
    bytes and the notification arrived (the target's own calls advance it when it has no
    progress thread)."""
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    reg_b = b.register_memory([(int(src.ctypes.data), src.nbytes, 0, "")], "DRAM")
    reg_a = a.register_memory([(int(dst.ctypes.data), dst.nbytes, 0, "")], "DRAM")
    try:
        a.add_remote_agent(b.get_agent_metadata())
        b.add_remote_agent(a.get_agent_metadata())
        local = a.get_xfer_descs([(int(dst.ctypes.data), dst.nbytes, 0)], "DRAM")
        remote = b.get_xfer_descs([(int(src.ctypes.data), src.nbytes, 0)], "DRAM")
        handle = a.initialize_xfer("READ", local, remote, target, b"done")
        assert a.transfer(handle) in ("PROC", "DONE")
        deadline = time.monotonic() + 60
        state = a.check_xfer_state(handle)
        notifs: dict = {}
        while time.monotonic() < deadline and (state == "PROC" or not notifs.get(reader)):
            for k, v in b.get_new_notifs().items():
                notifs.setdefault(k, []).extend(v)
            if state == "PROC":
                state = a.check_xfer_state(handle)
        assert state == "DONE"
        assert np.array_equal(dst, src)
        assert notifs[reader] == [b"done"]
        a.release_xfer_handle(handle)
    finally:
        a.deregister_memory(reg_a)
        b.deregister_memory(reg_b)


def test_read_between_sleeping_agents_completes() -> None:
    with progress_delay(1000):
        a, _ = _agent("kvtune-test-reader")
        b, _ = _agent("kvtune-test-target")
    _read_and_notify(a, b, "kvtune-test-reader", "kvtune-test-target")


@pytest.mark.parametrize("push, bidirectional, expected", [(False, False, 1000), (True, False, None),
                                                          (False, True, None)])
def test_connectors_apply_the_delay_in_pull_mode_only(push, bidirectional, expected, caplog) -> None:
    from types import SimpleNamespace

    extra = {EXTRA_CONFIG_KEY: 1000, BIDIRECTIONAL_KV_XFER: bidirectional}
    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role=KV_CONSUMER,
                                                             kv_connector_extra_config=extra))
    assert settings_of(cfg, push=push) == AgentSettings(delay_us=expected)
    if expected is None:
        assert any("pull mode only" in r.getMessage() for r in caplog.records)
    bad = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_role=KV_PRODUCER, kv_connector_extra_config={EXTRA_CONFIG_KEY: "fast"}))
    with pytest.raises(ConnectorError, match=EXTRA_CONFIG_KEY):
        settings_of(bad, push=push)


@pytest.mark.parametrize("value, expected", [(None, None), (False, False), (True, True)])
def test_progress_thread_setting(value, expected) -> None:
    assert thread_from_extra_config({THREAD_KEY: value}) is expected
    assert AgentSettings(progress_thread=expected).span_value == (-1 if expected is False else 0)
    with pytest.raises(ConnectorError, match=THREAD_KEY):
        thread_from_extra_config({THREAD_KEY: "no"})


def test_agent_without_progress_thread_starts_no_thread_and_reads() -> None:
    """``kvtune_nixl_progress_thread: false``: nothing the agents start keeps a core busy (UCX may
    start its process-wide async-event thread, which sleeps), and a READ completes when both sides
    call into NIXL (vLLM's worker does, every engine step)."""
    with agent_settings(AgentSettings(progress_thread=False)):
        a, a_tids = _agent("kvtune-test-noprog-reader")
        b, b_tids = _agent("kvtune-test-noprog-target")
    share = _running_share(a_tids | b_tids) if a_tids | b_tids else 0.0
    assert share <= 0.3, f"a thread of an agent without a progress thread was runnable in {share:.0%}"
    _read_and_notify(a, b, "kvtune-test-noprog-reader", "kvtune-test-noprog-target")
