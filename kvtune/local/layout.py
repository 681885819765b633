"""How the local pair sits on this machine's cores, and how its NIXL agents make progress.

Two layouts, both real vLLM and real NIXL; they differ only in settings vLLM and NIXL expose:

- ``PINNED`` (what the pair did before): each engine's OpenMP thread bound to its own core
  (``VLLM_CPU_OMP_THREADS_BIND``), so every thread its worker starts inherits that one core, and
  NIXL's default agent (a UCX progress thread that spins, plus vLLM's 4 UCX worker threads).
- ``QUIET`` (the default): no core binding (one OpenMP thread per engine, ``OMP_NUM_THREADS=1``;
  the kernel places every thread on whichever core is free), and NIXL agents without a progress
  thread (``kvtune_nixl_progress_thread: false``, ``num_threads: 0``): UCX advances inside the
  engine's own NIXL calls, which vLLM makes every engine step while a transfer or a lease is
  pending. Nothing spins while the pair is idle.

Why (measured on this 2-core machine, see ``kvtune/local/README.md``): pinned, a worker's helper
threads (NIXL's progress thread, vLLM's handshake and push-writer threads) share one core with the
engine thread, and when two of them contend for a spin lock held by a preempted thread, requests
stall for seconds to minutes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from kvtune.connectors.idle import EXTRA_CONFIG_KEY as IDLE_WAIT_KEY
from kvtune.connectors.progress import EXTRA_CONFIG_KEY as PROGRESS_DELAY_KEY
from kvtune.connectors.progress import RECOMMENDED_DELAY_US, THREAD_KEY


@dataclass(frozen=True)
class PairLayout:
    """Core placement and NIXL progress settings of both servers of a local pair."""

    name: str
    pin_cores: bool
    """Bind each engine's OpenMP thread (and so its worker's threads) to its own core."""
    nixl_progress_thread: bool
    """NIXL's UCX progress thread (spinning, NIXL's default) or none (engine-driven progress)."""
    pull_progress_delay_us: int | None = None
    """Pull mode only: the progress thread sleeps this long between polls (``kvtune_progress_
    delay_us``; push and bidirectional transfers were measured to hang with it)."""
    idle_wait_ms: int | None = None
    """``kvtune_idle_wait_ms``: bound on the wait between idle steps of an engine that only holds
    blocks for a remote (see :mod:`kvtune.connectors.idle`)."""
    extra_env: dict[str, str] = field(default_factory=dict)

    def env(self, core: int) -> dict[str, str]:
        """Environment for a server whose engine would be pinned to ``core``."""
        if self.pin_cores:
            env = {"VLLM_CPU_OMP_THREADS_BIND": str(core)}
        else:
            env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
        return {**env, **self.extra_env}

    def kv_extra_config(self, mode: str) -> dict[str, Any]:
        """``kv_connector_extra_config`` entries of this layout in ``mode`` (both connectors honour
        them: kvtune's, and :mod:`kvtune.connectors.plain` for vLLM's own)."""
        extra: dict[str, Any] = {}
        if not self.nixl_progress_thread:
            extra.update({THREAD_KEY: False, "num_threads": 0})
        elif self.pull_progress_delay_us is not None and mode == "pull":
            extra[PROGRESS_DELAY_KEY] = self.pull_progress_delay_us
        if self.idle_wait_ms is not None:
            extra[IDLE_WAIT_KEY] = self.idle_wait_ms
        return extra


QUIET: Final = PairLayout("quiet", pin_cores=False, nixl_progress_thread=False,
                          idle_wait_ms=1500)
PINNED: Final = PairLayout("pinned", pin_cores=True, nixl_progress_thread=True,
                           pull_progress_delay_us=RECOMMENDED_DELAY_US)
LAYOUTS: Final = {layout.name: layout for layout in (QUIET, PINNED)}
