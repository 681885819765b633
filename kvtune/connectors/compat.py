"""The vLLM versions kvtune's connectors support, and every vLLM method they wrap.

vLLM's NIXL connector internals move between releases. At start-up :func:`check` looks up each
entry of :data:`WRAPPED` (class, method and the parameters kvtune reads) in the installed vLLM.
On a mismatch it says which methods are missing, then either the connectors run *uninstrumented*
(exactly vLLM's own classes, with a warning) or, with ``kv_connector_extra_config:
{"kvtune_strict": true}``, they refuse with :class:`~kvtune.errors.ConnectorError`. They are never
half-instrumented.
"""
from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Final

from kvtune import spans
from kvtune.errors import ConnectorError

_logger = logging.getLogger("kvtune.connectors")

SUPPORTED_VLLM_VERSIONS: Final = ("0.32.0",)
"""vLLM releases whose NIXL connector internals kvtune was built and tested against."""
STRICT_KEY: Final = "kvtune_strict"
"""``kv_connector_extra_config`` key: true -> refuse to start on a mismatch."""
NIXL_PKG: Final = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

_S = spans.SpanName


@dataclass(frozen=True)
class WrappedMethod:
    """One vLLM method kvtune overrides (calling vLLM's own first or around it)."""

    module: str
    """Module under :data:`NIXL_PKG`."""
    cls: str
    method: str
    params: tuple[str, ...]
    """Parameters kvtune reads (checked by name)."""
    phase: str
    """Which span(s) the override feeds."""

    @property
    def qualname(self) -> str:
        return f"{self.cls}.{self.method}"


def _w(module: str, cls: str, method: str, params: tuple[str, ...], *phases: _S | str) -> WrappedMethod:
    return WrappedMethod(module, cls, method, params,
                         ", ".join(p.value if isinstance(p, _S) else p for p in phases))


