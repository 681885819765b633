"""The renewable decode lease: the decode side's bookkeeping and its loopback channel.

Design (phase 1 of issue 28; off by default; no vLLM file edited)
=================================================================
vLLM (0.32 and 0.33, ``nixl/pull_scheduler.py``) gives a bidirectional decode's finished turn one
fixed deadline: ``request_finished`` sets ``_reqs_need_send[req] = perf_counter() +
decoder_kv_blocks_ttl`` on the decode's scheduler and exports the same number as
``remote_blocks_expiry_time``. ``build_connector_meta`` ships ``_reqs_need_send`` to the workers
(with ``scheduler_clock``, the scheduler's ``perf_counter`` then); each worker rebases it onto its
own clock and keeps it in ``_reqs_to_send``, re-assigning (not max-ing) any deadline shipped again
for a request still in ``_reqs_to_process``; ``_reap_expired_send_leases`` frees what is past due
(``finished_sending``), and the scheduler keeps stepping while such requests exist
(``Scheduler.has_finished_requests``). The prefill, before a turn-2 readback,
``_is_turn2_read_expired``: declines when ``now + 5 s >= remote_blocks_expiry_time - offset``,
``offset`` being the decode scheduler's ``perf_counter`` epoch measured at the NIXL handshake (the
side-channel listener runs in the scheduler's process for exactly this).

How a renewal travels:

1. The router asks the decode over this module's channel (TCP on 127.0.0.1, one JSON object per
   line, :data:`MAX_LINE_BYTES` a line, no pickle) to ``renew`` request R for ``lease_s`` seconds.
2. :class:`LeaseBook` (decode scheduler process, the channel's thread) computes the new deadline in
   the scheduler's own ``perf_counter`` - the clock of ``remote_blocks_expiry_time`` - granting
   at most :data:`kvtune.vllm_pd.LEASE_MAX_S` (default: ``decoder_kv_blocks_ttl``) and never
   shortening it, records it as pending and answers it (with the scheduler's ``now``).
3. On the scheduler's next step kvtune's ``build_connector_meta`` adds the pending deadlines to the
   metadata's ``reqs_to_send``: every worker re-assigns its deadline for R (rebased like vLLM's
   own), so the worker frees the blocks at the renewed time, not the first one.
4. The router rewrites ``remote_blocks_expiry_time`` in the params it gives the next turn's
   prefill with the deadline the decode answered (it renews once more right then): the expiry the
   prefill checks is the renewed one, in the clock the prefill's offset was measured against.
   The router itself never computes a time in that clock.

A renewal is refused (``lapsing``) once the deadline in force is less than :data:`RENEW_GUARD_S`
away: a worker step that began before the renewal reached the scheduler could still free the
blocks at the old deadline, while the router would believe them renewed. The guard assumes no
engine step (metadata built -> expired leases reaped) lasts that long. A ``release`` shortens the
deadline; it is safe only because the router forgets every copy of the params first (below):
the prefill never sees an expiry later than the decode's.

Release: the router first forgets the conversation's stored params (no later turn can be given
these blocks), then asks ``release``: the deadline becomes "now" through the same path (3), the
worker frees the blocks at its next step, and the ``kv.retention`` span says ``ended``. A renewal
after a release is refused (``released``). Blocks nobody renews lapse at their deadline
(``lapsed``); a router that dies stops renewing, so its leases lapse. A decode without kvtune's
connector, or without :data:`kvtune.vllm_pd.LEASE_PORT` in its extra config, answers no
:data:`kvtune.vllm_pd.PARAMS_LEASE_PORT` and keeps vLLM's fixed TTL.

Clock domains: deadlines here and on the wire are the decode scheduler's ``perf_counter``
(per process, per host); the workers rebase them with ``scheduler_clock`` as vLLM does; the
prefill with its handshake offset. The channel binds loopback only (phase 1: router and decode on
one host; a fleet needs an authenticated channel).

This module imports no vLLM: :mod:`kvtune.connectors.scheduler` drives a :class:`LeaseBook` and a
:class:`LeaseChannel`; :class:`LeaseNote` travels to the workers for the ``kv.retention`` span.
"""
from __future__ import annotations

