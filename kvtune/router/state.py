"""Durable conversation state: per conversation, its turn counter and the decode's last
``kv_transfer_params`` (where the decode left the conversation's KV), with an expiry.

Two stores implement :class:`ConversationStore`: :class:`SqliteConversationStore` (default; one
file, WAL, survives a router restart or SIGKILL) and :class:`RedisConversationStore` (``redis://``;
a minimal RESP client, no extra package, that reads every reply and drops its connection on any
error). Stored params expire ``decoder_ttl_s - margin_s`` after they were stored, i.e. before the
decode frees the blocks, and expired params are never returned.

Conversation ids are checked by :func:`check_conversation_id` (a non-empty string, valid UTF-8, at
most :data:`MAX_CONVERSATION_ID_BYTES`); a store's own failure raises :class:`StateStoreError`.

The stores are synchronous (each call is one short transaction). The server runs SQLite's calls on
its event loop (a local transaction takes tens of microseconds, less than handing it to a thread;
the router opens it with a short busy timeout, :data:`SQLITE_ON_LOOP_BUSY_TIMEOUT_S`) and any other
store's on one worker thread.
"""
from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from kvtune.errors import RouterError
from kvtune.redact import redact_url
from kvtune.vllm_pd import ROUTER_ONLY_KEYS

Clock = Callable[[], float]
"""Wall-clock seconds since the epoch (``time.time``); injectable for tests."""

SQLITE_ON_LOOP_BUSY_TIMEOUT_S = 0.5
"""How long the router's SQLite store waits for another process's write lock on its file (the
router's own calls never wait for each other): the wait blocks the router's event loop, so it is
short; past it the call fails and the turn is served without history (``kv.router.state_error``)."""
MAX_CONVERSATION_ID_BYTES = 256
"""Longest conversation id accepted, in UTF-8 bytes: UUIDs take 36, composite ids (tenant, agent,
session) rarely 100; without a cap each new id can grow the store by the body size (8 MiB)."""


class StateStoreError(RouterError):
    """The conversation store failed (unreachable, an error reply, a broken connection); the
    message names the store and the operation."""


class InvalidConversationId(RouterError, ValueError):
    """A conversation id the stores cannot key by: says which rule it breaks."""


