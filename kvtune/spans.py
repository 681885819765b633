"""kvtune's span convention: the single source of span and attribute names.

Every producer (instrumented connectors, fabric probe, router, simulator) emits these names and
every consumer (trace loader, analysis, dashboards, notebooks) reads them from here. Span names are
a fixed, low-cardinality vocabulary; ids, sizes and outcomes go into attributes.

Units are spelled in the attribute name (``_ms``, ``_us``, ``_s``, ``bytes``, ``tokens``).
"""
from __future__ import annotations

from enum import Enum
from typing import Final

CONVENTION_VERSION: Final = "1.0"
"""Version of this convention; emitted as the resource attribute ``kvtune.convention``."""


class SpanName(str, Enum):
    """Names of kvtune spans. One KV transfer is the set of phase spans sharing ``kv.transfer_id``."""

    REQUEST = "kv.request"
    """Router: request in -> last token out. Root of the request's trace."""
    QUEUE = "kv.queue"
    """Prefill or decode engine: request arrived (vLLM's ``arrival_time``, stamped by the API
    server) -> the scheduler first considered it. Time spent reaching and waiting for the engine
    loop: API-server to engine IPC, a busy engine, a starved CPU."""
    PREFILL = "kv.prefill"
    """Prefill instance: request scheduled -> prompt KV computed (ready to be transferred)."""
    HANDSHAKE = "kv.handshake"
    """Initiator: NIXL metadata exchange with a remote engine (first contact only)."""
    REGISTRATION = "kv.registration"
    """Decode (push): destination blocks allocated -> registration sent to the prefill."""
    RENDEZVOUS = "kv.rendezvous"
    """Prefill (push): first of {registration received, prefill done} -> the second.
    ``kv.first_arrival`` says which came first."""
    DESCRIPTOR_SETUP = "kv.descriptor_setup"
    """Initiator: block ids in hand -> prepped transfer handle made (descriptor lists built)."""
    RDMA = "kv.rdma"
    """Initiator: transfer posted -> completion observed (READ in pull, WRITE in push)."""
    NOTIFY = "kv.notify"
    """Target: completion notification(s) received from all ranks (a point-like span)."""
    DECODE_START = "kv.decode_start"
    """Decode: KV ready -> request scheduled for its first decode step."""
    REUSE_DECISION = "kv.reuse_decision"
    """Prefill (bidirectional): recompute vs pull vs local hit for a conversation's history."""
    RETENTION = "kv.retention"
    """Decode (bidirectional): blocks retained for the next turn -> reused, expired or evicted."""
    ROUTE = "kv.route"
    """Router, child of ``kv.request``: the request began -> its first leg was sent (the
    conversation's state read, the instances chosen). Abuts the first leg."""
    PREFILL_LEG = "kv.prefill_leg"
    """Router, child of ``kv.request``: the prefill leg's HTTP request sent (connection acquired
    included) -> its answer read. The prefill's engine spans nest inside it; what they leave is the
    hop, the API server's HTTP intake before vLLM stamps ``arrival_time``, and the answer's way
    back. :data:`HTTP_CONNECTION_REUSED`, :data:`HTTP_REQUEST_BYTES`, :data:`HTTP_RESPONSE_BYTES`."""
    HANDOFF = "kv.handoff"
    """Router, child of ``kv.request`` (pull, bidirectional): the prefill's answer read -> the
    decode leg sent (the answer parsed, the decode leg's body built, the decode chosen). Abuts
    both legs; push sends both legs at once and has none."""
    DECODE_LEG = "kv.decode_leg"
    """Router, child of ``kv.request``: the decode leg's HTTP request sent -> its answer read
    (streamed: the stream's end). The decode's engine spans nest inside it. Attributes as on
    :attr:`PREFILL_LEG`."""