import json
import logging
import math
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvtune import vllm_pd as pd

_log = logging.getLogger(__name__)

RENEW_GUARD_S: Final = pd.READBACK_SAFETY_MARGIN_S
"""A renewal is refused when the deadline in force is nearer than this (see the module's design
note); vLLM's own readback margin, so a prefill would already decline such blocks."""
MAX_LINE_BYTES: Final = 1024
"""Longest request line the channel reads (a renew is under 200 bytes)."""
MAX_ID_CHARS: Final = 256
"""Longest request id accepted (vLLM's ids are under 100 characters)."""
MAX_CONNECTIONS: Final = 8
"""Connections the channel serves at once (a router keeps one per renewal round); more get
``busy``."""
IDLE_TIMEOUT_S: Final = 5.0
"""A connection silent this long is closed."""
MAX_HELD: Final = 1_000_000
"""Requests the book tracks at most (a decode holds far fewer blocks' worth of requests)."""


@dataclass(frozen=True, slots=True)
class LeaseNote:
    """What the decode's workers learn about one held request's lease (for ``kv.retention``;
    pickled with the connector metadata, so only plain values)."""

    renewals: int
    lease_s: float | None
    """Length of the last renewal granted, seconds (None: never renewed)."""
    released: bool


@dataclass(frozen=True, slots=True)
class LeaseReply:
    """One answer of the channel (also what :meth:`LeaseBook.renew` / ``release`` return)."""

    ok: bool
    expiry: float | None = None
    """The deadline in force, decode scheduler ``perf_counter`` seconds."""
    now: float | None = None
    error: str | None = None
    """One of :data:`kvtune.vllm_pd.LEASE_ERRORS` when not ok."""
    detail: str = ""

    def to_wire(self) -> dict[str, Any]:
        if self.ok:
            return {pd.LEASE_OK: True, pd.LEASE_EXPIRY: self.expiry, pd.LEASE_NOW: self.now}
        return {pd.LEASE_OK: False, pd.LEASE_ERROR: self.error, pd.LEASE_DETAIL: self.detail}


def _fail(error: str, detail: str) -> LeaseReply:
    assert error in pd.LEASE_ERRORS, error
    return LeaseReply(False, error=error, detail=detail)


def _unknown(request_id: str) -> LeaseReply:
    return _fail("unknown_request", f"no blocks held for {request_id!r} (read back, freed, or "
                 "never retained)")


@dataclass(slots=True)
class _Held:
    expiry: float
    renewals: int = 0
    lease_s: float | None = None
    released: bool = False


