"""The hang watchdog of the local pair: a leg that outlives its bound gets every thread's stack of
every process of the servers' sessions written to disk; a leg that ends in time gets nothing.

A real process (its own session, like a vLLM server) stands in for a hung server: it sits in a
function whose name the dump must show.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from kvtune.local.watchdog import StackWatchdog, _py_spy, session_pids

STUCK = textwrap.dedent("""
    import time
    def kvtune_stuck_here():
        while True:
            time.sleep(0.05)
    kvtune_stuck_here()
""")


@pytest.fixture
def stuck_server():
    proc = subprocess.Popen([sys.executable, "-c", STUCK], start_new_session=True)
    try:
        time.sleep(0.5)  # let it reach the function
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_leg_past_its_bound_dumps_every_thread(tmp_path, stuck_server) -> None:
    wd = StackWatchdog(tmp_path / "stacks", leaders=lambda: [stuck_server.pid], bound_s=0.2)
    assert session_pids(lambda: [stuck_server.pid]) == [stuck_server.pid]
    with wd.watch("decode leg req-1"):
        deadline = time.monotonic() + 60
        while not wd.dumps and time.monotonic() < deadline:  # the leg "hangs" until dumped
            time.sleep(0.05)
    assert len(wd.dumps) == 1
    dump = wd.dumps[0]
    assert dump.leg == "decode leg req-1" and dump.elapsed_s >= 0.2
    (path,) = dump.files
    text = path.read_text()
    assert f"pid {stuck_server.pid}:" in text
    assert f"thread {stuck_server.pid} " in text and "state" in text and "wchan" in text
    if _py_spy() is not None:
        assert "kvtune_stuck_here" in text, text[-2000:]


def test_a_leg_within_its_bound_dumps_nothing(tmp_path, stuck_server) -> None:
    wd = StackWatchdog(tmp_path / "stacks", leaders=lambda: [stuck_server.pid], bound_s=30)
    with wd.watch("prefill leg"):
        pass
    time.sleep(0.1)
    assert wd.dumps == [] and not (tmp_path / "stacks").exists()


def test_bound_must_be_positive(tmp_path) -> None:
    with pytest.raises(ValueError, match="bound_s"):
        StackWatchdog(tmp_path, leaders=list, bound_s=0)
