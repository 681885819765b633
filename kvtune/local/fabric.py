"""The local pair's fabric: loopback (default) or a shaped link between two network namespaces.

On loopback the tiny model's break-even sits below one KV block, so every threshold under a block
behaves the same and the advice cannot be checked. A *shaped* fabric makes the trade-off real: the
decode runs in its own network namespace, joined to the prefill's (the host's) by a veth pair whose
two ends are shaped with ``tc tbf`` at a chosen rate, and NIXL/UCX are told to use TCP on that link
only (``UCX_TLS=tcp``, ``UCX_NET_DEVICES`` = the veth end), so no shared-memory shortcut crosses it.
The fabric probe can measure the same link (:meth:`ShapedLink.probe_settings`).

    with ShapedLink(rate_mbit=200) as link:          # needs root, `ip` and `tc`
        with LocalPair("bidirectional", fabric=link, ...) as pair: ...

Spec strings (``kvtune tune --fabric``): ``loopback``, ``shaped:RATE`` with RATE like ``200mbit``,
``1gbit`` or a bare number of Mbit/s, or ``auto`` (what ``make tune`` passes: ``shaped:1gbit`` where
this process may build the link, loopback otherwise).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Final

from kvtune.local.errors import LocalPairError

LOOPBACK: Final = "loopback"
AUTO: Final = "auto"
SHAPED_PREFIX: Final = "shaped:"
AUTO_RATE_MBIT: Final = 1000.0
"""``auto``'s rate: at 1 Gbit/s the tiny model's KV (1 KiB per token) costs about 0.008 ms per token
on the wire against about 0.02 ms to recompute, so the break-even lies at a few hundred tokens,
inside the tune workload's history range (measured: threshold 173 tokens, range 127-224), and the
transfer time grows with size far above the noise, so the serving transfers support the floor fit
(on loopback they do not: the largest transfer takes about as long as the smallest)."""
MIN_RATE_MBIT: Final = 1.0
MAX_RATE_MBIT: Final = 100_000.0
BURST: Final = "256kb"
"""tbf bucket: a few TCP segments' worth, so the rate (not the bucket) limits TCP's throughput
(``tests/test_probe_netns.py`` measures the probe's bandwidth within 15% of the rate with it)."""
TBF_LATENCY: Final = "100ms"
SUBNET_PREFIX: Final = "10.215"
_CMD_TIMEOUT_S: Final = 30.0
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(kbit|mbit|gbit)?\s*$", re.IGNORECASE)
_UNIT_MBIT: Final = {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}


_log = logging.getLogger(__name__)


class FabricError(LocalPairError):
    """A fabric spec that cannot be read, or a shaped link that cannot be built here."""


@dataclass(frozen=True)
class FabricSpec:
    """What ``--fabric`` asked for: ``rate_mbit`` None is loopback."""

    rate_mbit: float | None = None

    @property
    def name(self) -> str:
        """The fabric's name in spans and reports (``local-ucx`` on loopback, as before)."""
        return "local-ucx" if self.rate_mbit is None else f"veth-tbf-{self.rate_mbit:g}mbit"


def parse_fabric(spec: str) -> FabricSpec:
    """``loopback``, ``shaped:RATE`` (``200mbit``, ``1gbit``, ``500kbit`` or Mbit/s as a number) or
    ``auto`` (``shaped:1gbit`` where a shaped link can be built here, else loopback, logged)."""
    if not isinstance(spec, str):
        raise FabricError(f"--fabric: expected 'loopback' or 'shaped:RATE', got {spec!r}")
    if spec.strip().lower() == LOOPBACK:
        return FabricSpec()
    if spec.strip().lower() == AUTO:
        try:
            check_can_shape()
        except FabricError as exc:
            _log.warning("--fabric auto: loopback (%s)", exc)
            return FabricSpec()
        return FabricSpec(AUTO_RATE_MBIT)
    if not spec.lower().startswith(SHAPED_PREFIX):
        raise FabricError(f"--fabric: expected 'loopback', 'auto' or 'shaped:RATE' (e.g. "
                          f"shaped:200mbit), got {spec!r}")
    m = _RATE.match(spec[len(SHAPED_PREFIX):])
    if m is None:
        raise FabricError(f"--fabric {spec!r}: RATE expected a number with an optional unit kbit, "
                          f"mbit or gbit (e.g. 200mbit)")
    rate = float(m.group(1)) * _UNIT_MBIT[(m.group(2) or "mbit").lower()]
    if not MIN_RATE_MBIT <= rate <= MAX_RATE_MBIT:
        raise FabricError(f"--fabric {spec!r}: rate expected between {MIN_RATE_MBIT:g} and "
                          f"{MAX_RATE_MBIT:g} Mbit/s, got {rate:g}")
    return FabricSpec(rate)


def _run(*cmd: str) -> None:
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=_CMD_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        raise FabricError(f"shaped fabric: `{' '.join(cmd)}` failed: "
                          f"{exc.stderr.decode(errors='replace').strip()[:300]}") from None
    except subprocess.TimeoutExpired:
        raise FabricError(f"shaped fabric: `{' '.join(cmd)}` took over {_CMD_TIMEOUT_S:g} s") from None


def check_can_shape() -> None:
    """Raise :class:`FabricError` saying what is missing (root, ``ip``, ``tc``)."""
    if os.geteuid() != 0:
        raise FabricError("shaped fabric: needs root (it creates a network namespace and a veth "
                          "pair); run as root or use --fabric loopback")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise FabricError(f"shaped fabric: needs the `{tool}` command (iproute2)")


class ShapedLink:
    """A veth pair between the host's namespace (prefill side) and a namespace of its own (decode
    side), both ends shaped with ``tc tbf rate``; removed on :meth:`close` (deleting the namespace
    deletes the pair). Addresses are private (``10.215.N.1`` and ``.2``) and exist only on it."""

    def __init__(self, rate_mbit: float) -> None:
        if not isinstance(rate_mbit, (int, float)) or not MIN_RATE_MBIT <= float(rate_mbit) <= MAX_RATE_MBIT:
            raise FabricError(f"ShapedLink: rate_mbit expected between {MIN_RATE_MBIT:g} and "
                              f"{MAX_RATE_MBIT:g}, got {rate_mbit!r}")
        self.spec = FabricSpec(float(rate_mbit))
        tag = f"{os.getpid() % 100000}{id(self) % 97:02d}"
        self.netns = f"kvtune-d{tag}"
        self.prefill_dev, self.decode_dev = f"kvp{tag}", f"kvd{tag}"
        net = f"{SUBNET_PREFIX}.{(os.getpid() + id(self)) % 250 + 1}"
        self.prefill_ip, self.decode_ip = f"{net}.1", f"{net}.2"
        self._up = False

    @property
    def name(self) -> str:
        return self.spec.name

    def open(self) -> ShapedLink:
        check_can_shape()
        rate = f"{self.spec.rate_mbit:g}mbit"
        try:
            _run("ip", "netns", "add", self.netns)
            self._up = True
            _run("ip", "link", "add", self.prefill_dev, "type", "veth", "peer", "name",
                 self.decode_dev)
            _run("ip", "link", "set", self.decode_dev, "netns", self.netns)
            _run("ip", "addr", "add", f"{self.prefill_ip}/24", "dev", self.prefill_dev)
            _run("ip", "link", "set", self.prefill_dev, "up")
            _run("ip", "-n", self.netns, "addr", "add", f"{self.decode_ip}/24", "dev",
                 self.decode_dev)
            _run("ip", "-n", self.netns, "link", "set", self.decode_dev, "up")
            _run("ip", "-n", self.netns, "link", "set", "lo", "up")
            _run("tc", "qdisc", "add", "dev", self.prefill_dev, "root", "tbf", "rate", rate,
                 "burst", BURST, "latency", TBF_LATENCY)
            _run("ip", "netns", "exec", self.netns, "tc", "qdisc", "add", "dev", self.decode_dev,
                 "root", "tbf", "rate", rate, "burst", BURST, "latency", TBF_LATENCY)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Remove the namespace and the veth pair; idempotent, never raises."""
        if self._up:
            self._up = False
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True,
                           timeout=_CMD_TIMEOUT_S)
            subprocess.run(["ip", "link", "del", self.prefill_dev], capture_output=True,
                           timeout=_CMD_TIMEOUT_S)

    def __enter__(self) -> ShapedLink:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- what a process on each side needs ---------------------------------------------------
    def prefix(self, role: str) -> list[str]:
        """Command prefix that starts a process on ``role``'s side (the decode's namespace)."""
        return ["ip", "netns", "exec", self.netns] if role == "decode" else []

    def host(self, role: str) -> str:
        """The address ``role``'s servers bind (HTTP and NIXL side channel)."""
        return self.decode_ip if role == "decode" else self.prefill_ip

    def env(self, role: str) -> dict[str, str]:
        """UCX over TCP on the link only, and vLLM's NIXL side channel on the link's address."""
        dev = self.decode_dev if role == "decode" else self.prefill_dev
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev,
                "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host(role)}

    def probe_settings(self) -> dict[str, object]:
        """``ProbeConfig`` fields that probe this link: the target on the decode side, the
        initiator (this process) on the prefill side, both on TCP over the link only."""
        return {"target_prefix": tuple(self.prefix("decode")), "target_bind": self.decode_ip,
                "fabric_env": tuple(self.env("prefill").items()),
                "target_env": tuple(self.env("decode").items())}