PHASES: Final = (
    SpanName.REGISTRATION,
    SpanName.RENDEZVOUS,
    SpanName.DESCRIPTOR_SETUP,
    SpanName.RDMA,
    SpanName.NOTIFY,
    SpanName.DECODE_START,
)
"""The phases of one KV transfer, in causal order; the analysis makes one column per phase."""

PHASE_COLUMNS: Final = {
    SpanName.REGISTRATION: "registration_ms",
    SpanName.RENDEZVOUS: "rendezvous_ms",
    SpanName.DESCRIPTOR_SETUP: "descriptor_setup_ms",
    SpanName.RDMA: "rdma_ms",
    SpanName.NOTIFY: "notify_ms",
    SpanName.DECODE_START: "decode_start_ms",
}
"""Column of the transfers table that holds each phase's duration."""

ROUTER_PHASES: Final = (
    SpanName.ROUTE,
    SpanName.PREFILL_LEG,
    SpanName.HANDOFF,
    SpanName.DECODE_LEG,
)
"""The router's phases of one request (children of ``kv.request``), in causal order: they abut
(push: the two legs run side by side), and the engines' spans nest inside the legs."""

NOT_TTFT_STEPS: Final = frozenset({SpanName.REQUEST, SpanName.RETENTION})
"""Spans that are not steps of one request's time to first token: the request itself (the window)
and retention (a wait between turns). Every other span of the convention is a step."""
TTFT_STEP_SPANS: Final = tuple(n for n in SpanName if n not in NOT_TTFT_STEPS)
"""The steps of a request's TTFT: what the attribution gives each instant to and what the
dashboard's per-phase share panel sums (in :class:`SpanName` order)."""

# --- Common attributes ---------------------------------------------------------------------------
REQUEST_ID: Final = "kv.request_id"
"""The request id as the emitting engine sees it (e.g. vLLM's ``cmpl-...-0``)."""
BASE_REQUEST_ID: Final = "kv.base_request_id"
"""The request id with engine prefixes/suffixes stripped; equal on router, prefill and decode."""
CLIENT_REQUEST_ID: Final = "kv.client_request_id"
"""Router: the ``X-Request-Id`` a client sent, echoed back to it (never used upstream: the legs get
a unique id of the router's, :data:`BASE_REQUEST_ID`, so clients cannot collide)."""
TRANSFER_ID: Final = "kv.transfer_id"
"""Id of one KV movement, identical on initiator and target: ``<base_request_id>:<direction>``."""
CONVERSATION_ID: Final = "kv.conversation_id"
"""Client-supplied conversation id (multi-turn)."""
TURN: Final = "kv.turn"
"""Turn number within the conversation, from 1."""
MODE: Final = "kv.mode"
"""Transfer mode, one of :class:`Mode`."""
DIRECTION: Final = "kv.direction"
"""Direction of a KV movement, one of :class:`Direction`."""
ROLE: Final = "kv.role"
"""Role of the emitting process, one of :class:`Role`."""
ENGINE_ID: Final = "kv.engine_id"
"""vLLM engine id (or probe agent name) of the emitter."""
REMOTE_ENGINE_ID: Final = "kv.remote_engine_id"
"""Engine id of the peer of this transfer."""
TP_RANK: Final = "kv.tp_rank"
"""Tensor-parallel rank of the emitting worker."""
TOKENS: Final = "kv.tokens"
"""Tokens whose KV this transfer moves."""
BLOCKS: Final = "kv.blocks"
"""KV blocks this transfer moves."""
BYTES: Final = "kv.bytes"
"""Bytes this transfer moves (per rank)."""
DESCRIPTORS: Final = "kv.descriptors"
"""NIXL descriptors in this transfer."""
NIXL_BACKEND: Final = "kv.nixl.backend"
"""NIXL backend (``UCX``, ...)."""
NIXL_OP: Final = "kv.nixl.op"
"""NIXL operation, one of :class:`NixlOp`."""
NIXL_POST_US: Final = "kv.nixl.post_us"
"""NIXL's own telemetry: time to post the transfer, microseconds."""
NIXL_XFER_US: Final = "kv.nixl.xfer_us"
"""NIXL's own telemetry: post -> completion seen, microseconds (includes polling delay)."""
NIXL_PROGRESS_DELAY_US: Final = "kv.nixl.progress_delay_us"
"""On worker spans: the NIXL agent's progress-thread delay, microseconds (0: it spins a core;
-1: the agent has no progress thread, UCX advances inside the engine's own NIXL calls)."""
NIXL_STATUS: Final = "kv.nixl.status"
"""Final NIXL status of the transfer (``DONE``, ``ERR_...``)."""
FABRIC: Final = "kv.fabric"
"""User-given fabric name (``efa``, ``ucx-tcp-loopback``, ...)."""
TRANSPORT: Final = "kv.transport"
"""Transports UCX actually selected (``tcp``, ``sm``, ``rc``, ...), when known."""

