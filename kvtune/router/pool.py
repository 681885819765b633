"""Load-aware choice among instances of one role: least requests in flight, ties in turn."""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvtune.redact import redact_url
from kvtune.router.config import InstanceConfig


@dataclass(frozen=True)
class InstanceLoad:
    """A snapshot of one instance's load (for ``/health``)."""

    url: str
    in_flight: int
    requests_total: int
    failures_total: int


class InstancePool:
    """Instances of one role (prefill or decode) with their in-flight counts.

    All methods run on the router's event loop (no locks needed): :meth:`choose` picks the instance
    with the fewest requests in flight, and among equals the one after the last chosen.
    """

    def __init__(self, role: str, instances: Sequence[InstanceConfig]) -> None:
        if not instances:
            raise ValueError(f"{role}: at least one instance expected")
        self.role = role
        self.instances = tuple(instances)
        self._in_flight = [0] * len(self.instances)
        self._total = [0] * len(self.instances)
        self._failures = [0] * len(self.instances)
        self._rr = itertools.count()

    def choose(self) -> int:
        """Index of the least-loaded instance (round-robin among equals)."""
        start = next(self._rr) % len(self.instances)
        order = [(start + i) % len(self.instances) for i in range(len(self.instances))]
        return min(order, key=lambda i: self._in_flight[i])

    @contextmanager
    def lease(self, index: int) -> Iterator[InstanceConfig]:
        """Count one request in flight on instance ``index`` for the ``with`` block."""
        self._in_flight[index] += 1
        self._total[index] += 1
        try:
            yield self.instances[index]
        finally:
            self._in_flight[index] -= 1

    def mark_failure(self, index: int) -> None:
        self._failures[index] += 1

    def in_flight(self, index: int) -> int:
        return self._in_flight[index]

    def snapshot(self) -> list[InstanceLoad]:
        return [InstanceLoad(redact_url(inst.url), self._in_flight[i], self._total[i], self._failures[i])
                for i, inst in enumerate(self.instances)]
