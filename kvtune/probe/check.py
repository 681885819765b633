"""``kvtune probe check``: is this host ready to move KV with NIXL, and over what?

Reports the NIXL version, its plugins and which backends load, then runs a tiny real probe (two
processes, READ and WRITE, bytes checked) with ``UCX_LOG_LEVEL=info`` and reads from UCX's own log
which transports it selected for the peer. When RDMA devices exist (``/sys/class/infiniband``) but
the data moved over TCP or shared memory, it warns loudly: that silent fallback is the usual reason
a disaggregated deployment is slow.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

SELFTEST_MARK = "KVTUNE_PROBE_SELFTEST "
INFINIBAND_DIR = Path("/sys/class/infiniband")
CHECK_TIMEOUT_S = 180.0
RDMA_TRANSPORTS = ("rc", "dc", "ud", "srd", "gga", "ib")
"""UCX transport-name prefixes that move data by RDMA (rc_mlx5, dc_mlx5, ud_verbs, srd (EFA), ...)."""
TCP_TRANSPORT = "tcp"
SHM_TRANSPORTS = ("cma", "posix", "sysv", "xpmem", "knem")
"""UCX intra-node (shared-memory and cross-memory-attach) transports."""
_UCX_CFG = re.compile(r"ucp_worker\.c:\d+\s+UCX\s+INFO\s+(\S+)\s+(intra-node|inter-node)\s+cfg#\d+\s+(.*)$")
_UCX_VERSION = re.compile(r"UCX\s+INFO\s+Version\s+(\S+)")
_LANE = re.compile(r"(\w+)\(([^)]*)\)")


@dataclass(frozen=True)
class BackendStatus:
    name: str
    loaded: bool
    error: str = ""


@dataclass(frozen=True)
class ReadinessReport:
    """What ``check`` found. ``transports``: UCX transport names selected for the peer (``tcp``,
    ``cma``, ``rc_mlx5``, ...); ``lanes``: ``transport/device`` per UCX lane kind."""

    nixl_version: str
    ucx_version: str
    plugins: tuple[str, ...]
    backends: tuple[BackendStatus, ...]
    transports: tuple[str, ...]
    lanes: tuple[str, ...]
    rdma_devices: tuple[str, ...]
    ucx_tls: str
    transfer_ok: bool
    transfer_error: str
    warnings: tuple[str, ...] = field(default=())

    @property
    def rdma_used(self) -> bool:
        return any(t.startswith(RDMA_TRANSPORTS) for t in self.transports)

    @property
    def tcp_used(self) -> bool:
        return TCP_TRANSPORT in self.transports

    def ok(self, *, require_rdma: bool = False) -> bool:
        return self.transfer_ok and (self.rdma_used or not require_rdma)

    def as_dict(self) -> dict:
        return {"nixl_version": self.nixl_version, "ucx_version": self.ucx_version,
                "plugins": list(self.plugins),
                "backends": [{"name": b.name, "loaded": b.loaded, "error": b.error} for b in self.backends],
                "transports": list(self.transports), "lanes": list(self.lanes),
                "rdma_devices": list(self.rdma_devices), "ucx_tls": self.ucx_tls,
                "transfer_ok": self.transfer_ok, "transfer_error": self.transfer_error,
                "rdma_used": self.rdma_used, "tcp_used": self.tcp_used, "warnings": list(self.warnings)}

    def text(self) -> str:
        loaded = [b.name for b in self.backends if b.loaded]
        failed = [f"{b.name} ({b.error})" for b in self.backends if not b.loaded]
        lines = [f"NIXL {self.nixl_version or '?'}, UCX {self.ucx_version or '?'}",
                 f"plugins: {', '.join(self.plugins) or 'none'}",
                 f"backends that load: {', '.join(loaded) or 'none'}"]
        if failed:
            lines.append(f"backends that fail: {'; '.join(failed)}")
        lines.append(f"UCX_TLS: {self.ucx_tls or '(unset: UCX chooses)'}")
        lines.append(f"test transfer (READ+WRITE, bytes checked): "
                     f"{'ok' if self.transfer_ok else 'FAILED: ' + self.transfer_error}")
        shm = [t for t in self.transports if t in SHM_TRANSPORTS]
        kind = ("RDMA" if self.rdma_used else
                " + ".join((["shared memory (" + ", ".join(shm) + ")"] if shm else [])
                           + (["TCP"] if self.tcp_used else [])) or "no RDMA")
        lines.append(f"UCX transports selected: {', '.join(self.transports) or 'unknown'} ({kind}); "
                     f"lanes: {' '.join(self.lanes) or '-'}")
        lines.append(f"RDMA devices: {', '.join(self.rdma_devices) or 'none'}")
        for w in self.warnings:
            lines.append("!" * 78)
            lines.append(f"WARNING: {w}")
            lines.append("!" * 78)
        return "\n".join(lines)


def parse_ucx_log(text: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(UCX version, transports, lanes) from UCX ``info`` log text (endpoint configurations to a
    peer; the ``self`` loopback configuration is ignored)."""
    version = ""
    transports: set[str] = set()
    lanes: set[str] = set()
    for line in text.splitlines():
        m = _UCX_VERSION.search(line)
        if m and not version:
            version = m.group(1)
        m = _UCX_CFG.search(line)
        if not m:
            continue
        for kind, members in _LANE.findall(m.group(3)):
            for member in members.split():
                tl = member.split("/", 1)[0]
                transports.add(tl)
                lanes.add(f"{kind}:{member}")
    return version, tuple(sorted(transports)), tuple(sorted(lanes))


