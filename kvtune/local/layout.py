"""How the local pair sits on this machine's cores, and how its engines and NIXL agents make progress.

Two layouts, both real vLLM and real NIXL; they differ only in settings vLLM and NIXL expose:

- ``QUIET`` (the default): the model runs inside the engine core's process (vLLM's ``uni`` executor,
  :data:`ONE_PROCESS_ENV`), no core binding (one OpenMP thread per engine, ``OMP_NUM_THREADS=1``;
  the kernel places every thread on whichever core is free), NIXL agents without a progress thread
  (``kvtune_nixl_progress_thread: false``, ``num_threads: 0``: UCX advances inside the engine's own
  NIXL calls, which vLLM makes every step while a transfer or a lease is pending), and an engine that
  only holds blocks for a remote steps every 20 ms instead of every millisecond
  (``kvtune_idle_wait_ms``; it must still step, because a remote's READ of those blocks over UCX's
  TCP or shared-memory transports progresses only when the target calls into NIXL).
- ``PINNED`` (what the pair did before session 5): vLLM's CPU defaults (a worker process per
  server, its OpenMP thread bound to its own core, ``VLLM_CPU_OMP_THREADS_BIND``, so every thread
  it starts inherits that core) and NIXL's default agent (a UCX progress thread that spins), with
  the progress thread sleeping 1 ms in pull mode.

Why (measured on this 2-core machine, ``examples/stalls-side-by-side``): pinned, 3 to 14 of 30
requests per mode took over 1 s (p99 up to 123 s) and the idle pair used 2 cores; quiet, none of 30
in any mode (p99 under 0.2 s) and the idle pair uses 0.04-0.11 cores. The worker process's busy-polling
and the spinning progress threads starved the engines (``kvtune/local/README.md``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from kvtune.connectors.idle import EXTRA_CONFIG_KEY as IDLE_WAIT_KEY
from kvtune.connectors.progress import EXTRA_CONFIG_KEY as PROGRESS_DELAY_KEY
from kvtune.connectors.progress import RECOMMENDED_DELAY_US, THREAD_KEY
from kvtune.vllm_pd import NUM_THREADS, progress_delay_applies


ONE_PROCESS_ENV: Final = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""vLLM's CPU platform switches a one-rank engine from the ``uni`` executor (the default on a GPU)
to the multiprocess one unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (``CpuPlatform.
check_and_update_config``). The multiprocess executor puts the model in a third process per server
that reads the engine's orders from a shared-memory queue, and that reader busy-polls
(``sched_yield``) for one second after every order (``SpinCondition``, ``busy_loop_s=1``): on two
cores the two workers' polling starved the engines. With ``0``, the API server still runs the engine
core in its own process (``AsyncLLM`` always does), and the model runs inside it."""


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
    one_process_engine: bool = False
    """Run the model in the engine core's own process (vLLM's ``uni`` executor, as on a GPU with one
    rank) instead of the separate worker process vLLM's CPU platform forces: see
    :data:`ONE_PROCESS_ENV`."""
    extra_env: dict[str, str] = field(default_factory=dict)

    def env(self, core: int) -> dict[str, str]:
        """Environment for a server whose engine would be pinned to ``core``."""
        if self.pin_cores:
            env = {"VLLM_CPU_OMP_THREADS_BIND": str(core)}
        else:
            env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
        if self.one_process_engine:
            env.update(ONE_PROCESS_ENV)
        return {**env, **self.extra_env}

    def kv_extra_config(self, mode: str) -> dict[str, Any]:
        """``kv_connector_extra_config`` entries of this layout in ``mode`` (both connectors honour
        them: kvtune's, and :mod:`kvtune.connectors.plain` for vLLM's own)."""
        extra: dict[str, Any] = {}
        if not self.nixl_progress_thread:
            extra.update({THREAD_KEY: False, NUM_THREADS: 0})
        elif self.pull_progress_delay_us is not None and progress_delay_applies(mode):
            extra[PROGRESS_DELAY_KEY] = self.pull_progress_delay_us
        if self.idle_wait_ms is not None:
            extra[IDLE_WAIT_KEY] = self.idle_wait_ms
        return extra


QUIET: Final = PairLayout("quiet", pin_cores=False, nixl_progress_thread=False,
                          idle_wait_ms=5, one_process_engine=True)
"""The default. Its idle wait was 20 ms until tuning truth (issue 16) measured that, over UCX's TCP
transport, a READ of held blocks waits for the holding engine's next step: at 20 ms the serving
transfers' times scattered by up to that much (floor fit R² 0.03-0.25 on the shaped link)."""
PINNED: Final = PairLayout("pinned", pin_cores=True, nixl_progress_thread=True,
                           pull_progress_delay_us=RECOMMENDED_DELAY_US)
LAYOUTS: Final = {layout.name: layout for layout in (QUIET, PINNED)}
