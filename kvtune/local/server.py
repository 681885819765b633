"""One ``vllm.entrypoints.openai.api_server`` subprocess on this machine (CPU build of vLLM).

The server runs in its own session (process group) so that stopping it also stops the engine-core
process it spawns: terminate the group, wait, then kill the group — always, no orphans.
"""
from __future__ import annotations

import atexit
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final

import kvtune
from kvtune.local import client
from kvtune.local.errors import LocalPairError
from kvtune.vllm_pd import SIDE_CHANNEL_PORT_ENV

SERVED_MODEL_NAME: Final = "kvtune-tiny"
HOST: Final = "127.0.0.1"
HEALTH_TIMEOUT_S: Final = 300.0
"""Bound on a server's start-up (engine start is ~20 s here, but 2 cores are shared by many)."""
STOP_GRACE_S: Final = 20.0
"""SIGTERM -> SIGKILL grace period for a server's process group."""
LOG_TAIL_LINES: Final = 60
MAX_MODEL_LEN: Final = 4096
NUM_BLOCKS: Final = 256
"""``--num-gpu-blocks-override``: a small KV cache. With vLLM's default (16k blocks on CPU) the NIXL
handshake registers 16k descriptors and takes ~12 s, and push handshakes time out."""
KV_CACHE_SPACE_GIB: Final = 1
SEED: Final = 0

_LIVE: set[VllmServer] = set()


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together while choosing, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    """The last ``n`` lines of a text file ("" when it does not exist)."""
    try:
        with open(path, "rb") as f:
            lines = collections.deque(f, maxlen=n)
    except OSError:
        return ""
    return b"".join(lines).decode("utf-8", "replace")


class VllmServer:
    """A vLLM OpenAI server subprocess: start, wait for ``/health``, stop (group kill)."""

    def __init__(self, name: str, *, model_dir: Path, workdir: Path, port: int, cpu_core: int,
                 kv_transfer_config: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None,
                 side_channel_port: int | None = None,
                 extra_args: Sequence[str] = (), host: str = HOST,
                 launch_prefix: Sequence[str] = (), num_blocks: int = NUM_BLOCKS,
                 max_model_len: int = MAX_MODEL_LEN) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.host = host
        self.launch_prefix = list(launch_prefix)
        """Command prefix the server starts under (``ip netns exec NS`` on a shaped fabric's
        decode side: ``kvtune.local.fabric``)."""
        self.model_dir = Path(model_dir)
        self.workdir = Path(workdir) / name
        self.port = port
        self.cpu_core = cpu_core
        self.kv_transfer_config = dict(kv_transfer_config) if kv_transfer_config else None
        self.side_channel_port = side_channel_port
        self.extra_env = dict(env or {})
        self.extra_args = list(extra_args)
        self.log_path = self.workdir / "vllm.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [*self.launch_prefix, sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model_dir), "--served-model-name", SERVED_MODEL_NAME,
               "--host", self.host, "--port", str(self.port),
               "--enforce-eager", "--max-model-len", str(self.max_model_len),
               "--num-gpu-blocks-override", str(self.num_blocks), "--dtype", "bfloat16",
               "--seed", str(SEED), "--uvicorn-log-level", "warning"]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        cache = self.workdir / "cache"
        env = dict(os.environ)
        repo_root = str(Path(kvtune.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
        env.update({
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(cache / "hf"),
            "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TRITON_CACHE_DIR": str(cache / "triton"),
            "VLLM_CPU_OMP_THREADS_BIND": str(self.cpu_core),
            "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_SPACE_GIB),
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host,
            "PYTHONUNBUFFERED": "1",
            # A crash (SIGSEGV in a native library, say) prints every thread's Python stack.
            "PYTHONFAULTHANDLER": "1",
        })
        if self.side_channel_port is not None:
            env[SIDE_CHANNEL_PORT_ENV] = str(self.side_channel_port)
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        if self.proc is not None:
            raise LocalPairError(f"{self.name}: already started")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log.write(f"$ {' '.join(self.command())}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(self.command(), env=self.environment(), cwd=self.workdir,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_terminate_with_parent)
        _LIVE.add(self)

    def exited(self) -> int | None:
        """The exit code if the server process has exited, else None."""
        return None if self.proc is None else self.proc.poll()

    def healthy(self) -> bool:
        try:
            status, _ = client.get(self.url, "/health", timeout_s=5.0)
        except client.HttpError:
            return False
        return status == 200

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Terminate the server, then kill its process group; idempotent, never raises."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is not None:
            # SIGTERM to the API server only: it shuts its engine core down in order (a SIGTERM
            # to the whole group kills the engine first and the API server logs EngineDeadError).
            try:
                proc.terminate()
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            # Kill what is left of the group (the engine-core child may outlive the API server).
            _signal_group(proc.pid, signal.SIGKILL)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        return tail(self.log_path, n)


def _terminate_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when its parent dies, so a test run killed by
    ``timeout`` (SIGTERM skips ``atexit``) does not leave vLLM servers behind."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux/glibc: stop()/atexit still apply
        pass


PR_SET_PDEATHSIG: Final = 1


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def logs_report(servers: Sequence[VllmServer], n: int = LOG_TAIL_LINES) -> str:
    """The last ``n`` lines of each server's log, labelled, for error messages."""
    parts = []
    for s in servers:
        parts.append(f"----- last {n} lines of {s.name} log ({s.log_path}) -----\n"
                     f"{s.log_tail(n).rstrip()}")
    return "\n".join(parts)


def wait_healthy(servers: Sequence[VllmServer], *, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Wait until every server answers ``/health`` with 200; fail fast if one exits."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for s in list(pending):
            code = s.exited()
            if code is not None:
                raise LocalPairError(
                    f"{s.name}: vLLM server exited with code {code} during start-up "
                    f"(expected it to serve /health on {s.url})\n" + logs_report(servers))
            if s.healthy():
                pending.remove(s)
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(s.name for s in pending)
            raise LocalPairError(f"{names}: /health not ready within {timeout_s:.0f} s\n"
                                 + logs_report(servers))
        time.sleep(0.5)


@atexit.register
def _stop_all() -> None:  # last resort if a caller forgot to stop (no orphans)
    for s in list(_LIVE):
        s.stop()
