"""The probe's target side: a NIXL agent whose registered DRAM the initiator reads and writes.

``ProbeTarget`` listens on a TCP side channel (127.0.0.1 unless told otherwise) and serves one
initiator at a time: it exchanges NIXL metadata, allocates and registers a buffer of the size the
initiator asks for (within ``max_mem_mb``), answers fill/digest requests (to check bytes), and
records a ``kv.notify`` span for every completion notification it receives.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtune.errors import ProbeError
from kvtune.probe import commands, tracing
from kvtune.probe.agent import (
    DEFAULT_BACKEND,
    RegisteredBuffer,
    agent_name,
    make_agent,
    nixl_version,
)
from kvtune.probe.channel import PROTOCOL_VERSION, BadMessage, Channel, ChannelClosed

logger = logging.getLogger(__name__)

DEFAULT_PORT = 5599
"""Default side-channel port of ``kvtune probe serve``."""
DEFAULT_TARGET_MAX_MEM_MB = 4096
"""Largest buffer a target allocates for one initiator."""
POLL_INTERVAL_S = 0.0005
"""Wait for side-channel input between notification polls (bounds the notify span's lateness)."""
NOTIFY_QUIET_NS = 50_000_000
"""Make the pending ``kv.notify`` spans once no notification came for this long (50 ms): span work
then runs between the initiator's blocks of transfers, not during them."""
MAX_PENDING_NOTIFS = 4096
"""...or once this many are pending (bounds memory on a long uninterrupted sweep)."""
SESSION_IDLE_TIMEOUT_S = 600.0
"""A session with no command and no notification for this long is closed (initiator gone)."""
COMMAND_TIMEOUT_S = 30.0
"""Time for a whole command frame to arrive once its first byte did (one deadline per frame, so a
peer sending a byte now and then cannot stretch it)."""
HELLO_TIMEOUT_S = 120.0
"""Time for a new connection's whole hello frame (with the NIXL metadata) to arrive."""
SESSION_MAX_S = 3600.0
"""A session ends after this long whatever it does: the target serves one initiator at a time, so
no peer may hold it for ever (a full default sweep takes minutes; ``serve --session-max-s``)."""
SPAWN_READY_TIMEOUT_S = 180.0
"""How long to wait for a spawned local target to report its port."""


class ProbeTarget:
    """A probe target bound to ``bind:port`` (port 0 picks a free one; see :attr:`address`)."""

    def __init__(self, bind: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                 backend: str = DEFAULT_BACKEND, max_mem_mb: int = DEFAULT_TARGET_MAX_MEM_MB,
                 fabric: str = "", tracer=None, hello_timeout_s: float = HELLO_TIMEOUT_S,
                 command_timeout_s: float = COMMAND_TIMEOUT_S,
                 idle_timeout_s: float = SESSION_IDLE_TIMEOUT_S,
                 session_max_s: float = SESSION_MAX_S) -> None:
        for name, value in (("hello_timeout_s", hello_timeout_s),
                            ("command_timeout_s", command_timeout_s),
                            ("idle_timeout_s", idle_timeout_s), ("session_max_s", session_max_s)):
            if not 0 < value < float("inf"):
                raise ProbeError(f"probe target: {name}: expected a finite number of seconds > 0, "
                                 f"got {value!r}")
        self.hello_timeout_s, self.command_timeout_s = hello_timeout_s, command_timeout_s
        self.idle_timeout_s, self.session_max_s = idle_timeout_s, session_max_s
        self.backend = backend
        self.max_bytes = int(max_mem_mb) << 20
        self.fabric = fabric
        self.tracer = tracer
        self.name = agent_name("target")
        try:
            self.listener = socket.create_server((bind, port), reuse_port=False)
        except OSError as exc:
            raise ProbeError(f"probe target: cannot listen on {bind}:{port}: {exc.strerror or exc}") from None
        # Fail now if the backend does not load; the serving agent is made per session, so an idle
        # target holds no NIXL progress thread (which polls, costing CPU while nobody transfers).
        make_agent(f"{self.name}-check", backend)
        self.agent = None
        self.sessions = 0
        self.notifs_received = 0
        self._pending: list[tuple[bytes, int]] = []
        self._stop = False

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.listener.getsockname()[:2]
        return host, port

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return after the current session."""
        self._stop = True

    def close(self) -> None:
        try:
            self.listener.close()
        except OSError:
            pass

    def serve_forever(self, *, max_sessions: int | None = None) -> int:
        """Serve initiators one at a time until :meth:`stop` or ``max_sessions`` sessions;
        returns the number served."""
        served = 0
        self.listener.settimeout(0.5)
        try:
            while not self._stop and (max_sessions is None or served < max_sessions):
                try:
                    sock, addr = self.listener.accept()
                except socket.timeout:
                    continue
                peer = f"{addr[0]}:{addr[1]}"
                ch = Channel(sock, f"initiator {peer}")
                served += 1
                try:
                    self.serve_session(ch)
                except ChannelClosed as exc:
                    logger.warning("kvtune probe target: session with %s ended: %s", peer, exc)
                except Exception as exc:  # one peer's session, whatever it sent, never stops the target
                    if isinstance(exc, ProbeError):
                        logger.warning("kvtune probe target: session with %s ended: %s", peer, exc)
                    else:
                        logger.warning("kvtune probe target: session with %s failed", peer,
                                       exc_info=True)
                    _tell(ch, exc)
                finally:
                    ch.close()
        finally:
            self.close()
        return served

    def serve_session(self, ch: Channel) -> None:
        """One initiator: hello, then commands and notifications until bye/EOF/idle/the session's
        deadline. A bad command is answered with an ``error`` frame and the session goes on; a
        frame that is late, oversized or not a hello ends it (the caller tells the peer why)."""
        session_end = time.monotonic() + self.session_max_s
        hello_frame = ch.recv(self.hello_timeout_s, deadline=session_end)
        try:
            hello = commands.parse_hello(hello_frame.msg, PROTOCOL_VERSION, self.max_bytes)
        except ProbeError as exc:
            ch.send({"type": "error", "message": str(exc)})
            return
        nbytes = hello.nbytes
        self.sessions += 1
        name = f"{self.name}-{self.sessions}"
        self.agent = make_agent(name, self.backend)
        try:
            remote = self.agent.add_remote_agent(hello_frame.blob)
        except Exception as exc:
            ch.send({"type": "error", "message": f"cannot load the initiator's NIXL metadata: {exc}"})
            self.agent = None
            return
        remote_name = remote.decode() if isinstance(remote, bytes) else str(remote)
        try:
            buf = RegisteredBuffer.allocate(self.agent, nbytes)
        except BaseException:
            self._forget(remote_name)
            raise
        info = tracing.SpanContextInfo(name, remote_name, self.backend, hello.fabric or self.fabric)
        notifs_before = self.notifs_received
        try:
            ch.send({"type": "ready", "version": PROTOCOL_VERSION, "agent": name,
                     "addr": buf.addr, "nbytes": buf.nbytes, "nixl_version": nixl_version(),
                     "host": socket.gethostname()}, self.agent.get_agent_metadata())
            last_activity = time.monotonic()
            while True:
                if time.monotonic() >= session_end:
                    logger.warning("kvtune probe target: session with %s reached %.0f s; closing",
                                   remote_name, self.session_max_s)
                    ch.send({"type": "error", "message": f"session ended after "
                             f"{self.session_max_s:g} s (this target's serve --session-max-s)"})
                    return
                ready, _, _ = select.select([ch.sock], [], [], POLL_INTERVAL_S)
                if self._drain_notifs(info):
                    last_activity = time.monotonic()
                if ready:
                    last_activity = time.monotonic()
                    try:
                        frame = ch.recv(self.command_timeout_s, deadline=session_end)
                    except ChannelClosed:
                        logger.info("kvtune probe target: initiator %s went away", remote_name)
                        return
                    except BadMessage as exc:  # framing intact: answer and read on
                        ch.send({"type": "error", "message": str(exc)})
                        continue
                    if not self._command(ch, frame.msg, buf, info, notifs_before, session_end):
                        return
                elif time.monotonic() - last_activity > self.idle_timeout_s:
                    logger.warning("kvtune probe target: initiator %s idle for %.0f s; closing",
                                   remote_name, self.idle_timeout_s)
                    return
        finally:
            self._emit_pending(info)
            buf.release()
            self._forget(remote_name)

    def _forget(self, remote_name: str) -> None:
        try:
            self.agent.remove_remote_agent(remote_name)
        except Exception:
            logger.debug("remove_remote_agent(%s) failed", remote_name, exc_info=True)
        self.agent = None  # its progress thread ends with it

    def _drain_notifs(self, info: tracing.SpanContextInfo) -> int:
        """Take new notifications (stamping their arrival); their spans are made once the
        initiator pauses (or the backlog is long), not while it is timing transfers."""
        notifs = self.agent.get_new_notifs()
        now = time.time_ns()
        if not notifs:
            if self._pending and (now - self._pending[-1][1] > NOTIFY_QUIET_NS):
                self._emit_pending(info)
            return 0
        n = 0
        for msgs in notifs.values():
            for raw in msgs:
                n += 1
                if self.tracer is not None:
                    self._pending.append((raw, now))
        self.notifs_received += n
        if len(self._pending) >= MAX_PENDING_NOTIFS:
            self._emit_pending(info)
        return n

    def _emit_pending(self, info: tracing.SpanContextInfo) -> None:
        pending, self._pending = self._pending, []
        for raw, received_ns in pending:
            try:
                notif = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):  # not the probe's (e.g. a bare loop)
                logger.debug("kvtune probe target: no span for a non-JSON notification %r", raw[:80])
                continue
            if isinstance(notif, dict) and "t" in notif:
                tracing.emit_notify(self.tracer, info, notif, received_ns)

    def _command(self, ch: Channel, msg: dict, buf: RegisteredBuffer, info: tracing.SpanContextInfo,
                 notifs_before: int, session_end: float) -> bool:
        """Answers one command (an ``error`` frame for a bad one); False once the session ends."""
        try:
            cmd = commands.parse_command(msg, buf.nbytes)
        except ProbeError as exc:
            ch.send({"type": "error", "message": str(exc)})
            return True
        if cmd.kind == "bye":
            ch.send({"type": "bye"})
            return False
        if cmd.kind == "ping":
            ch.send({"type": "pong"})
        elif cmd.kind == "fill":
            buf.fill(cmd.seed, cmd.ranges)
            ch.send({"type": "ok"})
        elif cmd.kind == "digest":
            ch.send({"type": "digest", "sha256": buf.digest(cmd.ranges)})
        else:  # stats: wait (bounded) until the notifications the initiator expects have arrived
            deadline = min(time.monotonic() + cmd.timeout_s, session_end)
            while self.notifs_received - notifs_before < cmd.expect and time.monotonic() < deadline:
                self._drain_notifs(info)
                time.sleep(POLL_INTERVAL_S)
            self._emit_pending(info)
            ch.send({"type": "stats", "notifs": self.notifs_received - notifs_before})
        return True


def _tell(ch: Channel, exc: BaseException) -> None:
    """Tells the peer why its session ended (best effort: it may be gone or not reading)."""
    text = str(exc) if isinstance(exc, ProbeError) else f"target error: {type(exc).__name__}: {exc}"
    try:
        ch.send({"type": "error", "message": text[:2000]})
    except ProbeError:
        pass


# --- a target in a child process (the default: both sides on this host) -------------------------
# A subprocess running ``python -m kvtune.probe serve`` rather than a multiprocessing child: it
# works from notebooks and from scripts without a ``__main__`` guard, and it is exactly what a user
# runs on a remote host.

READY_PREFIX = "kvtune probe serve: listening on "
"""First line ``serve`` prints on stdout once it accepts connections: ``... HOST:PORT``."""


@dataclass
class LocalTarget:
    """A target serving one session in a child process on this host."""

    process: subprocess.Popen
    host: str
    port: int

    @property
    def peer(self) -> str:
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the child to finish its session, then terminate (and kill) it if needed."""
        try:
            self.process.wait(timeout_s)
            return
        except subprocess.TimeoutExpired:
            pass
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout_s)