def rdma_devices(infiniband_dir: Path = INFINIBAND_DIR) -> tuple[str, ...]:
    try:
        return tuple(sorted(p.name for p in Path(infiniband_dir).iterdir()))
    except OSError:
        return ()


def check(*, backend: str = "UCX", env: dict[str, str] | None = None,
          infiniband_dir: str | Path = INFINIBAND_DIR, timeout_s: float = CHECK_TIMEOUT_S) -> ReadinessReport:
    """Run the readiness check (a tiny real probe in child processes, ``env`` added to theirs)."""
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("UCX_LOG_LEVEL", "info")
    if child_env["UCX_LOG_LEVEL"].lower() not in ("info", "debug", "trace"):
        child_env["UCX_LOG_LEVEL"] = "info"
    cmd = [sys.executable, "-P", "-m", "kvtune.probe.selftest", "--backend", backend]
    try:
        proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout_s)
        out = proc.stdout + "\n" + proc.stderr
        rc = proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or "") + "\n" + (exc.stderr or "")
        out = out.decode() if isinstance(out, bytes) else out
        rc = -1
    result: dict = {}
    for line in out.splitlines():
        if line.startswith(SELFTEST_MARK):
            try:
                result.update(json.loads(line[len(SELFTEST_MARK):]))
            except json.JSONDecodeError:
                pass
    version, transports, lanes = parse_ucx_log(out)
    devices = rdma_devices(Path(infiniband_dir))
    transfer_ok = bool(result.get("transfer_ok")) and rc == 0
    error = str(result.get("transfer_error", "")) or ("" if rc == 0 else
                                                       f"self-test exited with {rc}: {out.strip()[-400:]}")
    warnings = []
    rdma = any(t.startswith(RDMA_TRANSPORTS) for t in transports)
    if devices and not rdma:
        warnings.append(f"RDMA devices are present ({', '.join(devices)}) but UCX moved the data over "
                        f"{', '.join(transports) or 'an unknown transport'}"
                        f"{' (TCP)' if TCP_TRANSPORT in transports else ''}, not RDMA: the silent "
                        f"fallback. Check UCX_TLS/UCX_NET_DEVICES, rdma-core, and `ulimit -l`.")
    if transfer_ok and not transports:
        warnings.append("could not tell which UCX transports were selected (no UCX info log)")
    return ReadinessReport(nixl_version=str(result.get("nixl_version", "")), ucx_version=version,
                           plugins=tuple(result.get("plugins", ())),
                           backends=tuple(BackendStatus(b["name"], bool(b["loaded"]), b.get("error", ""))
                                          for b in result.get("backends", ())),
                           transports=transports, lanes=lanes, rdma_devices=devices,
                           ucx_tls=child_env.get("UCX_TLS", ""), transfer_ok=transfer_ok,
                           transfer_error=error, warnings=tuple(warnings))
