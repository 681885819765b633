"""The probe's initiator: one NIXL agent that READs from and WRITEs to a target's registered DRAM.

Memory is registered once and the descriptor lists are prepared once per layout, as vLLM's NIXL
connector does at registration; each transfer then picks descriptors by index
(``make_prepped_xfer``), posts, and polls ``check_xfer_state`` until completion, with a
notification to the target on completion.

In the ``per_block`` layout the initiator's blocks are paired with the target's in reverse order
within each region (block ``j`` of the target with block ``n-1-j`` here), as in a fragmented vLLM
block pool: NIXL merges descriptors that are adjacent on both sides, and this keeps one descriptor
per layer per K/V per block on the wire (NIXL's own descriptor count confirms it).
"""
from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass, field

import numpy as np

from kvtune import spans as S
from kvtune.errors import ProbeError
from kvtune.geometry import KvGeometry, parse_layout
from kvtune.probe import tracing
from kvtune.probe.agent import MEM_TYPE, RegisteredBuffer, agent_name, make_agent
from kvtune.probe.channel import PROTOCOL_VERSION, Channel, ChannelClosed, connect

logger = logging.getLogger(__name__)

DEFAULT_XFER_TIMEOUT_S = 30.0
"""A transfer not complete after this long is declared failed (peer dead or fabric stuck)."""
HANDSHAKE_TIMEOUT_S = 180.0
"""How long the target may take to allocate, register and answer hello (generous: a crowded host
can slow NIXL/UCX set-up by an order of magnitude; a dead target is seen at once, by EOF)."""
CONTROL_TIMEOUT_S = 180.0
"""Side-channel requests (fill, digest, stats) that may touch the whole buffer."""
PING_TIMEOUT_S = 10.0
SPIN_NS = 50_000
"""Poll completion without pausing for this long after posting, then sleep briefly between polls:
on a loaded host a spinning initiator otherwise starves the target's progress thread, which TCP and
shared-memory transports need (RDMA does not), and a whole scheduler slice lands in the latency."""
POLL_SLEEP_FRACTION = 1 / 32
"""After the spin, each pause is this fraction of the time waited so far (adds at most ~3%)."""
MIN_POLL_SLEEP_S = 20e-6
MAX_POLL_SLEEP_S = 1e-3


@dataclass
class PreparedPoint:
    """Descriptor indices for one (tokens, layout) sweep point, on prepped lists of both sides."""

    tokens: int
    layout: S.Layout
    blocks: int
    bytes: int
    descriptors: int
    local_dlist: object
    remote_dlist: object
    local_idx: np.ndarray
    remote_idx: np.ndarray
    own_dlists: bool = False
    remote_ranges: np.ndarray = field(default=None, repr=False)
    local_ranges: np.ndarray = field(default=None, repr=False)


