"""Durable conversation state: per conversation, its turn counter and the decode's last
``kv_transfer_params`` (where the decode left the conversation's KV), with an expiry.

Two stores implement :class:`ConversationStore`: :class:`SqliteConversationStore` (default; one
file, WAL, survives a router restart or SIGKILL) and :class:`RedisConversationStore` (``redis://``;
a minimal RESP client, no extra package). Stored params expire ``decoder_ttl_s - margin_s`` after
they were stored, i.e. before the decode frees the blocks, and expired params are never returned.

The stores are synchronous (each call is one short transaction); the server calls them from a
worker thread.
"""
from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from kvtune.errors import RouterError

Clock = Callable[[], float]
"""Wall-clock seconds since the epoch (``time.time``); injectable for tests."""


@dataclass(frozen=True)
class TurnStart:
    """What the store says when a conversation's next turn begins."""

    conversation_id: str
    turn: int
    """This turn's number, from 1."""
    kv_transfer_params: Mapping[str, Any] | None
    """The decode's params from the previous turn, or None (first turn, expired, or never stored)."""
    decode_instance: str | None
    """The decode instance that returned those params."""
    expired: bool
    """True when params had been stored but their time was up (they are not returned)."""


@runtime_checkable
class ConversationStore(Protocol):
    """Where the router keeps each conversation's turn counter and the decode's last params."""

    def begin_turn(self, conversation_id: str) -> TurnStart:
        """Count a new turn and return the previous turn's unexpired params (atomically)."""

    def store_params(self, conversation_id: str, kv_transfer_params: Mapping[str, Any],
                     decode_instance: str) -> float:
        """Store the decode's params for the next turn; returns their expiry (epoch seconds)."""

    def clear_params(self, conversation_id: str) -> None:
        """Forget the stored params (the decode's blocks are no longer valid)."""

    def close(self) -> None:
        """Release connections."""


class SqliteConversationStore:
    """:class:`ConversationStore` in one SQLite file (WAL mode; each call one transaction).

    ``params_ttl_s`` is how long stored params are used (``decoder_ttl_s - margin_s``);
    ``retention_s`` is how long a conversation's row (its turn counter) outlives its last turn.
    """

    def __init__(self, path: str | Path, *, params_ttl_s: float, retention_s: float = 86400.0,
                 clock: Clock = time.time) -> None:
        self.path = str(path)
        self.params_ttl_s = float(params_ttl_s)
        self.retention_s = float(retention_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._ops = 0
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None,
                                       check_same_thread=False)
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            # NORMAL: a commit survives a process crash (SIGKILL); only an OS crash can lose the last.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS conversations ("
                " conversation_id TEXT PRIMARY KEY,"
                " turn INTEGER NOT NULL,"
                " kv_params TEXT,"
                " decode_instance TEXT,"
                " params_expires_at REAL,"
                " updated_at REAL NOT NULL)")
        except sqlite3.Error as exc:
            raise RouterError(f"state {self.path}: cannot open SQLite conversation store: {exc}") from None

    def begin_turn(self, conversation_id: str) -> TurnStart:
        now = self._clock()
        with self._lock:
            self._ops += 1
            if self._ops % 1000 == 1:
                self._db.execute("DELETE FROM conversations WHERE updated_at < ?",
                                 (now - self.retention_s,))
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute(
                    "SELECT turn, kv_params, decode_instance, params_expires_at, updated_at "
                    "FROM conversations WHERE conversation_id = ?", (conversation_id,)).fetchone()
                if row is None or row[4] < now - self.retention_s:
                    turn, params, instance, expired = 1, None, None, False
                else:
                    turn = int(row[0]) + 1
                    expired = row[1] is not None and (row[3] is None or row[3] <= now)
                    params = json.loads(row[1]) if row[1] is not None and not expired else None
                    instance = row[2] if params is not None else None
                # The params are handed out once: the next turn's prefill consumes the decode's blocks.
                self._db.execute(
                    "INSERT INTO conversations (conversation_id, turn, kv_params, decode_instance,"
                    " params_expires_at, updated_at) VALUES (?, ?, NULL, NULL, NULL, ?)"
                    " ON CONFLICT(conversation_id) DO UPDATE SET turn = excluded.turn,"
                    " kv_params = NULL, decode_instance = NULL, params_expires_at = NULL,"
                    " updated_at = excluded.updated_at",
                    (conversation_id, turn, now))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return TurnStart(conversation_id, turn, params, instance, expired)

    def store_params(self, conversation_id: str, kv_transfer_params: Mapping[str, Any],
                     decode_instance: str) -> float:
        now = self._clock()
        expires_at = now + self.params_ttl_s
        blob = json.dumps(dict(kv_transfer_params), sort_keys=True)
        with self._lock:
            self._db.execute(
                "INSERT INTO conversations (conversation_id, turn, kv_params, decode_instance,"
                " params_expires_at, updated_at) VALUES (?, 1, ?, ?, ?, ?)"
                " ON CONFLICT(conversation_id) DO UPDATE SET kv_params = excluded.kv_params,"
                " decode_instance = excluded.decode_instance,"
                " params_expires_at = excluded.params_expires_at, updated_at = excluded.updated_at",
                (conversation_id, blob, decode_instance, expires_at, now))
        return expires_at

    def clear_params(self, conversation_id: str) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE conversations SET kv_params = NULL, decode_instance = NULL,"
                " params_expires_at = NULL WHERE conversation_id = ?", (conversation_id,))

    def close(self) -> None:
        with self._lock:
            self._db.close()


