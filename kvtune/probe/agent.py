"""NIXL agents and KV-shaped DRAM buffers for the probe (registered once, as vLLM does)."""
from __future__ import annotations

import hashlib
import importlib.metadata
import itertools
import logging
import os
import socket
from dataclasses import dataclass, field

import numpy as np

from kvtune.errors import ProbeError

logger = logging.getLogger(__name__)

DEFAULT_BACKEND = "UCX"
MEM_TYPE = "DRAM"


def nixl_version() -> str:
    """Installed NIXL version ("" when unknown)."""
    for dist in ("nixl", "nixl-cu12", "nixl-cu13", "nixl-rocm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


_AGENTS = itertools.count()


def agent_name(side: str) -> str:
    """A unique, readable agent name: ``probe-<side>-<host>-<pid>`` (``-<n>`` for later ones in
    the same process)."""
    n = next(_AGENTS)
    return f"probe-{side}-{socket.gethostname()}-{os.getpid()}" + (f"-{n}" if n else "")


def make_agent(name: str, backend: str = DEFAULT_BACKEND):
    """A NIXL agent with ``backend`` loaded and NIXL's own per-transfer telemetry captured."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise ProbeError(f"NIXL is not importable here ({exc}); install kvtune[nixl]") from exc
    agent = nixl_agent(name, nixl_agent_config(backends=[], capture_telemetry=True))
    plugins = agent.get_plugin_list()
    if backend not in plugins:
        raise ProbeError(f"--backend: expected one of the NIXL plugins found here {plugins}, got {backend!r}")
    try:
        agent.create_backend(backend, {})
    except Exception as exc:
        raise ProbeError(f"--backend {backend}: the NIXL plugin is present but failed to load: "
                         f"{type(exc).__name__}: {exc} (see `kvtune probe check`)") from exc
    return agent


@dataclass
class RegisteredBuffer:
    """A DRAM buffer registered with one agent; ``release`` deregisters it."""

    agent: object
    array: np.ndarray
    reg: object = field(default=None, repr=False)

    @classmethod
    def allocate(cls, agent, nbytes: int) -> "RegisteredBuffer":
        if nbytes < 1:
            raise ProbeError(f"buffer size: expected >= 1 byte, got {nbytes}")
        try:
            array = np.zeros(nbytes, dtype=np.uint8)
        except MemoryError:
            raise ProbeError(f"cannot allocate a {nbytes / 2**20:.0f} MiB probe buffer; "
                             f"lower --max-mem-mb") from None
        buf = cls(agent, array)
        buf.reg = agent.register_memory([(buf.addr, nbytes, 0, "")], MEM_TYPE)
        return buf

    @property
    def addr(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def fill(self, seed: int, ranges: np.ndarray) -> None:
        """Fill the ``(offset, length)`` ranges with bytes that depend on ``seed`` and position."""
        for off, length in ranges:
            self.array[off:off + length] = pattern(seed, int(off), int(length))

    def digest(self, ranges: np.ndarray) -> str:
        """SHA-256 over the ``(offset, length)`` ranges, in order."""
        h = hashlib.sha256()
        for off, length in ranges:
            h.update(memoryview(self.array[int(off):int(off) + int(length)]))
        return h.hexdigest()

    def release(self) -> None:
        if self.reg is not None:
            try:
                self.agent.deregister_memory(self.reg)
            except Exception:
                logger.warning("kvtune probe: deregistering the probe buffer failed", exc_info=True)
            self.reg = None


def pattern(seed: int, offset: int, length: int) -> np.ndarray:
    """Deterministic bytes for ``[offset, offset+length)`` under ``seed`` (cheap: an affine byte
    sequence, different for every 8-byte word position and seed)."""
    idx = np.arange(offset, offset + length, dtype=np.uint64)
    salt = np.uint64((seed * 0x632BE59BD9B4E019 + 1) % (1 << 64))
    mixed = (idx * np.uint64(0x9E3779B97F4A7C15) + salt) >> np.uint64(29)
    return mixed.astype(np.uint8)
