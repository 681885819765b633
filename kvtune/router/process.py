"""Running a router for other code: :class:`RouterProcess` (a subprocess on a free port) and
:class:`RouterInThread` (in this process, on a background event loop, e.g. with a test tracer)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from kvtune.errors import RouterError
from kvtune.router.config import RouterConfig, write_config
from kvtune.router.state import ConversationStore

if TYPE_CHECKING:
    from kvtune.router.server import LegRecord

START_TIMEOUT_S = 60.0
"""How long :meth:`RouterProcess.start` waits for the router to answer ``/health``."""
STOP_TIMEOUT_S = 15.0
"""How long :meth:`RouterProcess.stop` waits after SIGTERM before SIGKILL."""


class RouterProcess:
    """The router as a subprocess (``python -m kvtune.router``) bound to a free port.

    ``start()`` writes ``config`` to a file, starts the process with ``--port 0 --port-file``, and
    waits until ``/health`` answers; ``stop()`` sends SIGTERM (SIGKILL after a bounded wait);
    ``kill()`` sends SIGKILL at once (a crash). Usable as a context manager. The process's output
    goes to ``log_path`` (default: a file in ``workdir``).
    """

    def __init__(self, config: RouterConfig, *, workdir: str | Path | None = None,
                 log_path: str | Path | None = None, env: dict[str, str] | None = None,
                 python: str = sys.executable) -> None:
        self.config = config
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvtune-router-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = Path(log_path) if log_path else self.workdir / "router.log"
        self.env = env
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RouterError("RouterProcess: not started")
        return f"http://{self.config.host}:{self.port}"

    def __enter__(self) -> RouterProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """Start the process and wait until it is healthy; returns its base URL."""
        if self.proc is not None and self.proc.poll() is None:
            raise RouterError("RouterProcess: already running")
        cfg_path = write_config(self.config, self.workdir / "router.json")
        port_file = self.workdir / "router.port"
        port_file.unlink(missing_ok=True)
        env = {**os.environ, **(self.env or {})}
        src_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(  # -P: no working directory first on sys.path, so a
                # kvtune/ folder where the caller stands never shadows this kvtune
                [self.python, "-P", "-m", "kvtune.router", "--config", str(cfg_path), "--port", "0",
                 "--port-file", str(port_file)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RouterError(f"router process exited with {self.proc.returncode} before "
                                  f"serving; log {self.log_path}: {self._log_tail()}")
            if port_file.exists():
                self.port = int(port_file.read_text().strip())
                if self._healthy():
                    return self.url
            time.sleep(0.1)
        self.stop()
        raise RouterError(f"router process not healthy within {timeout_s:g} s; log "
                          f"{self.log_path}: {self._log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the router (a crash: nothing is flushed or closed)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)
        self.port = None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self.port = None
        return self.proc.returncode


class RouterInThread:
    """The router in this process on a background event loop (for tests and benchmarks that need
    its spans in memory, and :class:`kvtune.local.pair.LocalPair`). ``config.port`` 0 picks a free
    port; ``on_leg`` and ``trusted_client``: see :class:`kvtune.router.server.Router`."""

    def __init__(self, config: RouterConfig, *, store: ConversationStore | None = None,
                 tracer: trace.Tracer | None = None,
                 on_leg: Callable[[LegRecord], None] | None = None,
                 trusted_client: bool = False) -> None:
        from kvtune.router.server import Router
        self.router = Router(config, store=store, tracer=tracer, on_leg=on_leg,
                             trusted_client=trusted_client)
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RouterInThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> str:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="kvtune-router", daemon=True)
        self._thread.start()
        ready.wait(30)
        self.url = self._call(self.router.start())
        return self.url

    def _call(self, coro: Any, timeout_s: float = 60.0) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop(self) -> None:
        if self._loop is None:
            return
        self._call(self.router.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(30)
        self._loop.close()
        self._loop = None