WRAPPED: Final[tuple[WrappedMethod, ...]] = (
    # Facades: kvtune builds its own scheduler/worker subclasses after the base initialiser.
    _w("connector", "NixlBaseConnector", "__init__", ("vllm_config", "role", "kv_cache_config"),
       "construction"),
    _w("connector", "NixlPullConnector", "start_load_kv", ("forward_context",), "construction"),
    _w("connector", "NixlPushConnector", "start_load_kv", ("forward_context",), "construction"),
    # Scheduler side (both modes).
    _w("pull_scheduler", "NixlPullConnectorScheduler", "get_num_new_matched_tokens",
       ("request", "num_computed_tokens"), _S.QUEUE, _S.PREFILL, _S.REUSE_DECISION),
    _w("pull_scheduler", "NixlPullConnectorScheduler", "update_state_after_alloc",
       ("request", "blocks", "num_external_tokens"), _S.PREFILL, _S.REUSE_DECISION),
    _w("pull_scheduler", "NixlPullConnectorScheduler", "request_finished",
       ("request", "block_ids"), _S.PREFILL, _S.RETENTION),
    _w("base_scheduler", "NixlBaseConnectorScheduler", "build_connector_meta",
       ("scheduler_output",), _S.DECODE_START, "metadata to workers"),
    _w("base_scheduler", "NixlBaseConnectorScheduler", "update_connector_output",
       ("connector_output",), _S.DECODE_START),
    _w("push_scheduler", "NixlPushConnectorScheduler", "get_num_new_matched_tokens",
       ("request", "num_computed_tokens"), _S.QUEUE, _S.PREFILL),
    _w("push_scheduler", "NixlPushConnectorScheduler", "update_state_after_alloc",
       ("request", "blocks", "num_external_tokens"), _S.PREFILL, _S.REGISTRATION),
    _w("push_scheduler", "NixlPushConnectorScheduler", "request_finished",
       ("request", "block_ids"), _S.PREFILL, _S.RENDEZVOUS),
    _w("push_scheduler", "NixlPushConnectorScheduler", "build_connector_meta",
       ("scheduler_output",), _S.DECODE_START, "metadata to workers"),
    _w("push_scheduler", "NixlPushConnectorScheduler", "update_connector_output",
       ("connector_output",), _S.DECODE_START),
    # Worker side (both modes).
    _w("base_worker", "NixlBaseConnectorWorker", "__init__",
       ("vllm_config", "engine_id", "kv_cache_config"), "NIXL agent proxy"),
    _w("base_worker", "NixlBaseConnectorWorker", "_nixl_handshake",
       ("host", "port", "remote_tp_size", "expected_engine_id"), _S.HANDSHAKE),
    _w("base_worker", "NixlBaseConnectorWorker", "_reap_expired_send_leases",
       ("done_sending",), _S.RETENTION, _S.NOTIFY),
    _w("base_worker", "NixlBaseConnectorWorker", "shutdown", (), _S.RETENTION),
    _w("base_worker", "NixlBaseConnectorWorker", "_pop_done_transfers", ("transfers",), _S.RDMA),
    # Pull worker.
    _w("pull_worker", "NixlPullConnectorWorker", "start_load_kv", ("metadata",),
       "metadata from scheduler"),
    _w("pull_worker", "NixlPullConnectorWorker", "_read_blocks_for_req", ("req_id", "meta"),
       _S.REUSE_DECISION),
    _w("pull_worker", "NixlPullConnectorWorker", "_is_turn2_read_expired", ("meta",),
       _S.REUSE_DECISION),
    _w("pull_worker", "NixlPullConnectorWorker", "_background_nixl_handshake",
       ("req_id", "remote_engine_id", "meta"), _S.HANDSHAKE),
    _w("pull_worker", "NixlPullConnectorWorker", "_read_blocks",
       ("read_spec", "dst_engine_id", "request_id", "remote_request_id"),
       _S.DESCRIPTOR_SETUP, _S.RDMA),
    _w("pull_worker", "NixlPullConnectorWorker", "_get_new_notifs", (), _S.NOTIFY, _S.RETENTION),
    # Push worker.
    _w("push_worker", "NixlPushConnectorWorker", "start_load_kv", ("metadata",),
       "metadata from scheduler"),
    _w("push_worker", "NixlPushConnectorWorker", "_send_registration_to_p", ("req_id", "reg_data"),
       _S.HANDSHAKE),
    _w("push_worker", "NixlPushConnectorWorker", "_do_send_reg_notif", ("req_id", "reg_data"),
       _S.REGISTRATION),
    _w("push_worker", "NixlPushConnectorWorker", "_handle_push_reg_notif", ("notif",),
       _S.RENDEZVOUS),
    _w("push_worker", "NixlPushConnectorWorker", "_do_start_push_kv",
       ("request_id", "local_block_ids", "registration_data"), _S.RENDEZVOUS, _S.HANDSHAKE),
    _w("push_worker", "NixlPushConnectorWorker", "_xfer_blocks",
       ("read_spec", "dst_engine_id", "request_id", "remote_request_id"),
       _S.DESCRIPTOR_SETUP, _S.RDMA),
    _w("push_worker", "NixlPushConnectorWorker", "get_transfer_results", (), _S.NOTIFY),
)
"""Every vLLM method the instrumented connectors override, and the span(s) it feeds."""

NIXL_AGENT_METHODS: Final = ("make_prepped_xfer", "transfer", "check_xfer_state",
                             "get_xfer_telemetry", "release_xfer_handle")
"""NIXL agent methods observed through :class:`~kvtune.connectors.nixl_agent.ObservedNixlAgent`."""

METADATA_FIELDS: Final = ("reqs_to_recv", "reqs_to_send", "push_registrations",
                          "push_finished_blocks")
"""``NixlConnectorMetadata`` fields kvtune reads."""


