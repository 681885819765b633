"""A throw-away ``redis-server`` on loopback for the tests and benches of the Redis state store."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT_S = 20.0


@contextmanager
def redis_server(workdir: str | Path, port: int | None = None) -> Iterator[int]:
    """A ``redis-server`` bound to 127.0.0.1 (a free port unless given; no persistence, its
    directory ``workdir``); yields its port and stops it. ``FileNotFoundError`` without the
    binary, ``RuntimeError`` when it does not answer within :data:`START_TIMEOUT_S`."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server")
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    Path(workdir).mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