# --- Phase-specific attributes ------------------------------------------------------------------
FIRST_ARRIVAL: Final = "kv.first_arrival"
"""On ``kv.rendezvous``: which of the two came first, one of :class:`FirstArrival`."""
NOTIFY_SENT_NS: Final = "kv.notify.sent_ns"
"""On ``kv.notify``: the sender's clock (ns since epoch) when the notification was sent, if known."""
PROMPT_TOKENS: Final = "kv.prompt_tokens"
"""Prompt length in tokens (on ``kv.request`` and ``kv.prefill``)."""
CACHED_TOKENS: Final = "kv.cached_tokens"
"""On ``kv.prefill``: prompt tokens whose KV was already present (prefix cache or pulled)."""
COMPUTED_TOKENS: Final = "kv.computed_tokens"
"""On ``kv.prefill``: tokens actually computed (prompt - cached)."""
OUTPUT_TOKENS: Final = "kv.output_tokens"
"""On ``kv.request``: tokens generated."""
TTFT_MS: Final = "kv.ttft_ms"
"""On ``kv.request``: time to first token seen by the router, milliseconds."""
PREFILL_INSTANCE: Final = "kv.prefill_instance"
"""On ``kv.request``: the prefill instance chosen (URL)."""
DECODE_INSTANCE: Final = "kv.decode_instance"
"""On ``kv.request``: the decode instance chosen (URL)."""
STREAM: Final = "kv.stream"
"""On ``kv.request``: whether the client asked for streaming."""
HTTP_STATUS: Final = "http.response.status_code"
"""On ``kv.request``: HTTP status returned to the client."""
REUSE_OUTCOME: Final = "kv.reuse.outcome"
"""On ``kv.reuse_decision``: one of :class:`ReuseOutcome`."""
REUSE_REMOTE_TOKENS: Final = "kv.reuse.remote_tokens"
"""On ``kv.reuse_decision``: tokens of history the decode holds for this conversation."""
REUSE_THRESHOLD_TOKENS: Final = "kv.reuse.threshold_tokens"
"""On ``kv.reuse_decision``: the ``kv_recompute_threshold`` in force."""
RETENTION_TTL_S: Final = "kv.retention.ttl_s"
"""On ``kv.retention``: ``decoder_kv_blocks_ttl`` in force, seconds."""
RETENTION_OUTCOME: Final = "kv.retention.outcome"
"""On ``kv.retention``: one of :class:`RetentionOutcome`."""
RETENTION_RENEWALS: Final = "kv.retention.renewals"
"""On ``kv.retention`` (renewable decode lease on): how many times the router renewed the lease."""
RETENTION_LEASE_S: Final = "kv.retention.lease_s"
"""On ``kv.retention`` (renewable decode lease on): the length of the last renewal granted,
seconds (absent: never renewed; the first hold is ``kv.retention.ttl_s``)."""
PREFILL_LEASE_S: Final = "kv.prefill_lease.duration_s"
"""On the prefill's forward ``kv.notify`` (pull): vLLM's ``kv_lease_duration`` in force, seconds
(the first hold; each decode heartbeat extends the expiry to at least now + 2/3 of it)."""
PREFILL_LEASE_HELD_S: Final = "kv.prefill_lease.held_s"
"""On the prefill's forward ``kv.notify`` (pull): seconds the finished request's blocks were held
for the decode's READ (the worker took the lease -> read notified, expired or released)."""
PREFILL_LEASE_RENEWALS: Final = "kv.prefill_lease.renewals"
"""On the prefill's forward ``kv.notify`` (pull): decode heartbeats that named the request while
held (each extends the lease)."""
PREFILL_LEASE_MARGIN_S: Final = "kv.prefill_lease.margin_s"
"""On the prefill's forward ``kv.notify`` (pull): seconds left before the (renewed) expiry when the
hold ended; at or below 0 for an expired lease."""
PREFILL_LEASE_HEARTBEATS_SENT: Final = "kv.prefill_lease.heartbeats_sent"
"""On the decode's forward READ (``kv.descriptor_setup``, ``kv.rdma``; pull): heartbeats it sent
naming the prefill's request while waiting to read it (absent: none sent)."""
PREFILL_LEASE_OUTCOME: Final = "kv.prefill_lease.outcome"
"""On the prefill's forward ``kv.notify`` (pull): one of :class:`PrefillLeaseOutcome`."""
CONVERSATION_END: Final = "kv.conversation.end"
"""On ``kv.request`` (router): True when the client said this turn is its conversation's last
(``X-Kvtune-Conversation-End``); the analysis also reads an end from ``kv.retention`` spans whose
outcome is ``ended``."""
PROBE_ITERATION: Final = "kv.probe.iteration"
"""Probe: iteration index within one sweep point."""
PROBE_WARMUP: Final = "kv.probe.warmup"
"""Probe: True for warm-up transfers (excluded from fits)."""
PROBE_LAYOUT: Final = "kv.probe.layout"
"""Probe: descriptor layout, one of :class:`Layout`."""
ERROR_TYPE: Final = "error.type"
"""Class of error when a span ends in ERROR status."""
EXCEPTION_MESSAGE: Final = "exception.message"
"""An error's message, on span events that report one (OpenTelemetry's name)."""
REUSE_REFUSED_REASON: Final = "kv.reuse.refused_reason"
"""On the ``kv.router.reuse_refused`` event: one of :class:`ReuseRefusal` (an event attribute,
not a span column)."""
REUSE_REFUSED_DETAIL: Final = "kv.reuse.refused_detail"
"""On the ``kv.router.reuse_refused`` event: the refusal in words (which history, what differed)."""

