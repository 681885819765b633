"""vLLM's prefill/decode (P/D) protocol as kvtune speaks it: the one home of its names and rules.

What crosses between a router (or :class:`kvtune.local.pair.LocalPair`) and vLLM's NIXL
connectors, as vLLM 0.32.0 and 0.33.0 read and write it (the two agree on every name and default
here; see ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``):

- ``kv_transfer_params`` (:data:`KV_TRANSFER_PARAMS`), a field of a completion request and of its
  answer. Its keys are the ``DO_REMOTE_*`` / ``REMOTE_*`` / ``*_SIZE`` constants below; kvtune's
  own carriers inside it (traceparent, conversation id, turn) are span-convention names and live in
  :mod:`kvtune.spans` (``KV_PARAMS_*``).
- ``--kv-transfer-config`` (:func:`kv_transfer_config`) with its ``kv_connector_extra_config`` keys
  (``kv_recompute_threshold``, ``decoder_kv_blocks_ttl``, ...) and vLLM's defaults for them.
- The legs of each mode (:func:`prefill_leg_params`, :func:`pull_decode_leg_params`,
  :func:`push_decode_leg_params`):

  - pull: the prefill gets ``{do_remote_decode: true}`` (and ``max_tokens: 1``); it answers with
    the params the decode needs (``do_remote_prefill``, its block ids, engine id, side channel),
    which the decode is given as they are; the decode READs the prompt's KV.
  - push: both legs start together; the prefill gets ``{do_remote_decode: true}``, the decode gets
    ``do_remote_prefill`` with the prefill named up front (engine id, side-channel host and port,
    TP/PP sizes) and the shared request id; the prefill WRITEs into the decode's blocks.
  - bidirectional: pull, plus the params the decode answers with at the end of a turn (its
    retained blocks, ``do_remote_decode: true``) are the next turn's prefill params: the prefill
    pulls the history back unless it is shorter than ``kv_recompute_threshold``.
- The router's margin below the decode's ``decoder_kv_blocks_ttl`` (:func:`router_margin_s`) and
  the rule that a NIXL progress-thread delay applies to pull mode only
  (:func:`progress_delay_applies`).

Differences between the releases that matter to kvtune: vLLM 0.33 sends ``kv_transfer_params`` in
the last chunk of a streamed answer, 0.32 only in non-streamed answers
(:data:`STREAMED_PARAMS_SINCE`).

Nothing here imports vLLM.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from kvtune import spans
from kvtune.errors import ConfigError

# --- kv_transfer_params ---------------------------------------------------------------------------
KV_TRANSFER_PARAMS: Final = "kv_transfer_params"
"""The completion request (and answer) field that carries the P/D parameters."""
DO_REMOTE_DECODE: Final = "do_remote_decode"
"""True on a leg whose KV another instance will take: the prefill of pull/push, and (in what a
bidirectional decode answers with) the decode's retained history."""
DO_REMOTE_PREFILL: Final = "do_remote_prefill"
"""True on a leg whose KV comes from another instance: the decode (pull: READ, push: WRITTEN)."""
REMOTE_ENGINE_ID: Final = "remote_engine_id"
"""The ``engine_id`` of the instance holding (pull) or sending (push) the KV. Also the key of
vLLM's push registration message (decode -> prefill) naming the decode."""
REMOTE_BLOCK_IDS: Final = "remote_block_ids"
"""Block ids (one list per KV cache group) on the remote instance; absent in a push decode leg."""
REMOTE_HOST: Final = "remote_host"
"""The remote instance's NIXL side-channel host."""
REMOTE_PORT: Final = "remote_port"
"""The remote instance's NIXL side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``)."""
REMOTE_REQUEST_ID: Final = "remote_request_id"
"""The request id on the remote instance (vLLM's ``cmpl-<id>-0-<suffix>`` in answers; the shared
``X-Request-Id`` in a push decode leg)."""
REMOTE_NUM_TOKENS: Final = "remote_num_tokens"
"""Tokens whose KV the remote holds (bidirectional: the history offered to the next prefill)."""
REMOTE_BLOCKS_EXPIRY_TIME: Final = "remote_blocks_expiry_time"
"""When the remote frees the blocks (bidirectional retention: ``decoder_kv_blocks_ttl``)."""
TP_SIZE: Final = "tp_size"
"""The remote instance's tensor-parallel size (as a kv_transfer_params key)."""
PP_SIZE: Final = "pp_size"
"""The remote instance's pipeline-parallel size (as a kv_transfer_params key)."""
PARAM_KEYS: Final = (DO_REMOTE_DECODE, DO_REMOTE_PREFILL, REMOTE_ENGINE_ID, REMOTE_BLOCK_IDS,
                     REMOTE_HOST, REMOTE_PORT, REMOTE_REQUEST_ID, REMOTE_NUM_TOKENS,
                     REMOTE_BLOCKS_EXPIRY_TIME, TP_SIZE, PP_SIZE)