class LeaseBook:
    """The decode scheduler's record of held requests and their deadlines (thread-safe).

    The scheduler thread calls :meth:`hold` (a turn finished, blocks retained), :meth:`gone`
    (vLLM freed them: read back or expired) and :meth:`drain` (each step, when :attr:`pending`);
    the channel's threads call :meth:`renew` and :meth:`release`."""

    def __init__(self, max_lease_s: float, *, clock: Callable[[], float] = time.perf_counter,
                 guard_s: float = RENEW_GUARD_S) -> None:
        if not (isinstance(max_lease_s, (int, float)) and math.isfinite(max_lease_s)
                and max_lease_s > 0):
            raise ValueError(f"{pd.LEASE_MAX_S}: expected a positive number of seconds, "
                             f"got {max_lease_s!r}")
        self.max_lease_s = float(max_lease_s)
        self.guard_s = float(guard_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._deadlines: dict[str, float] = {}
        self._notes: dict[str, LeaseNote] = {}
        self.pending = False
        """Whether :meth:`drain` has something for the next metadata (read without the lock)."""

    def now(self) -> float:
        return self._clock()

    # --- scheduler thread ---------------------------------------------------------------------
    def hold(self, request_id: str, expiry: float) -> None:
        """vLLM retained ``request_id``'s blocks until ``expiry`` (its ``remote_blocks_expiry_time``)."""
        with self._lock:
            if len(self._held) >= MAX_HELD and request_id not in self._held:
                return
            self._held[request_id] = _Held(float(expiry))
            self._notes[request_id] = LeaseNote(0, None, False)
            self.pending = True

    def gone(self, request_ids: Iterable[str]) -> None:
        """vLLM freed these requests' blocks (``finished_sending``)."""
        with self._lock:
            for rid in request_ids:
                self._held.pop(rid, None)
                self._deadlines.pop(rid, None)
                self._notes.pop(rid, None)

    def drain(self) -> tuple[dict[str, float], dict[str, LeaseNote]]:
        """(new deadlines, notes) for the next connector metadata; cleared here."""
        with self._lock:
            deadlines, notes = self._deadlines, self._notes
            self._deadlines, self._notes = {}, {}
            self.pending = False
        return deadlines, notes

    def held(self) -> dict[str, float]:
        """Request id -> deadline in force (a copy)."""
        with self._lock:
            return {rid: h.expiry for rid, h in self._held.items()}

    # --- channel threads ----------------------------------------------------------------------
    def renew(self, request_id: str, lease_s: float) -> LeaseReply:
        """Hold ``request_id``'s blocks until ``now + min(lease_s, max_lease_s)`` (never earlier
        than already): the decode bounds what it grants, the reply says what it granted."""
        if not (isinstance(lease_s, (int, float)) and not isinstance(lease_s, bool)
                and math.isfinite(lease_s) and lease_s > 0):
            return _fail("bad_request", f"{pd.LEASE_S}: expected a positive, finite number of "
                         f"seconds, got {lease_s!r}")
        lease_s = min(float(lease_s), self.max_lease_s)
        with self._lock:
            h = self._held.get(request_id)
            now = self._clock()
            if h is None:
                return _unknown(request_id)
            if h.released:
                return _fail("released", f"{request_id!r} was released; not renewed")
            if h.expiry - now < self.guard_s:
                return _fail("lapsing", f"{request_id!r} expires in {h.expiry - now:.3f} s, under "
                             f"the {self.guard_s:g} s a renewal needs; not renewed")
            h.expiry = max(h.expiry, now + float(lease_s))
            h.renewals += 1
            h.lease_s = float(lease_s)
            self._deadlines[request_id] = h.expiry
            self._notes[request_id] = LeaseNote(h.renewals, h.lease_s, False)
            self.pending = True
            return LeaseReply(True, expiry=h.expiry, now=now)

    def release(self, request_id: str) -> LeaseReply:
        """Free ``request_id``'s blocks at the workers' next step (idempotent)."""
        with self._lock:
            h = self._held.get(request_id)
            now = self._clock()
            if h is None:
                return _unknown(request_id)
            if not h.released:
                h.released = True
                h.expiry = now
                self._deadlines[request_id] = now
                self._notes[request_id] = LeaseNote(h.renewals, h.lease_s, True)
                self.pending = True
            return LeaseReply(True, expiry=h.expiry, now=now)

    def hello(self) -> dict[str, Any]:
        return {pd.LEASE_OK: True, pd.LEASE_NOW: self._clock(),
                pd.LEASE_MAX_LEASE_S: self.max_lease_s}


def handle_line(book: LeaseBook, line: bytes) -> dict[str, Any]:
    """The reply (wire dict) to one request line (without its newline)."""
    if len(line) > MAX_LINE_BYTES:
        return _fail("too_large", f"request line over {MAX_LINE_BYTES} bytes").to_wire()
    try:
        msg = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return _fail("bad_request", f"expected one JSON object per line: {exc}"[:200]).to_wire()
    if not isinstance(msg, Mapping):
        return _fail("bad_request", f"expected a JSON object, got {type(msg).__name__}").to_wire()
    op = msg.get(pd.LEASE_OP)
    if op not in pd.LEASE_OPS:
        return _fail("bad_request", f"{pd.LEASE_OP}: expected one of {list(pd.LEASE_OPS)}, "
                     f"got {op!r}"[:200]).to_wire()
    if op == pd.LEASE_OP_HELLO:
        return book.hello()
    rid = msg.get(pd.LEASE_ID)
    if not isinstance(rid, str) or not rid or len(rid) > MAX_ID_CHARS:
        return _fail("bad_request", f"{pd.LEASE_ID}: expected a request id of 1 to "
                     f"{MAX_ID_CHARS} characters").to_wire()
    if op == pd.LEASE_OP_RELEASE:
        return book.release(rid).to_wire()
    return book.renew(rid, msg.get(pd.LEASE_S)).to_wire()


class _Handler(socketserver.StreamRequestHandler):
    timeout = IDLE_TIMEOUT_S
    server: _Server

    def handle(self) -> None:
        if not self.server.admit():
            self._send(_fail("busy", f"over {MAX_CONNECTIONS} connections").to_wire())
            return
        try:
            while True:
                line = self.rfile.readline(MAX_LINE_BYTES + 1)
                if not line:
                    return
                if not line.endswith(b"\n") and len(line) > MAX_LINE_BYTES:
                    self._send(handle_line(self.server.book, line))
                    return  # the rest of an over-long line is not read
                self._send(handle_line(self.server.book, line.rstrip(b"\r\n")))
        except (OSError, socket.timeout):
            return
        finally:
            self.server.leave()

    def _send(self, reply: Mapping[str, Any]) -> None:
        self.wfile.write(json.dumps(reply, allow_nan=False).encode() + b"\n")
        self.wfile.flush()


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], book: LeaseBook) -> None:
        self.book = book
        self._count_lock = threading.Lock()
        self._open = 0
        super().__init__(address, _Handler)

    def admit(self) -> bool:
        with self._count_lock:
            if self._open >= MAX_CONNECTIONS:
                return False
            self._open += 1
            return True

    def leave(self) -> None:
        with self._count_lock:
            self._open = max(0, self._open - 1)