@dataclass(frozen=True)
class CompatReport:
    """Result of :func:`check`."""

    vllm_version: str
    version_supported: bool
    missing: tuple[str, ...]
    """``Class.method`` (or ``Class.method(param)``) entries not found in the installed vLLM."""

    @property
    def instrumentable(self) -> bool:
        """True when every wrapped method exists with the parameters kvtune reads."""
        return not self.missing

    def describe(self) -> str:
        parts = [f"vLLM {self.vllm_version}"]
        if not self.version_supported:
            parts.append(f"is not a supported version (supported: "
                         f"{', '.join(SUPPORTED_VLLM_VERSIONS)})")
        if self.missing:
            parts.append(f"lacks {len(self.missing)} method(s) kvtune wraps: "
                         f"{', '.join(self.missing)}")
        return "; ".join(parts) if len(parts) > 1 else f"{parts[0]}: supported"


def find_missing(table: tuple[WrappedMethod, ...] = WRAPPED, package: str = NIXL_PKG
                 ) -> tuple[str, ...]:
    """Entries of ``table`` absent from the installed vLLM (module, class, method or parameter)."""
    missing: list[str] = []
    for entry in table:
        try:
            module = importlib.import_module(f"{package}.{entry.module}")
        except ImportError:
            missing.append(f"{entry.module}.{entry.qualname} (module not importable)")
            continue
        cls = getattr(module, entry.cls, None)
        fn = getattr(cls, entry.method, None) if cls is not None else None
        if fn is None:
            missing.append(entry.qualname)
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        missing.extend(f"{entry.qualname}({p})" for p in entry.params if p not in params)
    try:
        metadata = importlib.import_module(f"{package}.metadata").NixlConnectorMetadata()
        missing.extend(f"NixlConnectorMetadata.{f}" for f in METADATA_FIELDS
                       if not hasattr(metadata, f))
    except Exception:  # noqa: BLE001 - any failure here is a mismatch
        missing.append("metadata.NixlConnectorMetadata")
    try:
        from nixl._api import nixl_agent
        missing.extend(f"nixl_agent.{m}" for m in NIXL_AGENT_METHODS if not hasattr(nixl_agent, m))
    except ImportError:
        missing.append("nixl._api.nixl_agent (NIXL not importable)")
    return tuple(missing)


def installed_vllm_version() -> str:
    try:
        import vllm
        return str(getattr(vllm, "__version__", "unknown"))
    except ImportError:
        return "not installed"


def _version_supported(version: str) -> bool:
    core = version.split("+")[0]
    return core in SUPPORTED_VLLM_VERSIONS


_CACHED: dict[str, CompatReport] = {}


def check(*, strict: bool = False, version: str | None = None,
          table: tuple[WrappedMethod, ...] = WRAPPED, package: str = NIXL_PKG) -> CompatReport:
    """Check the installed vLLM against :data:`WRAPPED`; log the outcome.

    Returns the report; the caller instruments only when ``report.instrumentable``. With
    ``strict`` a mismatch (missing methods or an unsupported version) raises
    :class:`ConnectorError` naming what is missing.
    """
    key = f"{version}|{id(table)}|{package}"
    report = _CACHED.get(key)
    if report is None:
        version = version or installed_vllm_version()
        report = CompatReport(version, _version_supported(version), find_missing(table, package))
        _CACHED[key] = report
    if strict and (report.missing or not report.version_supported):
        raise ConnectorError(
            f"kv_connector_extra_config.{STRICT_KEY}=true: {report.describe()}. Use a supported "
            f"vLLM or set {STRICT_KEY} to false to run uninstrumented.")
    if report.missing:
        _logger.warning("kvtune: %s. The connectors run UNINSTRUMENTED (exactly vLLM's own "
                        "behaviour, no kvtune spans).", report.describe())
    elif not report.version_supported:
        _logger.warning("kvtune: %s; every wrapped method was found, so the connectors are "
                        "instrumented, but this combination is untested.", report.describe())
    return report
