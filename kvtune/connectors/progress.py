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
import sys
import threading
from collections.abc import Iterator
from typing import Any, Final

from kvtune.errors import ConnectorError

EXTRA_CONFIG_KEY: Final = "kvtune_progress_delay_us"
"""``kv_connector_extra_config`` key: NIXL progress-thread delay in microseconds (int >= 0)."""
MAX_DELAY_US: Final = 1_000_000
RECOMMENDED_DELAY_US: Final = 1000
"""What kvtune's tests and ``tune`` use, and recommends (NIXL wakes at least once a millisecond)."""

_LOCK = threading.Lock()


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


class _BindingWithDelay:
    """Stands in for the NIXL binding module while one agent is built; sets ``pthrDelay``."""

    def __init__(self, real: Any, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 - NIXL's spelling
        config.pthrDelay = self._delay_us
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


@contextlib.contextmanager
def progress_delay(delay_us: int | None) -> Iterator[None]:
    """While active, NIXL agents built in this process get ``pthrDelay = delay_us``.

    ``None`` changes nothing. Meant to wrap the one constructor call that builds the agent."""
    if delay_us is None:
        yield
        return
    with _LOCK:
        module = _agent_module()
        real = module.nixlBind
        module.nixlBind = _BindingWithDelay(real, delay_us)
        try:
            yield
        finally:
            module.nixlBind = real