"""Every vLLM ``kv_transfer_params`` key kvtune reads or writes."""
CONTEXT_KEYS: Final = (spans.KV_PARAMS_TRACEPARENT, spans.KV_PARAMS_CONVERSATION_ID,
                       spans.KV_PARAMS_TURN)
"""kvtune's carriers inside ``kv_transfer_params`` that each request sets anew."""
KV_PARAMS_HISTORY: Final = "kvtune_history"
"""The router's own key in the params it stores per conversation (never sent to vLLM): the digest
of the history the decode's held KV encodes (:mod:`kvtune.router.binding`); the blocks are offered
only to a prompt that begins with exactly that history."""
ROUTER_ONLY_KEYS: Final = (KV_PARAMS_HISTORY,)
"""Keys the router keeps with stored params and removes before any leg is sent."""
PARAMS_LEASE_PORT: Final = "kvtune_lease_port"
"""Key a kvtune decode with the renewable lease on adds to the ``kv_transfer_params`` it answers
with (bidirectional): the TCP port of its lease channel, on the decode's loopback address
(:mod:`kvtune.connectors.lease`). Absent: the decode keeps vLLM's fixed TTL."""
STREAMED_PARAMS_SINCE: Final = "0.33"
"""The vLLM release from which a streamed answer carries ``kv_transfer_params`` (last chunk)."""