def check_conversation_id(conversation_id: object) -> str:
    """``conversation_id`` when it is a non-empty string of at most
    :data:`MAX_CONVERSATION_ID_BYTES` UTF-8 bytes (no lone surrogates); else
    :class:`InvalidConversationId` naming the rule."""
    if not isinstance(conversation_id, str) or not conversation_id:
        raise InvalidConversationId(f"conversation_id: expected a non-empty string, got "
                                    f"{type(conversation_id).__name__}")
    try:
        n = len(conversation_id.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidConversationId(
            f"conversation_id: expected valid Unicode text, got a lone surrogate "
            f"{conversation_id[exc.start]!r} at character {exc.start} (not encodable as UTF-8)"
        ) from None
    if n > MAX_CONVERSATION_ID_BYTES:
        raise InvalidConversationId(f"conversation_id: expected at most {MAX_CONVERSATION_ID_BYTES} "
                                    f"UTF-8 bytes, got {n}")
    return conversation_id


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
    kept: bool = False
    """True when unexpired params were stored but ``accept`` refused them: they are not returned
    and stay stored (for the turn whose history they encode)."""


Accept = Callable[[Mapping[str, Any]], bool]
"""``begin_turn``'s ``accept``: given the stored params, whether this turn takes them (they are
then handed out and removed) or leaves them stored for another turn."""


@runtime_checkable
class ConversationStore(Protocol):
    """Where the router keeps each conversation's turn counter and the decode's last params."""

    def begin_turn(self, conversation_id: str, accept: Accept | None = None) -> TurnStart:
        """Count a new turn and return the previous turn's unexpired params (atomically), handing
        them out once; with ``accept``, only when ``accept(params)`` is true (otherwise they stay
        stored and ``kept`` says so)."""

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
    ``retention_s`` is how long a conversation's row (its turn counter) outlives its last turn;
    ``busy_timeout_s`` how long a call waits for another process's write lock on the file.
    """

    def __init__(self, path: str | Path, *, params_ttl_s: float, retention_s: float = 86400.0,
                 clock: Clock = time.time, busy_timeout_s: float = 30.0) -> None:
        self.path = str(path)
        self.params_ttl_s = float(params_ttl_s)
        self.retention_s = float(retention_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._ops = 0
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None,
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

    def begin_turn(self, conversation_id: str, accept: Accept | None = None) -> TurnStart:
        check_conversation_id(conversation_id)
        now = self._clock()
        kept = False
        with self._lock, self._errors("begin_turn"):
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
                kept = params is not None and accept is not None and not accept(params)
                if kept:  # refused: left stored for the turn whose history they encode
                    params, instance = None, None
                    self._db.execute("UPDATE conversations SET turn = ?, updated_at = ? "
                                     "WHERE conversation_id = ?", (turn, now, conversation_id))
                else:  # handed out once: the next turn's prefill consumes the decode's blocks
                    self._db.execute(
                        "INSERT INTO conversations (conversation_id, turn, kv_params,"
                        " decode_instance, params_expires_at, updated_at)"
                        " VALUES (?, ?, NULL, NULL, NULL, ?)"
                        " ON CONFLICT(conversation_id) DO UPDATE SET turn = excluded.turn,"
                        " kv_params = NULL, decode_instance = NULL, params_expires_at = NULL,"
                        " updated_at = excluded.updated_at",
                        (conversation_id, turn, now))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return TurnStart(conversation_id, turn, params, instance, expired, kept)

    def store_params(self, conversation_id: str, kv_transfer_params: Mapping[str, Any],
                     decode_instance: str) -> float:
        check_conversation_id(conversation_id)
        now = self._clock()
        expires_at = now + self.params_ttl_s
        blob = json.dumps(dict(kv_transfer_params), sort_keys=True)
        with self._lock, self._errors("store_params"):
            # A new row starts at turn 0: turns are counted by begin_turn only (as in Redis).
            self._db.execute(
                "INSERT INTO conversations (conversation_id, turn, kv_params, decode_instance,"
                " params_expires_at, updated_at) VALUES (?, 0, ?, ?, ?, ?)"
                " ON CONFLICT(conversation_id) DO UPDATE SET kv_params = excluded.kv_params,"
                " decode_instance = excluded.decode_instance,"
                " params_expires_at = excluded.params_expires_at, updated_at = excluded.updated_at",
                (conversation_id, blob, decode_instance, expires_at, now))
        return expires_at

    def clear_params(self, conversation_id: str) -> None:
        check_conversation_id(conversation_id)
        with self._lock, self._errors("clear_params"):
            self._db.execute(
                "UPDATE conversations SET kv_params = NULL, decode_instance = NULL,"
                " params_expires_at = NULL WHERE conversation_id = ?", (conversation_id,))

    def peek_params(self, conversation_id: str) -> dict[str, Any] | None:
        """The stored, unexpired params of ``conversation_id`` without handing them out (for a
        program that embeds the router and shows what its next turn will be offered)."""
        check_conversation_id(conversation_id)
        with self._lock, self._errors("peek_params"):
            row = self._db.execute(
                "SELECT kv_params, params_expires_at FROM conversations WHERE conversation_id = ?",
                (conversation_id,)).fetchone()
        if row is None or row[0] is None or row[1] is None or row[1] <= self._clock():
            return None
        params = json.loads(row[0])
        if not isinstance(params, dict):
            return None
        return {k: v for k, v in params.items() if k not in ROUTER_ONLY_KEYS}

    def forget(self, conversation_id: str) -> None:
        """Drop ``conversation_id`` (turn counter and params): its next turn is its first."""
        check_conversation_id(conversation_id)
        with self._lock, self._errors("forget"):
            self._db.execute("DELETE FROM conversations WHERE conversation_id = ?",
                             (conversation_id,))

    @contextmanager
    def _errors(self, operation: str) -> Iterator[None]:
        try:
            yield
        except (sqlite3.Error, UnicodeError, ValueError) as exc:
            raise StateStoreError(f"state {self.path}: {operation}: {type(exc).__name__}: "
                                  f"{exc}") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()


# --- Redis ----------------------------------------------------------------------------------------
REDIS_MAX_BULK_BYTES = 64 * 1024 * 1024
"""Largest bulk reply accepted (stored params are a few KiB; anything larger is a broken stream)."""
REDIS_MAX_ARRAY_ITEMS = 1024
"""Largest array reply accepted (a begin_turn EXEC answers 4 items)."""


@dataclass(frozen=True)
class RedisReplyError:
    """An error reply (``-ERR ...``, ``-OOM ...``) read as a value, so the replies after it are
    still read and the connection stays in step."""

    message: str


class _RedisConnection:
    """A minimal, blocking RESP2 client: enough for PING/INCR/PEXPIRE/GET/SET/DEL/MULTI/EXEC.

    Every exchange reads every reply it asked for (error replies are values, not exceptions), and
    any failure at all (an error reply, a reply of the wrong shape, a protocol violation, a timeout,
    a dropped connection) closes the socket: the next exchange starts on a fresh connection, so a
    reply can never be taken as the answer to a later command.
    """

    def __init__(self, host: str, port: int, db: int, password: str | None, timeout_s: float) -> None:
        self._addr = (host, port)
        self._db, self._password, self._timeout_s = db, password, timeout_s
        self._sock: socket.socket | None = None
        self._buf = b""

    def exchange(self, commands: Sequence[Sequence[str | bytes]]) -> list[Any]:
        """Send ``commands`` in one write and return every reply in order (error replies as
        :class:`RedisReplyError`). Raises :class:`StateStoreError` on a broken exchange, after
        closing the connection. A connection that was idle (reused) and turns out dead before any
        reply byte arrived is replaced once; the commands are then sent again (see
        :meth:`RedisConversationStore.begin_turn` for why a repeat is safe)."""
        for attempt in (0, 1):
            reused = self._sock is not None
            received_before = -1
            try:
                if self._sock is None:
                    self._connect()
                assert self._sock is not None
                received_before = self._received
                self._sock.sendall(b"".join(self._encode(c) for c in commands))
                return [self._read() for _ in commands]
            except (OSError, ConnectionError) as exc:
                got_reply_bytes = received_before >= 0 and self._received > received_before
                self.close()
                if attempt == 0 and reused and not got_reply_bytes:
                    continue
                raise StateStoreError(f"redis {self._addr[0]}:{self._addr[1]}: "
                                      f"{type(exc).__name__}: {exc}") from None
            except StateStoreError:
                self.close()
                raise
            except BaseException:  # anything unexpected (incl. cancellation): out of step, drop it
                self.close()
                raise
        raise AssertionError("unreachable")

    def _connect(self) -> None:
        self._sock = socket.create_connection(self._addr, timeout=self._timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""
        self._received = 0
        hello: list[tuple[str, ...]] = []
        if self._password:
            hello.append(("AUTH", self._password))
        if self._db:
            hello.append(("SELECT", str(self._db)))
        if hello:
            self._sock.sendall(b"".join(self._encode(c) for c in hello))
            for cmd in hello:
                reply = self._read()
                if isinstance(reply, RedisReplyError) or reply != "OK":
                    raise StateStoreError(f"redis {self._addr[0]}:{self._addr[1]}: {cmd[0]} "
                                          f"answered {reply!r}")

    _received = 0

    @staticmethod
    def _encode(args: Sequence[str | bytes]) -> bytes:
        parts = [b"*%d\r\n" % len(args)]
        for a in args:
            b = a.encode("utf-8") if isinstance(a, str) else a
            parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
        return b"".join(parts)

    def _line(self) -> bytes:
        while b"\r\n" not in self._buf:
            if len(self._buf) > 65536:
                raise StateStoreError("redis: reply line longer than 64 KiB (not RESP)")
            self._fill()
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line

    def _fill(self) -> None:
        assert self._sock is not None
        chunk = self._sock.recv(65536)
        if not chunk:
            raise ConnectionError("redis closed the connection")
        self._received += len(chunk)
        self._buf += chunk

    def _int(self, text: bytes, what: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise StateStoreError(f"redis: {what} {text[:40]!r} is not an integer (not RESP)") from None

    def _read(self, depth: int = 0) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode("utf-8", errors="replace")
        if kind == b"-":
            return RedisReplyError(rest.decode("utf-8", errors="replace"))
        if kind == b":":
            return self._int(rest, "integer reply")
        if kind == b"$":
            n = self._int(rest, "bulk length")
            if n < 0:
                return None
            if n > REDIS_MAX_BULK_BYTES:
                raise StateStoreError(f"redis: bulk reply of {n} bytes is over {REDIS_MAX_BULK_BYTES}")
            while len(self._buf) < n + 2:
                self._fill()
            data, end, self._buf = self._buf[:n], self._buf[n:n + 2], self._buf[n + 2:]
            if end != b"\r\n":
                raise StateStoreError("redis: bulk reply not terminated by CRLF (not RESP)")
            return data
        if kind == b"*":
            n = self._int(rest, "array length")
            if n < 0:
                return None
            if n > REDIS_MAX_ARRAY_ITEMS or depth > 2:
                raise StateStoreError(f"redis: array reply of {n} items at depth {depth} is not "
                                      "one the store sends for")
            return [self._read(depth + 1) for _ in range(n)]
        raise StateStoreError(f"redis: unexpected reply {line[:80]!r}")

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self._buf = b""


def _first_error(replies: Sequence[Any], commands: Sequence[Sequence[str | bytes]]) -> str | None:
    for cmd, reply in zip(commands, replies):
        if isinstance(reply, RedisReplyError):
            return f"{cmd[0]} answered {reply.message}"
    return None


class RedisConversationStore:
    """:class:`ConversationStore` in Redis: ``<prefix>turn:<id>`` (INCR) and ``<prefix>params:<id>``
    (JSON, set with PX so Redis drops it when it expires; the expiry is also checked on read).

    Each stored entry names its conversation, and :meth:`begin_turn` checks it: even a broken
    connection cannot hand one conversation another's params (the prefill would pull the wrong
    KV). Every failure raises :class:`StateStoreError` and drops the connection (see
    :class:`_RedisConnection`).
    """

    def __init__(self, url: str, *, params_ttl_s: float, retention_s: float = 86400.0,
                 clock: Clock = time.time, prefix: str = "kvtune:router:",
                 timeout_s: float = 10.0) -> None:
        parts = urlsplit(url)
        shown = redact_url(url)
        if parts.scheme != "redis" or not parts.hostname:
            raise RouterError(f"state {shown!r}: expected redis://[:PASSWORD@]HOST[:PORT][/DB]")
        try:
            db = int(parts.path.strip("/") or 0)
            port = parts.port or 6379
        except ValueError:
            raise RouterError(f"state {shown!r}: expected redis://[:PASSWORD@]HOST[:PORT][/DB] with "
                              "integer PORT and DB") from None
        self.url = shown
        """The store's URL as shown (its password redacted)."""
        self.params_ttl_s, self.retention_s = float(params_ttl_s), float(retention_s)
        self._clock, self._prefix = clock, prefix
        self._lock = threading.Lock()
        self._r = _RedisConnection(parts.hostname, port, db, parts.password, timeout_s)
        try:
            with self._lock:
                pong = self._r.exchange([("PING",)])[0]
        except StateStoreError as exc:
            raise RouterError(f"state {shown}: cannot reach Redis: {exc}") from None
        if pong != "PONG":
            self._r.close()
            raise RouterError(f"state {shown}: unexpected PING reply {pong!r}")

    def _k(self, kind: str, conversation_id: str) -> bytes:
        return f"{self._prefix}{kind}:".encode() + conversation_id.encode("utf-8")

    def _exchange(self, commands: list[tuple[str | bytes, ...]]) -> list[Any]:
        with self._lock:
            replies = self._r.exchange(commands)
            error = _first_error(replies, commands)
            if error is not None:
                # Every reply was read, so the connection is in step; drop it anyway (one rule:
                # any failure means a fresh connection).
                self._r.close()
        if error is not None:
            raise StateStoreError(f"state {self.url}: {error}")
        return replies

    def begin_turn(self, conversation_id: str, accept: Accept | None = None) -> TurnStart:
        """One MULTI/EXEC: count the turn, read and delete the params. Should the connection break
        after Redis ran it and the exchange be repeated, the turn counts twice and the params were
        already deleted, so the turn gets none: history is recomputed, never crossed.

        With ``accept``: the MULTI/EXEC reads without deleting, and params ``accept`` takes are
        then claimed by a compare-and-delete script (:data:`_CLAIM_SCRIPT`): only the turn that
        deletes exactly the entry it read gets them (a lost race, or a repeated exchange, gets
        none); refused params stay stored."""
        if accept is not None:
            return self._begin_turn_accepting(conversation_id, accept)
        check_conversation_id(conversation_id)
        now = self._clock()
        tk, pk = self._k("turn", conversation_id), self._k("params", conversation_id)
        commands: list[tuple[str | bytes, ...]] = [
            ("MULTI",), ("INCR", tk), ("PEXPIRE", tk, str(int(self.retention_s * 1000))),
            ("GET", pk), ("DEL", pk), ("EXEC",)]
        replies = self._exchange(commands)
        result = replies[-1]
        if not (isinstance(result, list) and len(result) == 4
                and all(isinstance(result[i], int) for i in (0, 1, 3))
                and (result[2] is None or isinstance(result[2], bytes))):
            with self._lock:
                self._r.close()
            raise StateStoreError(f"state {self.url}: begin_turn: EXEC answered {result!r:.200}, "
                                  "expected [turn, 0|1, params|nil, 0|1]")
        turn, _, raw, _ = result
        params, instance, expired = None, None, False
        if raw is not None:
            entry = _decode_entry(raw, self.url)
            if entry.get("conversation_id") != conversation_id:
                raise StateStoreError(
                    f"state {self.url}: the params stored under conversation "
                    f"{conversation_id!r:.80} name conversation "
                    f"{entry.get('conversation_id')!r:.80}; not used")
            if entry["expires_at"] <= now:
                expired = True
            else:
                params, instance = entry["params"], entry["decode_instance"]
        return TurnStart(conversation_id, turn, params, instance, expired)

    def _begin_turn_accepting(self, conversation_id: str, accept: Accept) -> TurnStart:
        check_conversation_id(conversation_id)
        now = self._clock()
        tk, pk = self._k("turn", conversation_id), self._k("params", conversation_id)
        commands: list[tuple[str | bytes, ...]] = [
            ("MULTI",), ("INCR", tk), ("PEXPIRE", tk, str(int(self.retention_s * 1000))),
            ("GET", pk), ("EXEC",)]
        result = self._exchange(commands)[-1]
        if not (isinstance(result, list) and len(result) == 3
                and all(isinstance(result[i], int) for i in (0, 1))
                and (result[2] is None or isinstance(result[2], bytes))):
            with self._lock:
                self._r.close()
            raise StateStoreError(f"state {self.url}: begin_turn: EXEC answered {result!r:.200}, "
                                  "expected [turn, 0|1, params|nil]")
        turn, _, raw = result
        if raw is None:
            return TurnStart(conversation_id, turn, None, None, False)
        entry = _decode_entry(raw, self.url)
        if entry.get("conversation_id") != conversation_id:
            raise StateStoreError(
                f"state {self.url}: the params stored under conversation {conversation_id!r:.80} "
                f"name conversation {entry.get('conversation_id')!r:.80}; not used")
        if entry["expires_at"] <= now:
            return TurnStart(conversation_id, turn, None, None, True)
        if not accept(entry["params"]):
            return TurnStart(conversation_id, turn, None, None, False, kept=True)
        claimed = self._exchange([("EVAL", _CLAIM_SCRIPT, "1", pk, raw)])[0]
        if claimed != 1:  # another turn took (or replaced) them first: recompute, never cross
            return TurnStart(conversation_id, turn, None, None, False)
        return TurnStart(conversation_id, turn, entry["params"], entry["decode_instance"], False)

    def store_params(self, conversation_id: str, kv_transfer_params: Mapping[str, Any],
                     decode_instance: str) -> float:
        check_conversation_id(conversation_id)
        expires_at = self._clock() + self.params_ttl_s
        blob = json.dumps({"conversation_id": conversation_id, "params": dict(kv_transfer_params),
                           "decode_instance": decode_instance, "expires_at": expires_at},
                          sort_keys=True)
        # Redis keeps the key a little longer than its use so a read can tell "expired" from "none".
        keep_ms = int((self.params_ttl_s + 60.0) * 1000)
        reply = self._exchange([("SET", self._k("params", conversation_id), blob, "PX",
                                 str(keep_ms))])[0]
        if reply != "OK":
            with self._lock:
                self._r.close()
            raise StateStoreError(f"state {self.url}: SET answered {reply!r:.100}, expected OK")
        return expires_at

    def clear_params(self, conversation_id: str) -> None:
        check_conversation_id(conversation_id)
        reply = self._exchange([("DEL", self._k("params", conversation_id))])[0]
        if not isinstance(reply, int):
            with self._lock:
                self._r.close()
            raise StateStoreError(f"state {self.url}: DEL answered {reply!r:.100}, expected 0 or 1")

    def close(self) -> None:
        with self._lock:
            self._r.close()