HTTP_CONNECTION_REUSED: Final = "kv.http.connection_reused"
"""On the router's legs: True when the leg's HTTP request went over a pooled (kept-alive)
connection, False when a new connection was opened for it."""
HTTP_REQUEST_BYTES: Final = "kv.http.request_bytes"
"""On the router's legs: bytes of the leg's HTTP request body sent."""
HTTP_RESPONSE_BYTES: Final = "kv.http.response_bytes"
"""On the router's legs: bytes of the leg's HTTP response body received (absent on a streamed
decode leg: the router relays the stream and does not count it)."""

# --- Resource attributes ------------------------------------------------------------------------
SERVICE_NAME: Final = "service.name"
HOST_NAME: Final = "host.name"
KVTUNE_VERSION: Final = "kvtune.version"
KVTUNE_CONVENTION: Final = "kvtune.convention"
VLLM_VERSION: Final = "vllm.version"
NIXL_VERSION: Final = "nixl.version"
MODEL: Final = "kv.model"
TP_SIZE: Final = "kv.tp_size"


class Mode(str, Enum):
    PUSH = "push"
    PULL = "pull"
    BIDIRECTIONAL = "bidirectional"
    PROBE = "probe"


PD_MODES: tuple[Mode, ...] = (Mode.PUSH, Mode.PULL, Mode.BIDIRECTIONAL)
"""The prefill/decode modes (every :class:`Mode` but the fabric probe's): what vLLM serves, the
simulator plays and kvtune recommends. Bidirectional = pull forward transfers + reverse reuse of
history."""


