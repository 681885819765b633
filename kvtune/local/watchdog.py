"""Stacks of every thread of a hung vLLM server, taken while it hangs.

A request leg of the local pair that passes its bound is the moment a hang can still be seen: the
watchdog then dumps the Python and native stack of every thread of every process of both servers
(API server, engine core, worker) with ``py-spy dump --native``, into one text file per process,
and says so loudly in the log. Without ``py-spy`` it records each thread's kernel wait channel
(``/proc/PID/task/TID/wchan``) instead, which still tells a thread blocked in a futex from one
spinning. Nothing here changes what the servers do.

    with StackWatchdog(out_dir, processes=pair.server_pids, bound_s=20.0).watch("decode leg"):
        ...  # the request; stacks are taken once if it is still running after 20 s
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

_log = logging.getLogger(__name__)
DUMP_TIMEOUT_S: Final = 60.0
"""Bound on one ``py-spy dump`` (it pauses the process while it reads its memory)."""


@dataclass(frozen=True)
class StackDump:
    """What the watchdog wrote for one leg that passed its bound."""

    leg: str
    elapsed_s: float
    files: tuple[Path, ...]


def session_pids(leaders: Callable[[], list[int]]) -> list[int]:
    """Every process whose session id is one of ``leaders()`` (each server leads its session)."""
    sessions = set(leaders())
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in sessions:
            pids.append(int(p))
    return sorted(pids)


def _py_spy() -> str | None:
    exe = Path(sys.executable).with_name("py-spy")
    return str(exe) if exe.exists() else shutil.which("py-spy")


def _proc_text(pid: int) -> str:
    """Command line, state and each thread's name, state and wait channel (no py-spy)."""
    lines = []
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            "utf-8", "replace")
        lines.append(f"pid {pid}: {cmd[:300]}")
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            base = f"/proc/{pid}/task/{tid}"
            name = Path(f"{base}/comm").read_text().strip()
            state = Path(f"{base}/stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = Path(f"{base}/wchan").read_text().strip() or "-"
            syscall = Path(f"{base}/syscall").read_text().split()[0]
            lines.append(f"  thread {tid} {name!r} state {state} wchan {wchan} syscall {syscall}")
    except OSError as exc:
        lines.append(f"pid {pid}: gone ({exc})")
    return "\n".join(lines) + "\n"


def dump_stacks(pids: list[int], out_dir: Path, tag: str) -> tuple[Path, ...]:
    """One file per process in ``out_dir``: py-spy's stacks (or the thread table)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spy = _py_spy()
    files = []
    for pid in pids:
        text = _proc_text(pid)
        if spy is not None:
            # --native needs to stop the process (ptrace); when that is refused, read the
            # Python stacks without stopping it.
            for flags in (["--native"], ["--nonblocking"]):
                try:
                    res = subprocess.run([spy, "dump", *flags, "--pid", str(pid)],
                                         capture_output=True, text=True, timeout=DUMP_TIMEOUT_S)
                except (OSError, subprocess.TimeoutExpired) as exc:
                    text += f"[py-spy {' '.join(flags)} failed: {exc}]\n"
                    continue
                text += res.stdout
                if res.returncode == 0:
                    break
                text += f"[py-spy {' '.join(flags)} failed: {res.stderr.splitlines()[:4]}]\n"
        path = out_dir / f"{tag}-pid{pid}.txt"
        path.write_text(text)
        files.append(path)
    return tuple(files)


class StackWatchdog:
    """Dumps the servers' stacks once per watched leg that runs longer than ``bound_s``."""

    def __init__(self, out_dir: str | os.PathLike[str], *, leaders: Callable[[], list[int]],
                 bound_s: float) -> None:
        if not bound_s > 0:
            raise ValueError(f"StackWatchdog: bound_s expected > 0, got {bound_s!r}")
        self.out_dir = Path(out_dir)
        self.leaders = leaders
        self.bound_s = bound_s
        self.dumps: list[StackDump] = []
        self._lock = threading.Lock()
        self._count = 0

    @contextlib.contextmanager
    def watch(self, leg: str) -> Iterator[None]:
        """Within the block, a timer; if it fires, the stacks of every server process."""
        with self._lock:
            self._count += 1
            tag = f"{self._count:03d}-{''.join(c if c.isalnum() else '-' for c in leg)[:60]}"
        t0 = time.monotonic()

        def fire() -> None:
            elapsed = time.monotonic() - t0
            _log.warning("kvtune watchdog: %s still running after %.0f s; dumping every server "
                         "thread's stack into %s", leg, elapsed, self.out_dir)
            files = dump_stacks(session_pids(self.leaders), self.out_dir, tag)
            with self._lock:
                self.dumps.append(StackDump(leg, elapsed, files))

        timer = threading.Timer(self.bound_s, fire)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