_CLAIM_SCRIPT = ("if redis.call('GET', KEYS[1]) == ARGV[1] then "
                 "return redis.call('DEL', KEYS[1]) end return 0")
"""Deletes a key only while it holds exactly the value read (1: deleted, so claimed; 0: not)."""


def _decode_entry(raw: bytes, url: str) -> dict[str, Any]:
    try:
        entry = json.loads(raw)
    except ValueError:
        raise StateStoreError(f"state {url}: stored params are not JSON") from None
    if not (isinstance(entry, dict) and isinstance(entry.get("params"), dict)
            and isinstance(entry.get("expires_at"), (int, float))
            and isinstance(entry.get("decode_instance"), str)):
        raise StateStoreError(f"state {url}: stored params lack params/decode_instance/expires_at")
    return entry


def open_store(spec: str, *, params_ttl_s: float, retention_s: float = 86400.0,
               clock: Clock = time.time, sqlite_busy_timeout_s: float = 30.0) -> ConversationStore:
    """Open the store a config's ``state`` names: ``sqlite:PATH``, ``:memory:`` or ``redis://...``
    (``sqlite_busy_timeout_s``: see :class:`SqliteConversationStore`)."""
    if spec.startswith("redis://"):
        return RedisConversationStore(spec, params_ttl_s=params_ttl_s, retention_s=retention_s,
                                      clock=clock)
    if spec == ":memory:":
        return SqliteConversationStore(":memory:", params_ttl_s=params_ttl_s,
                                       retention_s=retention_s, clock=clock,
                                       busy_timeout_s=sqlite_busy_timeout_s)
    if spec.startswith("sqlite:"):
        path = spec[len("sqlite:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise RouterError(f"state {spec!r}: expected sqlite:PATH with a file path")
        return SqliteConversationStore(path, params_ttl_s=params_ttl_s, retention_s=retention_s,
                                       clock=clock, busy_timeout_s=sqlite_busy_timeout_s)
    raise RouterError(f"state {spec!r}: expected 'sqlite:PATH' or 'redis://HOST:PORT/DB'")
