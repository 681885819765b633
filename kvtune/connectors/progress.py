"""How NIXL's UCX progress thread waits: spin (NIXL's default) or sleep on its event fd.

NIXL's Python API builds every agent with ``pthrDelay = 0`` (``nixl._api.nixl_agent.__init__``),
and the UCX backend's shared progress thread then calls ``poll()`` with a zero timeout in a loop:
it spins a whole CPU core per agent, busy or idle. vLLM gives no way to change it. On a host
where the engines' cores are few (the CPU pair here: one core per engine, and the thread inherits
the worker's core binding) the spinning threads starve the engines' own threads, and requests
stall for seconds between phases (see ``kvtune/local/README.md``).

With a positive delay the thread sleeps in ``poll()`` on the UCX worker's event fd and wakes on
traffic, or after ``delay`` (NIXL rounds it up to whole milliseconds) to progress anyway.

kvtune's connectors apply it when ``kv_connector_extra_config`` carries
``kvtune_progress_delay_us`` (:data:`EXTRA_CONFIG_KEY`): the agent vLLM creates in the worker's
``__init__`` is built with that delay. Nothing else about the agent changes. Pull mode only: push
and bidirectional transfers were measured to hang with a sleeping progress thread on either side
(``kvtune.connectors.worker``), so the connectors ignore the key there with a warning.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from kvtune.errors import ConnectorError
from kvtune.vllm_pd import BIDIRECTIONAL_KV_XFER, KV_CONNECTOR_EXTRA_CONFIG, progress_delay_applies

EXTRA_CONFIG_KEY: Final = "kvtune_progress_delay_us"
"""``kv_connector_extra_config`` key: NIXL progress-thread delay in microseconds (int >= 0)."""
MAX_DELAY_US: Final = 1_000_000
THREAD_KEY: Final = "kvtune_nixl_progress_thread"
"""``kv_connector_extra_config`` key: ``false`` builds the NIXL agent without a progress thread."""
RECOMMENDED_DELAY_US: Final = 1000
"""What kvtune's tests and ``tune`` use, and recommends (NIXL wakes at least once a millisecond)."""

_LOCK = threading.Lock()
_log = logging.getLogger(__name__)


def delay_from_extra_config(extra: Any) -> int | None:
    """The configured delay, or None when the key is absent; a clear error when it is invalid."""
    if not isinstance(extra, dict) or EXTRA_CONFIG_KEY not in extra:
        return None
    value = extra[EXTRA_CONFIG_KEY]
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, int)
            or not 0 <= value <= MAX_DELAY_US):
        raise ConnectorError(
            f"kv_transfer_config.kv_connector_extra_config.{EXTRA_CONFIG_KEY}: expected an int "
            f"from 0 to {MAX_DELAY_US} (microseconds), got {value!r}")
    return value


def thread_from_extra_config(extra: Any) -> bool | None:
    """``kvtune_nixl_progress_thread`` (:data:`THREAD_KEY`): False builds the agent without a
    progress thread; None when absent; a clear error when it is not a bool."""
    if not isinstance(extra, dict) or extra.get(THREAD_KEY) is None:
        return None
    value = extra[THREAD_KEY]
    if not isinstance(value, bool):
        raise ConnectorError(f"kv_transfer_config.kv_connector_extra_config.{THREAD_KEY}: "
                             f"expected true or false, got {value!r}")
    return value


class _BindingWithSettings:
    """Stands in for the NIXL binding module while one agent is built; changes its config."""

    def __init__(self, real: Any, delay_us: int | None, progress_thread: bool | None) -> None:
        self._real = real
        self._delay_us = delay_us
        self._progress_thread = progress_thread

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # NIXL's spelling
        if self._delay_us is not None:
            config.pthrDelay = self._delay_us
        if self._progress_thread is False:
            # No progress thread: UCX advances only inside the agent's own calls (vLLM's worker
            # polls transfers and notifications every engine step). vLLM calls the agent from
            # its engine thread and its handshake thread, so the agent serialises its calls.
            config.useProgThread = False
            config.syncMode = self._real.NIXL_THREAD_SYNC_STRICT
        return self._real.nixlAgent(name, config)


def _agent_module() -> Any:
    from vllm.distributed.nixl_utils import NixlWrapper

    if NixlWrapper is None:
        raise ConnectorError("NIXL is not available: cannot set its progress-thread delay")
    module = sys.modules.get(NixlWrapper.__module__)
    if module is None or not hasattr(module, "nixlBind"):
        raise ConnectorError(f"{EXTRA_CONFIG_KEY}: NIXL's agent module "
                             f"{NixlWrapper.__module__!r} has no nixlBind; unsupported NIXL")
    return module


@dataclass(frozen=True)
class AgentSettings:
    """How one NIXL agent is built: progress-thread delay and whether it has a progress thread
    (None: NIXL's default)."""

    delay_us: int | None = None
    progress_thread: bool | None = None

    @property
    def span_value(self) -> int:
        """``kv.nixl.progress_delay_us`` on spans: -1 without a progress thread, else the delay
        (0 = NIXL's spinning default)."""
        if self.progress_thread is False:
            return NO_THREAD_SPAN_VALUE
        return 0 if self.delay_us is None else self.delay_us


NO_THREAD_SPAN_VALUE: Final = -1
"""``kv.nixl.progress_delay_us`` of an agent without a progress thread."""


def settings_of(vllm_config: Any, push: bool) -> AgentSettings:
    """The agent settings a worker's ``kv_connector_extra_config`` asks for.

    The delay applies to pull mode only (:func:`kvtune.vllm_pd.progress_delay_applies`): in push
    and bidirectional mode the prefill initiates transfers (WRITEs, reverse READs), and a sleeping
    progress thread on either side was measured to hang them (the first push WRITE waited for the
    120 s lease; bidirectional workers timed out), so it is ignored there with a warning."""
    cfg = vllm_config.kv_transfer_config
    extra = getattr(cfg, KV_CONNECTOR_EXTRA_CONFIG, None) or {}
    delay = delay_from_extra_config(extra)
    thread = thread_from_extra_config(extra)
    mode = "push" if push else (
        "bidirectional" if extra.get(BIDIRECTIONAL_KV_XFER, False) else "pull")
    if delay is not None and not progress_delay_applies(mode):
        _log.warning("kvtune: %s ignored in %s mode (its transfers were measured to hang with a "
                     "sleeping NIXL progress thread); it applies to pull mode only",
                     EXTRA_CONFIG_KEY, mode)
        delay = None
    return AgentSettings(delay_us=delay, progress_thread=thread)


@contextlib.contextmanager
def agent_settings(settings: AgentSettings) -> Iterator[None]:
    """While active, NIXL agents built in this process get ``settings``; the default
    ``AgentSettings()`` changes nothing. Meant to wrap the one constructor call that builds the
    agent (vLLM's worker ``__init__``)."""
    if settings == AgentSettings():
        yield
        return
    with _LOCK:
        module = _agent_module()
        real = module.nixlBind
        module.nixlBind = _BindingWithSettings(real, settings.delay_us, settings.progress_thread)
        try:
            yield
        finally:
            module.nixlBind = real


def agent_settings_of(vllm_config: Any, push: bool) -> contextlib.AbstractContextManager[None]:
    """:func:`agent_settings` of :func:`settings_of` (the worker's extra config)."""
    return agent_settings(settings_of(vllm_config, push))


def progress_delay(delay_us: int | None) -> contextlib.AbstractContextManager[None]:
    """While active, NIXL agents built in this process get ``pthrDelay = delay_us``."""
    return agent_settings(AgentSettings(delay_us=delay_us))