class LeaseChannel:
    """The decode's lease channel: serves :func:`handle_line` on ``127.0.0.1:port`` (0: any free
    port; :attr:`port` says which) in a daemon thread until :meth:`close`."""

    HOST: Final = "127.0.0.1"

    def __init__(self, book: LeaseBook, port: int = 0) -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"{pd.LEASE_PORT}: expected a port number 0..65535, got {port!r}")
        self.book = book
        self._server = _Server((self.HOST, port), book)
        self.port: int = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={
            "poll_interval": 0.5}, name="kvtune-lease-channel", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def lease_settings(extra_config: Mapping[str, Any] | None,
                   decoder_ttl_s: float) -> tuple[int, float] | None:
    """(port, max lease seconds) from a decode's ``kv_connector_extra_config``; None when the
    lease is off (no :data:`kvtune.vllm_pd.LEASE_PORT`). Raises ValueError naming the key."""
    extra = extra_config or {}
    port = extra.get(pd.LEASE_PORT)
    if port is None:
        return None
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"{pd.KV_CONNECTOR_EXTRA_CONFIG}.{pd.LEASE_PORT}: expected a port "
                         f"number 0..65535, got {port!r}")
    max_s = extra.get(pd.LEASE_MAX_S, decoder_ttl_s)
    try:
        max_s = float(max_s)
    except (TypeError, ValueError):
        raise ValueError(f"{pd.KV_CONNECTOR_EXTRA_CONFIG}.{pd.LEASE_MAX_S}: expected seconds, "
                         f"got {max_s!r}") from None
    if not (math.isfinite(max_s) and max_s > 0):
        raise ValueError(f"{pd.KV_CONNECTOR_EXTRA_CONFIG}.{pd.LEASE_MAX_S}: expected a positive "
                         f"number of seconds, got {max_s!r}")
    return port, max_s