# --- kv-transfer-config ---------------------------------------------------------------------------
KV_CONNECTOR: Final = "kv_connector"
"""kv-transfer-config key: the connector class (:data:`CONNECTOR_CLASSES`)."""
KV_CONNECTOR_MODULE_PATH: Final = "kv_connector_module_path"
"""kv-transfer-config key: the module vLLM imports the class from (:data:`CONNECTOR_MODULES`)."""
KV_ROLE: Final = "kv_role"
"""kv-transfer-config key: ``kv_producer`` (prefill), ``kv_consumer`` (decode) or ``kv_both``."""
KV_BUFFER_DEVICE: Final = "kv_buffer_device"
ENGINE_ID: Final = "engine_id"
KV_CONNECTOR_EXTRA_CONFIG: Final = "kv_connector_extra_config"
"""kv-transfer-config key (and ``KVTransferConfig`` attribute): the connector's own settings,
keyed by the constants below."""
KV_RECOMPUTE_THRESHOLD: Final = "kv_recompute_threshold"
"""Extra-config key: a remote history shorter than this many tokens is recomputed, not pulled."""
DEFAULT_KV_RECOMPUTE_THRESHOLD_TOKENS: Final = 64
"""vLLM's default (``NixlBaseConnectorScheduler``, 0.32 and 0.33)."""
DECODER_KV_BLOCKS_TTL: Final = "decoder_kv_blocks_ttl"
"""Extra-config key: seconds a bidirectional decode keeps a finished turn's blocks; vLLM's push
connector also uses it as the default ``push_registration_timeout``."""
DEFAULT_DECODER_KV_BLOCKS_TTL_S: Final = 480
"""vLLM's default (0.32 and 0.33)."""
BIDIRECTIONAL_KV_XFER: Final = "bidirectional_kv_xfer"
"""Extra-config key: true turns on bidirectional transfer (pull connector only); default false."""
KV_LEASE_DURATION: Final = "kv_lease_duration"
"""Extra-config key: seconds a prefill holds blocks awaiting the decode's READ."""
DEFAULT_KV_LEASE_DURATION_S: Final = 30
"""vLLM's default (0.32 and 0.33)."""
LEASE_PORT: Final = "kvtune_lease_port"
"""Extra-config key (kvtune's decode connector, bidirectional): the port of the decode's lease
channel on 127.0.0.1 (0: any free port; the answer's :data:`PARAMS_LEASE_PORT` says which). Absent
(the default): no channel, vLLM's fixed ``decoder_kv_blocks_ttl``."""
LEASE_MAX_S: Final = "kvtune_lease_max_s"
"""Extra-config key: the longest one renewal may hold the blocks for, seconds (default: the
decode's ``decoder_kv_blocks_ttl``)."""
PUSH_REGISTRATION_TIMEOUT: Final = "push_registration_timeout"
"""Extra-config key: seconds a push decode waits for the WRITE; default ``decoder_kv_blocks_ttl``."""
NUM_THREADS: Final = "num_threads"
"""Extra-config key: vLLM's NIXL UCX worker threads; default :data:`DEFAULT_NUM_THREADS`."""
DEFAULT_NUM_THREADS: Final = 4
DEFAULT_SIDE_CHANNEL_PORT: Final = 5600
"""vLLM's default ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (:data:`SIDE_CHANNEL_PORT_ENV`)."""
SIDE_CHANNEL_PORT_ENV: Final = "VLLM_NIXL_SIDE_CHANNEL_PORT"
KV_PRODUCER: Final = "kv_producer"
KV_CONSUMER: Final = "kv_consumer"
KV_BOTH: Final = "kv_both"
"""``kv_role`` of an engine that serves either leg: vLLM's NIXL connector takes each request's leg
from its ``kv_transfer_params`` (:func:`leg_role`), and so do kvtune's spans. What vLLM's own NIXL
examples use; vLLM 0.32 and 0.33 log it as deprecated for the NIXL connector, in favour of
:data:`KV_PRODUCER` / :data:`KV_CONSUMER`."""
KV_ROLES: Final = {"prefill": KV_PRODUCER, "decode": KV_CONSUMER}
"""``kv_role`` of each server role."""
KV_ROLE_VALUES: Final = (KV_PRODUCER, KV_CONSUMER, KV_BOTH)
"""Every ``kv_role`` kvtune writes or reads."""
KVTUNE_CONNECTOR_MODULE: Final = "kvtune.connectors"
PLAIN_CONNECTOR_MODULE: Final = "kvtune.connectors.plain"
CONNECTOR_CLASSES: Final = {
    ("kvtune", "pull"): "KvtuneNixlPullConnector",
    ("kvtune", "bidirectional"): "KvtuneNixlPullConnector",
    ("kvtune", "push"): "KvtuneNixlPushConnector",
    ("vllm", "pull"): "NixlConnector",
    ("vllm", "bidirectional"): "NixlConnector",
    ("vllm", "push"): "NixlPushConnector",
    ("plain", "pull"): "PlainNixlPullConnector",
    ("plain", "bidirectional"): "PlainNixlPullConnector",
    ("plain", "push"): "PlainNixlPushConnector",
}
"""``kv_connector`` per (family, mode): kvtune's instrumented subclasses (``kvtune``), vLLM's own
(``vllm``), or vLLM's own with only kvtune's NIXL agent settings (``plain``,
:mod:`kvtune.connectors.plain`)."""
CONNECTOR_MODULES: Final = {"kvtune": KVTUNE_CONNECTOR_MODULE, "vllm": None,
                            "plain": PLAIN_CONNECTOR_MODULE}
"""``kv_connector_module_path`` per family (None: vLLM's registry finds the class)."""
DEFAULT_MODE: Final = spans.Mode.PULL
"""What vLLM does by default: its ``NixlConnector`` pulls (``bidirectional_kv_xfer`` off)."""
CONNECTOR_FAMILIES: Final = ("kvtune", "vllm")
"""Connector families a user names (export, ``kvtune local``): kvtune's instrumented subclasses or
vLLM's own (``plain`` is chosen by kvtune, see :data:`CONNECTOR_CLASSES`)."""
MODES: Final = tuple(m.value for m in spans.PD_MODES)
"""The P/D modes as strings (:data:`kvtune.spans.PD_MODES` values)."""


