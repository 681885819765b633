"""Loopback helpers shared by the tests."""
from __future__ import annotations

import socket

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now (bound to port 0, then released):
    for a server the test starts, or as an endpoint that refuses connections."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])