class InitiatorSession:
    """An initiator connected to a target (``peer``: an open side channel or ``(host, port)``).
    Use as a context manager; :meth:`close` says bye to the target."""

    def __init__(self, peer: Channel | tuple[str, int], geometry: KvGeometry, capacity_blocks: int, *,
                 backend: str = "UCX", fabric: str = "", tracer=None,
                 xfer_timeout_s: float = DEFAULT_XFER_TIMEOUT_S,
                 target_alive=None) -> None:
        self.geometry = geometry
        self.capacity_blocks = capacity_blocks
        self.backend = backend
        self.fabric = fabric
        self.tracer = tracer
        self.xfer_timeout_s = xfer_timeout_s
        self._target_alive = target_alive
        self.name = agent_name("initiator")
        self.agent = make_agent(self.name, backend)
        nbytes = geometry.buffer_bytes(capacity_blocks)
        self.buf = RegisteredBuffer.allocate(self.agent, nbytes)
        # Connect only once the agent and its memory are ready: agent creation can be slow on a
        # loaded host and the target times out a silent connection.
        try:
            self.ch = peer if isinstance(peer, Channel) else connect(*peer)
        except ProbeError:
            self.buf.release()
            raise
        self.transfers_posted = 0
        self._per_block: tuple[object, object] | None = None
        self._closed = False
        t0 = time.time_ns()
        try:
            reply = self.ch.request({"type": "hello", "version": PROTOCOL_VERSION, "agent": self.name,
                                     "nbytes": nbytes, "fabric": fabric,
                                     "host": socket.gethostname()},
                                    self.agent.get_agent_metadata(), timeout_s=HANDSHAKE_TIMEOUT_S)
            if reply.msg["type"] != "ready" or int(reply.msg.get("nbytes", 0)) != nbytes:
                raise ProbeError(f"probe target {self.ch.peer}: expected 'ready' with {nbytes} B, "
                                 f"got {str(reply.msg)[:200]}")
            remote = self.agent.add_remote_agent(reply.blob)
            self.remote_name = remote.decode() if isinstance(remote, bytes) else str(remote)
            self.remote_addr = int(reply.msg["addr"])
            self.target_info = reply.msg
            self.agent.make_connection(self.remote_name)
        except Exception as exc:
            self.buf.release()
            self.ch.close()
            if isinstance(exc, ProbeError):
                raise
            raise ProbeError(f"handshake with probe target {self.ch.peer} failed: "
                             f"{type(exc).__name__}: {exc}") from exc
        self.info = tracing.SpanContextInfo(self.name, self.remote_name, backend, fabric)
        tracing.emit_handshake(tracer, self.info, t0, time.time_ns())

    # --- context management ---------------------------------------------------------------------
    def __enter__(self) -> "InitiatorSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.ch.request({"type": "bye"}, timeout_s=PING_TIMEOUT_S)
        except ProbeError:
            pass
        self.ch.close()
        self.buf.release()
        try:
            self.agent.remove_remote_agent(self.remote_name)
        except Exception:
            logger.debug("remove_remote_agent failed", exc_info=True)

    # --- descriptors ----------------------------------------------------------------------------
    def _dlists(self, descs: np.ndarray, remote_base: int) -> tuple[object, object]:
        local = np.column_stack([descs[:, 0] + self.buf.addr, descs[:, 1],
                                 np.zeros(len(descs), np.int64)]).astype(np.uint64)
        remote = np.column_stack([descs[:, 0] + remote_base, descs[:, 1],
                                  np.zeros(len(descs), np.int64)]).astype(np.uint64)
        return (self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, MEM_TYPE),
                self.agent.prep_xfer_dlist(self.remote_name, remote, MEM_TYPE))

    def prepare(self, tokens: int, layout: S.Layout | str) -> PreparedPoint:
        """Descriptor lists and indices for ``tokens`` tokens in ``layout`` (not timed)."""
        layout = parse_layout(layout)
        g = self.geometry
        n_blocks = g.blocks(tokens)
        if n_blocks > self.capacity_blocks:
            raise ProbeError(f"{tokens} tokens need {n_blocks} blocks; the buffers hold "
                             f"{self.capacity_blocks}")
        block = g.block_bytes
        region = self.capacity_blocks * block
        starts = np.arange(g.regions, dtype=np.int64) * region
        if layout is S.Layout.PER_BLOCK:
            if self._per_block is None:  # every block of every region, prepared once (as vLLM)
                self._per_block = self._dlists(g.descriptors(self.capacity_blocks * g.block_size_tokens,
                                                             layout, capacity_blocks=self.capacity_blocks),
                                               self.remote_addr)
            local_dl, remote_dl = self._per_block
            base = (np.arange(g.regions, dtype=np.int64) * self.capacity_blocks)[:, None]
            j = np.arange(n_blocks, dtype=np.int64)[None, :]
            remote_idx = (base + j).ravel().astype(np.int32)
            local_idx = (base + (n_blocks - 1 - j)).ravel().astype(np.int32)
            remote_ranges = np.column_stack([(starts[:, None] + j * block).ravel(),
                                             np.full(remote_idx.shape, block, np.int64)])
            local_ranges = np.column_stack([(starts[:, None] + (n_blocks - 1 - j) * block).ravel(),
                                            np.full(local_idx.shape, block, np.int64)])
            own = False
        else:
            descs = g.descriptors(tokens, layout, capacity_blocks=self.capacity_blocks)
            local_dl, remote_dl = self._dlists(descs, self.remote_addr)
            local_idx = remote_idx = np.arange(len(descs), dtype=np.int32)
            remote_ranges = local_ranges = descs
            own = True
        return PreparedPoint(tokens, layout, n_blocks, g.transfer_bytes(tokens), len(remote_idx),
                             local_dl, remote_dl, local_idx, remote_idx, own, remote_ranges,
                             local_ranges)

    def release(self, point: PreparedPoint) -> None:
        if point.own_dlists:
            for dl in (point.local_dlist, point.remote_dlist):
                try:
                    self.agent.release_dlist_handle(dl)
                except Exception:
                    logger.debug("release_dlist_handle failed", exc_info=True)

    # --- transfers ------------------------------------------------------------------------------
    def transfer(self, op: str, point: PreparedPoint, *, iteration: int, warmup: bool,
                 run_id: str) -> tracing.TransferRecord:
        """One transfer: indices -> prepped handle -> post -> poll to completion -> telemetry."""
        op = S.NixlOp(op).value
        base = (f"probe-{run_id}-{op.lower()}-{point.layout.value}-{point.tokens}-"
                f"{'w' if warmup else ''}{iteration}")
        tid = S.transfer_id(base, S.Direction.FORWARD)
        notif = json.dumps({"t": tid, "o": op, "k": point.tokens, "b": point.bytes,
                            "d": point.descriptors, "i": iteration, "w": int(warmup),
                            "l": point.layout.value}, separators=(",", ":"))
        notif_head = (notif[:-1] + ',"s":').encode()  # the post time is appended at post
        agent = self.agent
        handle = None
        setup_start = post = time.time_ns()
        try:
            handle = agent.make_prepped_xfer(op, point.local_dlist, point.local_idx,
                                             point.remote_dlist, point.remote_idx)
            post = time.time_ns()
            state = agent.transfer(handle, notif_head + str(post).encode() + b"}")
            deadline = post + int(self.xfer_timeout_s * 1e9)
            spin_until = post + SPIN_NS
            while state == "PROC":
                state = agent.check_xfer_state(handle)
                now = time.time_ns()
                if now > spin_until:
                    if now > deadline:
                        break
                    # Sleep a small fraction of the time waited so far: the target and UCX's
                    # threads get the CPU on a busy host, and a woken poller is scheduled promptly.
                    pause_s = (now - post) * POLL_SLEEP_FRACTION / 1e9
                    time.sleep(min(MAX_POLL_SLEEP_S, max(MIN_POLL_SLEEP_S, pause_s)))
        except Exception as exc:  # NIXL raises e.g. nixlRemoteDisconnectError
            state = f"ERR ({type(exc).__name__})"
        done = time.time_ns()
        self.transfers_posted += 1
        post_us = xfer_us = ndesc = None
        if state == "DONE":
            try:
                tel = agent.get_xfer_telemetry(handle)
                post_us, xfer_us, ndesc = float(tel.postDuration), float(tel.xferDuration), int(tel.descCount)
            except Exception:
                pass
        record = tracing.TransferRecord(tid, op, point.layout.value, point.tokens, point.blocks,
                                        point.bytes, point.descriptors, iteration, warmup,
                                        setup_start, post, done, state if state != "PROC" else "TIMEOUT",
                                        post_us, xfer_us, ndesc)
        if state != "DONE":
            tracing.emit_transfers(self.tracer, self.info, [record])
            self._fail(record, handle)
        self._release_handle(handle)
        return record

    @staticmethod
    def _release_handle(handle) -> None:
        if handle is None:
            return
        try:  # a handle still in flight cannot always be released; NIXL keeps it then
            handle.release()
        except Exception:
            logger.debug("xfer handle release failed", exc_info=True)

    def _fail(self, record: tracing.TransferRecord, handle) -> None:
        what = (f"transfer {record.transfer_id} ({record.op}, {record.tokens} tokens, "
                f"{record.bytes} B, {record.descriptors} descriptors)")
        if record.status == "TIMEOUT":
            cause = f"not complete after {self.xfer_timeout_s:g} s"
        else:
            cause = f"NIXL reported {record.status}"
        alive = self.target_alive()
        side = (f"the target at {self.ch.peer} is not responding (side: target)" if not alive
                else f"the target at {self.ch.peer} still answers; the fabric failed (side: initiator)")
        self._release_handle(handle)
        raise ProbeError(f"initiator: {what}: {cause}; {side}")

    def target_alive(self) -> bool:
        """Whether the target process still answers (its process, then the side channel)."""
        if self._target_alive is not None and not self._target_alive():
            return False
        try:
            return self.ch.request({"type": "ping"}, timeout_s=PING_TIMEOUT_S).msg["type"] == "pong"
        except ProbeError:
            return False

    # --- checking bytes -------------------------------------------------------------------------
    def fill_local(self, point: PreparedPoint, seed: int) -> None:
        self.buf.fill(seed, point.local_ranges)

    def fill_remote(self, point: PreparedPoint, seed: int) -> None:
        self.ch.request({"type": "fill", "seed": seed, "ranges": point.remote_ranges.tolist()},
                        timeout_s=CONTROL_TIMEOUT_S)

    def remote_digest(self, point: PreparedPoint) -> str:
        reply = self.ch.request({"type": "digest", "ranges": point.remote_ranges.tolist()},
                                timeout_s=CONTROL_TIMEOUT_S)
        return str(reply.msg["sha256"])

    def local_digest(self, point: PreparedPoint) -> str:
        return self.buf.digest(point.local_ranges)

    def verify(self, op: str, point: PreparedPoint, *, seed: int, run_id: str) -> tracing.TransferRecord:
        """One transfer whose bytes are checked on the target: READ brings the target's pattern
        here, WRITE puts ours there; a mismatch raises ``ProbeError``."""
        op = S.NixlOp(op).value
        if op == "READ":
            self.fill_remote(point, seed)
            self.buf.fill(seed + 1, point.local_ranges)  # something else first
        else:
            self.fill_local(point, seed)
            self.fill_remote(point, seed + 1)
        record = self.transfer(op, point, iteration=0, warmup=True, run_id=f"{run_id}-verify")
        remote, local = self.remote_digest(point), self.local_digest(point)
        if remote != local:
            raise ProbeError(f"initiator: {op} of {point.tokens} tokens ({point.layout.value}) "
                             f"completed but the bytes differ: target sha256 {remote[:16]}..., "
                             f"initiator {local[:16]}...")
        return record

    def notifications_seen(self, expect: int, timeout_s: float = 10.0) -> int:
        """Notifications the target has received this session (waits up to ``timeout_s`` for
        ``expect`` of them)."""
        reply = self.ch.request({"type": "stats", "expect": expect, "timeout_s": timeout_s},
                                timeout_s=timeout_s + CONTROL_TIMEOUT_S)
        return int(reply.msg["notifs"])


__all__ = ["InitiatorSession", "PreparedPoint", "ChannelClosed"]