# --- Redis ----------------------------------------------------------------------------------------
class _Resp:
    """A minimal, blocking RESP2 client: enough for GET/SET/INCR/EXPIRE/DEL/MULTI/EXEC."""

    def __init__(self, host: str, port: int, db: int, password: str | None, timeout_s: float) -> None:
        self._addr = (host, port)
        self._db, self._password, self._timeout_s = db, password, timeout_s
        self._sock: socket.socket | None = None
        self._buf = b""

    def _connect(self) -> None:
        self._sock = socket.create_connection(self._addr, timeout=self._timeout_s)
        self._buf = b""
        if self._password:
            self._call_raw("AUTH", self._password)
        if self._db:
            self._call_raw("SELECT", str(self._db))

    def call(self, *args: str | bytes) -> Any:
        """Send one command, return its reply; reconnects once on a broken connection."""
        for attempt in (0, 1):
            try:
                if self._sock is None:
                    self._connect()
                return self._call_raw(*args)
            except (OSError, ConnectionError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def pipeline(self, commands: list[tuple[str, ...]]) -> list[Any]:
        """Send several commands in one write, return their replies in order (reconnects once)."""
        for attempt in (0, 1):
            try:
                if self._sock is None:
                    self._connect()
                assert self._sock is not None
                self._sock.sendall(b"".join(self._encode(*c) for c in commands))
                return [self._read() for _ in commands]
            except (OSError, ConnectionError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _call_raw(self, *args: str | bytes) -> Any:
        assert self._sock is not None
        self._sock.sendall(self._encode(*args))
        return self._read()

    @staticmethod
    def _encode(*args: str | bytes) -> bytes:
        parts = [b"*%d\r\n" % len(args)]
        for a in args:
            b = a.encode() if isinstance(a, str) else a
            parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
        return b"".join(parts)

    def _line(self) -> bytes:
        while b"\r\n" not in self._buf:
            self._fill()
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line

    def _fill(self) -> None:
        assert self._sock is not None
        chunk = self._sock.recv(65536)
        if not chunk:
            raise ConnectionError("redis closed the connection")
        self._buf += chunk

    def _read(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RouterError(f"redis error: {rest.decode(errors='replace')}")
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self._buf) < n + 2:
                self._fill()
            data, self._buf = self._buf[:n], self._buf[n + 2:]
            return data
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._read() for _ in range(n)]
        raise RouterError(f"redis: unexpected reply {line[:80]!r}")

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None


class RedisConversationStore:
    """:class:`ConversationStore` in Redis: ``<prefix>turn:<id>`` (INCR) and ``<prefix>params:<id>``
    (JSON, set with PX so Redis drops it when it expires; the expiry is also checked on read)."""

    def __init__(self, url: str, *, params_ttl_s: float, retention_s: float = 86400.0,
                 clock: Clock = time.time, prefix: str = "kvtune:router:",
                 timeout_s: float = 10.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "redis" or not parts.hostname:
            raise RouterError(f"state {url!r}: expected redis://[:PASSWORD@]HOST[:PORT][/DB]")
        db = int(parts.path.strip("/") or 0)
        self.url = url
        self.params_ttl_s, self.retention_s = float(params_ttl_s), float(retention_s)
        self._clock, self._prefix = clock, prefix
        self._lock = threading.Lock()
        self._r = _Resp(parts.hostname, parts.port or 6379, db, parts.password, timeout_s)
        try:
            with self._lock:
                pong = self._r.call("PING")
        except OSError as exc:
            raise RouterError(f"state {url}: cannot reach Redis: {exc}") from None
        if pong != "PONG":
            raise RouterError(f"state {url}: unexpected PING reply {pong!r}")

    def _k(self, kind: str, conversation_id: str) -> str:
        return f"{self._prefix}{kind}:{conversation_id}"

    def begin_turn(self, conversation_id: str) -> TurnStart:
        now = self._clock()
        tk, pk = self._k("turn", conversation_id), self._k("params", conversation_id)
        with self._lock:
            replies = self._r.pipeline([
                ("MULTI",), ("INCR", tk), ("PEXPIRE", tk, str(int(self.retention_s * 1000))),
                ("GET", pk), ("DEL", pk), ("EXEC",)])
        turn, _, raw, _ = replies[-1]
        params, instance, expired = None, None, False
        if raw is not None:
            entry = json.loads(raw)
            if entry["expires_at"] <= now:
                expired = True
            else:
                params, instance = entry["params"], entry["decode_instance"]
        return TurnStart(conversation_id, int(turn), params, instance, expired)

    def store_params(self, conversation_id: str, kv_transfer_params: Mapping[str, Any],
                     decode_instance: str) -> float:
        expires_at = self._clock() + self.params_ttl_s
        blob = json.dumps({"params": dict(kv_transfer_params), "decode_instance": decode_instance,
                           "expires_at": expires_at}, sort_keys=True)
        # Redis keeps the key a little longer than its use so a read can tell "expired" from "none".
        keep_ms = int((self.params_ttl_s + 60.0) * 1000)
        with self._lock:
            self._r.call("SET", self._k("params", conversation_id), blob, "PX", str(keep_ms))
        return expires_at

    def clear_params(self, conversation_id: str) -> None:
        with self._lock:
            self._r.call("DEL", self._k("params", conversation_id))

    def close(self) -> None:
        with self._lock:
            self._r.close()


def open_store(spec: str, *, params_ttl_s: float, retention_s: float = 86400.0,
               clock: Clock = time.time) -> ConversationStore:
    """Open the store a config's ``state`` names: ``sqlite:PATH``, ``:memory:`` or ``redis://...``."""
    if spec.startswith("redis://"):
        return RedisConversationStore(spec, params_ttl_s=params_ttl_s, retention_s=retention_s,
                                      clock=clock)
    if spec == ":memory:":
        return SqliteConversationStore(":memory:", params_ttl_s=params_ttl_s,
                                       retention_s=retention_s, clock=clock)
    if spec.startswith("sqlite:"):
        path = spec[len("sqlite:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise RouterError(f"state {spec!r}: expected sqlite:PATH with a file path")
        return SqliteConversationStore(path, params_ttl_s=params_ttl_s, retention_s=retention_s,
                                       clock=clock)
    raise RouterError(f"state {spec!r}: expected 'sqlite:PATH' or 'redis://HOST:PORT/DB'")