def mode_value(mode: spans.Mode | str, *, where: str = "mode") -> str:
    """``mode`` as one of :data:`MODES`; a :class:`ConfigError` naming ``where`` otherwise."""
    value = mode.value if isinstance(mode, spans.Mode) else mode
    if value not in MODES:
        raise ConfigError(f"{where}: expected one of {list(MODES)}, got {mode!r}")
    return str(value)


def kv_transfer_config(role: str, mode: spans.Mode | str, *, connector: str = "kvtune",
                       engine_id: str | None = None, kv_buffer_device: str | None = None,
                       extra_config: Mapping[str, Any] | None = None,
                       kv_role: str | None = None) -> dict[str, Any]:
    """One server's ``--kv-transfer-config`` value.

    ``role``: ``"prefill"`` or ``"decode"``; ``connector``: a family of :data:`CONNECTOR_CLASSES`;
    ``engine_id``: fixed when given (push names the prefill up front); ``extra_config``: the
    ``kv_connector_extra_config`` entries, written as given (bidirectional mode adds
    ``bidirectional_kv_xfer: true`` unless they set it); ``kv_role``: vLLM's ``kv_role``, by
    default the role's own (:data:`KV_ROLES`), or :data:`KV_BOTH` (either leg, per request)."""
    if role not in KV_ROLES:
        raise ConfigError(f"kv_transfer_config: role expected one of {sorted(KV_ROLES)}, "
                          f"got {role!r}")
    if kv_role is not None and kv_role not in KV_ROLE_VALUES:
        raise ConfigError(f"kv_transfer_config: kv_role expected one of {list(KV_ROLE_VALUES)}, "
                          f"got {kv_role!r}")
    m = mode_value(mode, where="kv_transfer_config: mode")
    if connector not in CONNECTOR_MODULES:
        raise ConfigError(f"kv_transfer_config: connector expected one of "
                          f"{sorted(CONNECTOR_MODULES)}, got {connector!r}")
    extra = dict(extra_config or {})
    if m == spans.Mode.BIDIRECTIONAL.value:
        extra.setdefault(BIDIRECTIONAL_KV_XFER, True)
    cfg: dict[str, Any] = {KV_CONNECTOR: CONNECTOR_CLASSES[(connector, m)],
                           KV_ROLE: kv_role or KV_ROLES[role]}
    if CONNECTOR_MODULES[connector] is not None:
        cfg[KV_CONNECTOR_MODULE_PATH] = CONNECTOR_MODULES[connector]
    if kv_buffer_device:
        cfg[KV_BUFFER_DEVICE] = kv_buffer_device
    if engine_id is not None:
        cfg[ENGINE_ID] = engine_id
    cfg[KV_CONNECTOR_EXTRA_CONFIG] = extra
    return cfg


# --- the legs -------------------------------------------------------------------------------------
def engine_role(kv_role: str | None) -> spans.Role | None:
    """The role a ``kv_role`` fixes for every request of an engine: prefill (``kv_producer``),
    decode (``kv_consumer``); None for ``kv_both`` (or anything else): each request's
    :func:`leg_role` decides."""
    if kv_role == KV_PRODUCER:
        return spans.Role.PREFILL
    if kv_role == KV_CONSUMER:
        return spans.Role.DECODE
    return None


def leg_role(params: Mapping[str, Any] | None) -> spans.Role | None:
    """The leg a request serves on the engine it reached, from its ``kv_transfer_params`` as they
    arrived (vLLM clears ``do_remote_prefill`` once the KV is loaded): the prefill when
    ``do_remote_decode`` (another instance takes its KV: vLLM's "P node", whatever else is set),
    the decode when ``do_remote_prefill``; None for neither (a request served locally)."""
    if not params:
        return None
    if params.get(DO_REMOTE_DECODE):
        return spans.Role.PREFILL
    if params.get(DO_REMOTE_PREFILL):
        return spans.Role.DECODE
    return None