class Direction(str, Enum):
    FORWARD = "forward"
    """Prefill -> decode (the prompt's KV)."""
    REVERSE = "reverse"
    """Decode -> prefill (a conversation's history, bidirectional mode)."""


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"
    PROBE = "probe"
    SIM = "sim"


class NixlOp(str, Enum):
    READ = "READ"
    WRITE = "WRITE"


class FirstArrival(str, Enum):
    REGISTRATION = "registration"
    PREFILL = "prefill"


class ReuseOutcome(str, Enum):
    PULL = "pull"
    RECOMPUTE = "recompute"
    LOCAL_HIT = "local_hit"
    EXPIRED = "expired"
    NONE = "none"
    """No retained history offered (first turn)."""


class ReuseRefusal(str, Enum):
    """Why the router did not offer a conversation's held KV to a turn, or did not keep a turn's
    KV for the next one (:data:`REUSE_REFUSED_REASON`)."""

    HISTORY_DIFFERS = "history_differs"
    """The prompt does not begin with exactly the history the held KV encodes (another client
    naming the conversation, or an edited or trimmed history): served without reuse."""
    UNBOUND = "unbound"
    """The stored params carry no history digest (stored by an older router): not offered."""
    HISTORY_UNKNOWN = "history_unknown"
    """This turn's history cannot be bound (several choices, ``echo``, token ids not returned,
    tool calls streamed): its KV is not offered to the next turn."""


class RetentionOutcome(str, Enum):
    REUSED = "reused"
    EXPIRED = "expired"
    EVICTED = "evicted"
    RELEASED = "released"
    """Freed without reuse for another reason (shutdown, abort)."""
    ENDED = "ended"
    """Renewable lease: the router released the blocks, the conversation being over."""
    LAPSED = "lapsed"
    """Renewable lease: the lease ran out unrenewed (the router stopped renewing, or is gone)."""


class PrefillLeaseOutcome(str, Enum):
    """How the prefill's hold of a finished request's blocks ended (vLLM's ``kv_lease_duration``)."""

    READ = "read"
    """The decode's READ completion notification arrived (or its free-without-read)."""
    EXPIRED = "expired"
    """The lease ran out first: vLLM freed the blocks (the ``kv.notify`` has ``error.type``
    ``kv_lease_expired``)."""
    RELEASED = "released"
    """Still held when the worker shut down."""


class Layout(str, Enum):
    PER_BLOCK = "per_block"
    """One descriptor per layer per block (K and V separately), as vLLM registers them."""
    MERGED = "merged"
    """One descriptor per contiguous region."""


