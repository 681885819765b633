"""A transparent proxy around a NIXL agent that reports transfer events to a tracker.

vLLM's workers call ``self.nixl_wrapper.<method>`` everywhere; the instrumented workers replace
that attribute with :class:`ObservedNixlAgent`, which forwards every call unchanged (same
arguments, same return value, same exceptions) and, for the five transfer calls below, reports to
:class:`~kvtune.connectors.observer.TransferTracker` through the hook guard.
"""
from __future__ import annotations

from typing import Any

from kvtune.connectors.observer import GUARD, HookGuard, TransferTracker, now_ns

def _descriptor_count(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    ids = kwargs.get("local_indices", args[2] if len(args) > 2 else None)
    try:
        return len(ids) if ids is not None else None
    except TypeError:
        return None


class ObservedNixlAgent:
    """Delegates everything to ``agent``; observes the transfer lifecycle calls."""

    __slots__ = ("_agent", "_tracker", "_guard")

    def __init__(self, agent: Any, tracker: TransferTracker, guard: HookGuard = GUARD) -> None:
        object.__setattr__(self, "_agent", agent)
        object.__setattr__(self, "_tracker", tracker)
        object.__setattr__(self, "_guard", guard)

    @property
    def wrapped(self) -> Any:
        """The real NIXL agent."""
        return self._agent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._agent, name, value)

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        handle = self._agent.make_prepped_xfer(*args, **kwargs)
        if self._tracker.current() is not None:
            self._guard.run("nixl.prepared", self._tracker.prepared, handle,
                            _descriptor_count(args, kwargs))
        return handle

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        post_ns = now_ns()
        state = self._agent.transfer(handle, *args, **kwargs)
        self._guard.run("nixl.posted", self._tracker.posted, handle, post_ns, state)
        return state

    def check_xfer_state(self, handle: Any) -> Any:
        state = self._agent.check_xfer_state(handle)
        if state != "PROC":
            self._guard.run("nixl.observed", self._tracker.observed, handle, state)
        return state

    def get_xfer_telemetry(self, handle: Any) -> Any:
        res = self._agent.get_xfer_telemetry(handle)
        self._guard.run("nixl.telemetry", self._tracker.telemetry, handle, res)
        return res

    def release_xfer_handle(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        out = self._agent.release_xfer_handle(handle, *args, **kwargs)
        self._guard.run("nixl.released", self._tracker.released, handle)
        return out