def prefill_leg_params(reuse: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The prefill's ``kv_transfer_params`` (every mode): ``{do_remote_decode: true}``, or, in
    bidirectional mode, the decode's answer of the conversation's previous turn (``reuse``: its
    retained blocks) so the prefill pulls that history back."""
    kept = {k: v for k, v in (reuse or {}).items() if k not in ROUTER_ONLY_KEYS}
    return {**kept, DO_REMOTE_DECODE: True}


def pull_decode_leg_params(prefill_answer: Mapping[str, Any]) -> dict[str, Any]:
    """The pull decode's ``kv_transfer_params``: what the prefill answered, as it is (a
    :class:`ConfigError` when it is not the answer of a kv_producer NIXL connector)."""
    if not isinstance(prefill_answer, Mapping) or not prefill_answer.get(DO_REMOTE_PREFILL):
        raise ConfigError(f"{KV_TRANSFER_PARAMS} of the prefill's answer: expected "
                          f"{DO_REMOTE_PREFILL}: true (is the instance started with a kv_producer "
                          f"NIXL connector?), got {prefill_answer!r}"[:1000])
    return dict(prefill_answer)


def push_decode_leg_params(*, engine_id: str, host: str, port: int, request_id: str,
                           tp_size: int = 1, pp_size: int = 1) -> dict[str, Any]:
    """The push decode's ``kv_transfer_params``: the prefill named up front (its engine id,
    side-channel host and port, TP/PP sizes) and the shared request id of both legs."""
    return {DO_REMOTE_PREFILL: True, REMOTE_ENGINE_ID: engine_id, REMOTE_HOST: host,
            REMOTE_PORT: int(port), TP_SIZE: int(tp_size), PP_SIZE: int(pp_size),
            REMOTE_REQUEST_ID: request_id}


def with_context(params: Mapping[str, Any], *, traceparent: str | None = None,
                 conversation_id: str | None = None, turn: int | None = None) -> dict[str, Any]:
    """``params`` plus kvtune's carriers for the connectors' spans (W3C traceparent, conversation
    id, turn); carriers echoed back from an earlier turn are replaced, not kept."""
    out = {k: v for k, v in params.items() if k not in CONTEXT_KEYS}
    if traceparent:
        out[spans.KV_PARAMS_TRACEPARENT] = traceparent
    if conversation_id is not None:
        out[spans.KV_PARAMS_CONVERSATION_ID] = conversation_id
    if turn is not None:
        out[spans.KV_PARAMS_TURN] = turn
    return out


def holds_blocks(params: Any) -> bool:
    """Whether an answer's ``kv_transfer_params`` name remote blocks (a bidirectional decode's
    retained history worth offering to the next turn)."""
    return isinstance(params, Mapping) and bool(params.get(REMOTE_BLOCK_IDS))


def offered_tokens(params: Mapping[str, Any] | None) -> int | None:
    """The history tokens a prefill is offered (``remote_num_tokens``), when an int."""
    value = params.get(REMOTE_NUM_TOKENS) if params else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- the decode lease channel (kvtune's own, :mod:`kvtune.connectors.lease`) --------------------
LEASE_OP: Final = "op"
"""Lease-channel request field: one of :data:`LEASE_OPS`."""
LEASE_OP_HELLO: Final = "hello"
"""Op: is a channel there (answers the decode's clock and :data:`LEASE_MAX_LEASE_S`)."""
LEASE_OP_RENEW: Final = "renew"
"""Op: hold request :data:`LEASE_ID`'s blocks for :data:`LEASE_S` more seconds from now."""
LEASE_OP_RELEASE: Final = "release"
"""Op: free request :data:`LEASE_ID`'s blocks now (the conversation is over)."""
LEASE_OPS: Final = (LEASE_OP_HELLO, LEASE_OP_RENEW, LEASE_OP_RELEASE)
LEASE_ID: Final = "id"
"""Lease-channel request field: the decode's request id holding the blocks (the answer's
:data:`REMOTE_REQUEST_ID`)."""
LEASE_S: Final = "lease_s"
"""Lease-channel renew field: seconds from now, > 0 (the decode grants at most its maximum)."""
LEASE_OK: Final = "ok"
"""Lease-channel reply field: true when the op was applied."""
LEASE_EXPIRY: Final = "expiry"
"""Lease-channel reply field: the blocks' expiry now in force, in the decode scheduler's
``perf_counter`` clock (the clock of :data:`REMOTE_BLOCKS_EXPIRY_TIME`)."""
LEASE_NOW: Final = "now"
"""Lease-channel reply field: the decode scheduler's ``perf_counter`` when it answered."""
LEASE_MAX_LEASE_S: Final = "max_lease_s"
"""Lease-channel hello reply field: the longest renewal the decode grants, seconds."""
LEASE_ERROR: Final = "error"
"""Lease-channel reply field (when not ok): one of :data:`LEASE_ERRORS`."""
LEASE_DETAIL: Final = "detail"
"""Lease-channel reply field (when not ok): the error in words."""
LEASE_ERRORS: Final = ("bad_request", "too_large", "unknown_request", "released", "lapsing",
                       "busy")
"""``bad_request``: not a JSON object with the fields of its op; ``too_large``: a line over the
channel's cap; ``unknown_request``: the decode holds no blocks for that id (read back, freed, or
never held); ``released``: a renewal after a release; ``lapsing``: the blocks expire too soon to
renew safely; ``busy``: too many connections."""


# --- rules ----------------------------------------------------------------------------------------
ROUTER_MARGIN_S: Final = 30.0
"""The router's stored decode params expire this long before the decode frees the blocks: covers
the router -> prefill -> decode handshake time and clock differences."""
ROUTER_MARGIN_SHARE: Final = 0.25
"""...but at most this share of the decode's TTL, so a long TTL keeps most of its window..."""
READBACK_SAFETY_MARGIN_S: Final = 5.0
"""vLLM's NIXL pull worker declines a turn-2 readback whose decode blocks expire within this many
seconds (``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`` in ``nixl/pull_worker.py``, vLLM 0.32 and 0.33); the
request then fails under ``kv_load_failure_policy: fail``. So a decode TTL of 5 s or less never
serves a reuse, and the router must stop offering one this long before the decode's TTL ends."""
READBACK_SLACK_S: Final = 1.0
"""The router's slack on top of :data:`READBACK_SAFETY_MARGIN_S`: the time from its decision to the
prefill's read (queueing, the prefill's scheduling step)."""
MIN_ROUTER_MARGIN_S: Final = READBACK_SAFETY_MARGIN_S + READBACK_SLACK_S
"""...and never less than this (a TTL of at most 4 x this keeps TTL - this as its window)."""


def router_margin_s(decoder_ttl_s: float) -> float:
    """The router's margin below a decode TTL of ``decoder_ttl_s``: ``min(30 s, TTL / 4)``, but at
    least :data:`MIN_ROUTER_MARGIN_S` (vLLM's readback margin plus slack), and at most the TTL."""
    margin = max(MIN_ROUTER_MARGIN_S, min(ROUTER_MARGIN_S, ROUTER_MARGIN_SHARE * decoder_ttl_s))
    return min(margin, max(0.0, decoder_ttl_s))


def router_ttl_s(decoder_ttl_s: float) -> float:
    """How long after a turn the router still offers its retained history back: the decode TTL
    minus :func:`router_margin_s` (0: never)."""
    return max(0.0, decoder_ttl_s - router_margin_s(decoder_ttl_s))


def decoder_ttl_for_router_ttl_s(router_ttl_s: float) -> float:
    """The decode TTL whose router TTL (TTL minus :func:`router_margin_s`) is ``router_ttl_s``
    (> 0): the inverse of :func:`router_ttl_s`, piece by piece of the margin's formula."""
    share = ROUTER_MARGIN_SHARE / (1 - ROUTER_MARGIN_SHARE)
    return router_ttl_s + max(MIN_ROUTER_MARGIN_S, min(ROUTER_MARGIN_S, share * router_ttl_s))


def progress_delay_applies(mode: spans.Mode | str) -> bool:
    """Whether a NIXL progress-thread delay (``kvtune_progress_delay_us``) applies in ``mode``:
    pull only. In push and bidirectional mode the prefill initiates transfers (WRITEs, reverse
    READs), and a sleeping progress thread on either side was measured to hang them."""
    return (mode.value if isinstance(mode, spans.Mode) else mode) == spans.Mode.PULL.value