def spawn_local_target(*, backend: str = DEFAULT_BACKEND, max_mem_mb: int = DEFAULT_TARGET_MAX_MEM_MB,
                       fabric: str = "", spans_path: str | Path | None = None,
                       bind: str = "127.0.0.1", env: dict[str, str] | None = None,
                       launch_prefix: Sequence[str] = ()) -> LocalTarget:
    """Start ``python -m kvtune.probe serve --port 0 --max-sessions 1`` and wait until it listens.
    The child inherits ``os.environ`` (so ``UCX_*`` settings apply to both sides) updated with
    ``env`` (where ``""`` unsets a variable)."""
    cmd = [*launch_prefix, sys.executable, "-P", "-m", "kvtune.probe", "serve", "--bind", bind, "--port", "0",
           "--backend", backend, "--max-mem-mb", str(max_mem_mb), "--max-sessions", "1"]
    if fabric:
        cmd += ["--fabric", fabric]
    if spans_path:
        cmd += ["--spans-file", str(spans_path)]
    child_env = {**os.environ, **(env or {})}
    for key in [k for k, v in (env or {}).items() if v == ""]:  # "" unsets a variable
        child_env.pop(key, None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            env=child_env)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:  # keep reading so the child never blocks on a full pipe
        assert proc.stdout is not None
        ready = False
        for line in proc.stdout:
            if ready:  # the child's later output (e.g. UCX logs) goes on to our stderr
                sys.stderr.write(line)
                continue
            ready = line.startswith(READY_PREFIX)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, name="kvtune-probe-target-stdout", daemon=True).start()
    deadline = time.monotonic() + SPAWN_READY_TIMEOUT_S
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            raise ProbeError(f"local probe target did not start within {SPAWN_READY_TIMEOUT_S:g} s") from None
        if line is None:
            proc.wait(10)
            raise ProbeError(f"local probe target exited during start-up (exit code "
                             f"{proc.returncode}); see its log above")
        if line.startswith(READY_PREFIX):
            host, _, port = line[len(READY_PREFIX):].strip().rpartition(":")
            return LocalTarget(proc, host, int(port))