ATTRIBUTE_TYPES: Final[dict[str, type]] = {
    REQUEST_ID: str, BASE_REQUEST_ID: str, TRANSFER_ID: str, CONVERSATION_ID: str, TURN: int,
    MODE: str, DIRECTION: str, ROLE: str, ENGINE_ID: str, REMOTE_ENGINE_ID: str, TP_RANK: int,
    TOKENS: int, BLOCKS: int, BYTES: int, DESCRIPTORS: int, NIXL_BACKEND: str, NIXL_OP: str,
    NIXL_POST_US: float, NIXL_XFER_US: float, NIXL_STATUS: str, FABRIC: str, TRANSPORT: str,
    NIXL_PROGRESS_DELAY_US: int,
    FIRST_ARRIVAL: str, NOTIFY_SENT_NS: int, PROMPT_TOKENS: int, CACHED_TOKENS: int,
    COMPUTED_TOKENS: int, OUTPUT_TOKENS: int, TTFT_MS: float, PREFILL_INSTANCE: str,
    DECODE_INSTANCE: str, STREAM: bool, HTTP_STATUS: int, REUSE_OUTCOME: str,
    REUSE_REMOTE_TOKENS: int, REUSE_THRESHOLD_TOKENS: int, RETENTION_TTL_S: float,
    RETENTION_OUTCOME: str, RETENTION_RENEWALS: int, RETENTION_LEASE_S: float,
    CONVERSATION_END: bool, PREFILL_LEASE_S: float, PREFILL_LEASE_HELD_S: float,
    PREFILL_LEASE_RENEWALS: int, PREFILL_LEASE_MARGIN_S: float, PREFILL_LEASE_OUTCOME: str,
    PREFILL_LEASE_HEARTBEATS_SENT: int,
    PROBE_ITERATION: int, PROBE_WARMUP: bool, PROBE_LAYOUT: str,
    ERROR_TYPE: str, HTTP_CONNECTION_REUSED: bool, HTTP_REQUEST_BYTES: int,
    HTTP_RESPONSE_BYTES: int,
}
"""Every span attribute of the convention with its Python type; the loader makes one typed column
per entry (named exactly as the attribute) in the spans DataFrame."""


class EventName(str, Enum):
    """Names of span events kvtune adds (a fixed vocabulary, like span names)."""

    STREAM_PARAMS_ABSENT = "kv.router.stream_params_absent"
    """Router, on ``kv.request`` (bidirectional): a streamed decode answer carried no
    ``kv_transfer_params`` (vLLM before 0.33 sends none in SSE), so the conversation's next turn
    recomputes its history. Added once per conversation (per router process)."""
    REUSE_REFUSED = "kv.router.reuse_refused"
    """Router, on ``kv.request`` (bidirectional): the conversation's held KV was not offered to
    this turn, or this turn's KV is not kept for the next (:data:`REUSE_REFUSED_REASON` says
    which and why; ``kv.reuse.remote_tokens`` the tokens withheld). The turn is served without
    reuse."""
    STATE_ERROR = "kv.router.state_error"
    """Router, on ``kv.request``: the conversation store failed; the request was served without
    the conversation's history (``error.type`` and ``exception.message`` attributes say why)."""


# --- Trace context carriers ---------------------------------------------------------------------
TRACEPARENT_HEADER: Final = "traceparent"
"""The W3C Trace Context header: the router sets it on both legs; the connectors read it from the
request's trace headers."""
KV_PARAMS_TRACEPARENT: Final = "kvtune_traceparent"
"""Key inside vLLM's ``kv_transfer_params`` that carries the W3C ``traceparent`` of the request."""
KV_PARAMS_RETAINED_TRACEPARENT: Final = "kvtune_retained_traceparent"
"""Key inside the ``kv_transfer_params`` a decode returns (bidirectional mode) with the W3C
``traceparent`` of the request whose KV it retains; the next turn's reverse transfer joins that trace."""
KV_PARAMS_CONVERSATION_ID: Final = "kvtune_conversation_id"
"""Key inside ``kv_transfer_params`` with the conversation id (set by the router; echoed back)."""
KV_PARAMS_TURN: Final = "kvtune_turn"
"""Key inside ``kv_transfer_params`` with the turn number within the conversation (from 1)."""
CONVERSATION_HEADER: Final = "X-Kvtune-Conversation-Id"
"""HTTP header a client may use instead of the ``conversation_id`` body field."""


def service_name(role: Role | str) -> str:
    """The ``service.name`` kvtune uses for a role: ``kvtune-<role>``."""
    return f"kvtune-{Role(role).value}"


def transfer_id(base_request_id: str, direction: Direction | str) -> str:
    """The transfer id both sides of one KV movement compute: ``<base_request_id>:<direction>``."""
    return f"{base_request_id}:{Direction(direction).value}"


def span_names() -> frozenset[str]:
    """All span names of the convention (for dashboards' and tests' name checks)."""
    return frozenset(s.value for s in SpanName)