def serve(bind: str = "127.0.0.1", port: int = DEFAULT_PORT, *, backend: str = DEFAULT_BACKEND,
          max_mem_mb: int = DEFAULT_TARGET_MAX_MEM_MB, fabric: str = "",
          spans_file: str | Path | None = None, max_sessions: int | None = None,
          session_max_s: float = SESSION_MAX_S, announce=None) -> int:
    """Run a probe target until interrupted (or ``max_sessions`` sessions); ``announce`` gets the
    ``READY_PREFIX HOST:PORT`` line once it listens. Spans go to ``spans_file`` (a JSON-lines file
    or a directory) when given, and where the ``OTEL_*``/``KVTUNE_SPANS_DIR`` variables say.
    Returns the number of sessions served."""
    tel = None
    tracer = None
    from kvtune import telemetry
    if spans_file is not None or telemetry.configured_by_env():
        try:
            tel = telemetry.setup("probe", json_path=spans_file)
            tracer = tel.tracer
        except Exception:  # telemetry never stops the probe
            logger.warning("kvtune probe target: span output unavailable", exc_info=True)
    target = ProbeTarget(bind, port, backend=backend, max_mem_mb=max_mem_mb, fabric=fabric,
                         tracer=tracer, session_max_s=session_max_s)
    host, bound_port = target.address
    (announce or _announce)(f"{READY_PREFIX}{host}:{bound_port}")
    try:
        return target.serve_forever(max_sessions=max_sessions)
    finally:
        if tel is not None:
            tel.shutdown()


def _announce(line: str) -> None:
    print(line, flush=True)
