"""A real vLLM prefill/decode pair on this machine (CPU), in pull, push or bidirectional mode.

``LocalPair`` starts two ``python -m vllm.entrypoints.openai.api_server`` processes on 127.0.0.1
(prefill and decode), each on its own core with a small KV cache, connected by NIXL (UCX) through
either kvtune's instrumented connectors or vLLM's own, and drives the P/D flow of each mode through
kvtune's router (:class:`kvtune.router.server.Router`, served in this process on a thread, bound to
127.0.0.1; see :mod:`kvtune.vllm_pd` for the flows, and ``shared/CPU-VLLM.md`` (beside the
repository) for what was tried on these machines):

- pull: prefill with ``max_tokens=1`` and ``do_remote_decode``; then the decode with the
  ``kv_transfer_params`` the prefill returned (the decode READs the prompt's KV).
- push: both legs at once with one shared ``X-Request-Id``; the decode names the prefill up front
  (engine id, side-channel port, ``remote_request_id``) and the prefill WRITEs into its blocks.
- bidirectional: pull, plus the decode's returned ``kv_transfer_params`` (its retained blocks)
  stored per conversation (the router's store) and sent with that conversation's next prefill,
  which pulls the history back from the decode instead of recomputing it (subject to
  ``kv_recompute_threshold``).

The router uses the caller's request id for both legs, and passes the caller's ``traceparent`` to
them as it is (it makes no spans of its own here).

``SingleServer`` is one plain vLLM server (no connector) for reference outputs.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from opentelemetry import trace

from kvtune import vllm_pd
from kvtune.connectors.idle import EXTRA_CONFIG_KEY as IDLE_WAIT_KEY
from kvtune.connectors.progress import EXTRA_CONFIG_KEY as PROGRESS_DELAY_KEY
from kvtune.connectors.progress import THREAD_KEY
from kvtune.local import client, server
from kvtune.local.errors import LocalPairError
from kvtune.local.fabric import ShapedLink
from kvtune.local.layout import LAYOUTS, QUIET, PairLayout
from kvtune.local.metrics import PromptTokenSources, prompt_token_sources
from kvtune.local.regime import WARM, LabRegime
from kvtune.local.regime import regime as lab_regime
from kvtune.local.server import HOST, SERVED_MODEL_NAME, VllmServer, free_ports, logs_report
from kvtune.local.tiny_model import make_tiny_model
from kvtune.local.watchdog import StackWatchdog
from kvtune.router.config import InstanceConfig, RouterConfig
from kvtune.router.parsing import REQUEST_ID_HEADER
from kvtune.router.process import RouterInThread
from kvtune.router.server import LegRecord
from kvtune.router.state import SqliteConversationStore
from kvtune.router.tracing import TRACEPARENT_HEADER
from kvtune.spans import CONVERSATION_HEADER, Mode

AGENT_SETTING_KEYS: Final = (PROGRESS_DELAY_KEY, THREAD_KEY, IDLE_WAIT_KEY)
"""``kv_connector_extra_config`` keys only kvtune's connectors (and the plain ones) read."""
SPAN_EXPORT_DELAY_ENV: Final = "OTEL_BSP_SCHEDULE_DELAY"
SPAN_EXPORT_DELAY_MS: Final = 500
"""How often the servers' span exporters write (OpenTelemetry's default is every 5 s): spans still
queued when a server is stopped can be lost, so a run that stops the pair right after its last
request (``kvtune verify``, ``kvtune tune``) waits about twice this first."""
SPANS_DIR_ENV: Final = "KVTUNE_SPANS_DIR"
"""Environment variable that tells kvtune's connectors where to write OTLP-JSON span lines."""
KV_LEASE_DURATION_S: Final = 30
"""Prefill-side lease on blocks awaiting a READ. The quiet layout's legs take well under a second;
120 s was needed while engines starved (a 30 s lease expired before the decode read then)."""
LEG_TIMEOUT_S: Final = 60.0
"""Per-leg HTTP timeout: three times the hang watchdog's bound, far above the quiet layout's legs
(p99 150 ms in ``examples/stalls-side-by-side``); a CI machine may be loaded."""
DEFAULT_PREFILL_ENGINE_ID: Final = "kvtune-local-prefill"
DEFAULT_DECODE_ENGINE_ID: Final = "kvtune-local-decode"
WARMUP_PROMPT: Final = (11, 12, 13, 14, 15, 16, 17, 18)
WARMUP_ATTEMPTS: Final = 2
"""P/D warm-up attempts per pair start."""
PAIR_START_ATTEMPTS: Final = 2
"""Whole-pair starts: a P/D warm-up that fails every attempt stops both servers and starts anew
(a worker that hangs in the first reverse contact of a bidirectional pair never recovers: vLLM's
execute-model timeout kills its engine after minutes)."""
WARMUP_LEG_TIMEOUT_S: Final = 60.0
"""Per-leg HTTP timeout during the P/D warm-up (first-contact handshakes took up to 100 s on the
starved pinned layout; under a second on the quiet one)."""
WARMUP_MAX_OUTPUT_TOKENS: Final = 1024
MAX_UNCLAIMED_LEGS: Final = 1024
"""Requests whose leg records are kept until claimed (a failed request's late legs are dropped,
oldest first, beyond this)."""
HANG_BOUND_S: Final = 20.0
"""A leg still running after this long gets every server thread's stack dumped (``stacks/`` in the
workdir, see :mod:`kvtune.local.watchdog`); on the quiet layout legs take well under a second."""

_log = logging.getLogger(__name__)


def default_model_dir() -> Path:
    """Where the default tiny model is cached: ``$KVTUNE_TINY_MODEL_DIR`` or the temp directory."""
    env = os.environ.get("KVTUNE_TINY_MODEL_DIR")
    if env:
        return Path(env)
    return Path(tempfile.gettempdir()) / "kvtune-tiny-model" / "qwen3-seed0"


@dataclass(frozen=True)
class PairResult:
    """One completion through the pair (or a single server), timings in milliseconds."""

    text: str
    token_ids: tuple[int, ...]
    request_id: str
    """The shared ``X-Request-Id`` of both legs (vLLM makes ``cmpl-<id>-0-<suffix>`` of it)."""
    prefill_ms: float | None
    """Prefill leg, sent -> response (None for a single server)."""
    decode_ms: float
    """Decode leg (or the single server's request), sent -> last token."""
    ttft_ms: float | None
    """Request start -> first generated token seen by the client (None when not streamed:
    the bidirectional decode leg must be non-streaming to return its ``kv_transfer_params``)."""
    kv_transfer_params: dict[str, Any] | None = None
    """What the prefill returned and the decode was given (pull, bidirectional); in push mode,
    what the decode was given."""
    decode_kv_transfer_params: dict[str, Any] | None = None
    """What the decode returned (bidirectional: its retained blocks, for the next turn)."""
    prompt_token_ids: tuple[int, ...] = field(default=())


def _prompt_field(prompt: Sequence[int] | str) -> list[int] | str:
    if isinstance(prompt, str):
        if not prompt:
            raise LocalPairError("complete: prompt expected a non-empty string or token ids")
        return prompt
    ids = list(prompt)
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise LocalPairError("complete: prompt expected a non-empty sequence of non-negative "
                             "int token ids or a string")
    return ids


def _check_max_tokens(max_tokens: int) -> None:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise LocalPairError(f"complete: max_tokens expected an int >= 1, got {max_tokens!r}")


def _body(prompt: list[int] | str, max_tokens: int, *, ignore_eos: bool, stream: bool,
          kv_transfer_params: Mapping[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "seed": server.SEED, "ignore_eos": ignore_eos,
        "return_token_ids": True, "stream": stream,
    }
    if kv_transfer_params is not None:
        body[vllm_pd.KV_TRANSFER_PARAMS] = dict(kv_transfer_params)
    return body


def _headers(request_id: str, traceparent: str | None,
             conversation: str | None = None) -> dict[str, str]:
    headers = {REQUEST_ID_HEADER: request_id}
    if traceparent:
        headers[TRACEPARENT_HEADER] = traceparent
    if conversation is not None:
        headers[CONVERSATION_HEADER] = conversation
    return headers


class _Servers:
    """Shared start/stop/logs of a set of servers."""

    _servers: list[VllmServer]
    _watchdog: StackWatchdog | None = None
    _leg_timeout_s: float = LEG_TIMEOUT_S
    """Per-leg HTTP timeout; an instance value overrides it for a while (the P/D warm-up)."""

    def _start_servers(self) -> None:
        try:
            for s in self._servers:
                s.start()
            server.wait_healthy(self._servers)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every server (terminate, then kill); idempotent."""
        for s in self._servers:
            s.stop()

    def logs(self, n: int = server.LOG_TAIL_LINES) -> str:
        """The last ``n`` lines of every server's log."""
        return logs_report(self._servers, n)

    def _call(self, srv: VllmServer, leg: str, body: Mapping[str, Any],
              headers: Mapping[str, str]) -> client.CompletionResponse:
        watch = (self._watchdog.watch(f"{leg} {srv.name} {headers.get('X-Request-Id', '')}")
                 if self._watchdog is not None else contextlib.nullcontext())
        try:
            with watch:
                return client.complete(srv.url, body, headers=headers,
                                       timeout_s=self._leg_timeout_s)
        except client.HttpError as exc:
            exited = srv.exited()
            state = f" (server exited with code {exited})" if exited is not None else ""
            raise LocalPairError(f"{leg} leg to {srv.name} ({srv.url}){state}: expected HTTP 200 "
                                 f"with a completion; {exc}\n{self.logs()}") from exc


class LocalPair(_Servers):
    """A prefill and a decode vLLM server on 127.0.0.1, and the P/D flow of ``mode``.

    Use as a context manager: entering starts both servers (waits for ``/health``, sends a
    warm-up request to each, then one P/D warm-up so the NIXL handshake is done); leaving stops
    them, always. Server logs are in ``workdir/prefill/vllm.log`` and ``workdir/decode/vllm.log``.
    """

    def __init__(self, mode: str, *, connector: str = "kvtune", workdir: str | os.PathLike[str],
                 spans_dir: str | os.PathLike[str] | None = None,
                 model_dir: str | os.PathLike[str] | None = None,
                 extra_env: Mapping[str, str] | None = None,
                 kv_extra_config: Mapping[str, Any] | None = None,
                 role_kv_extra_config: Mapping[str, Mapping[str, Any]] | None = None,
                 ttl_s: float | None = None, recompute_threshold: int | None = None,
                 prefill_engine_id: str = DEFAULT_PREFILL_ENGINE_ID,
                 decode_engine_id: str = DEFAULT_DECODE_ENGINE_ID,
                 cpu_cores: tuple[int, int] = (0, 1), warmup_transfer: bool = True,
                 layout: PairLayout | str = QUIET, fabric: ShapedLink | None = None,
                 kv_both: bool = False, regime: LabRegime | str = WARM,
                 router_overrides: Mapping[str, Any] | None = None) -> None:
        if mode not in vllm_pd.MODES:
            raise LocalPairError(f"LocalPair: mode expected one of {vllm_pd.MODES}, got {mode!r}")
        # ``vllm`` becomes ``plain`` when the layout changes the NIXL agent, which vLLM's classes
        # cannot (:data:`kvtune.vllm_pd.CONNECTOR_CLASSES`).
        if connector not in vllm_pd.CONNECTOR_FAMILIES:
            raise LocalPairError(f"LocalPair: connector expected one of "
                                 f"{vllm_pd.CONNECTOR_FAMILIES}, got {connector!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise LocalPairError(f"LocalPair: ttl_s expected a positive number, got {ttl_s!r}")
        if recompute_threshold is not None and (
                not isinstance(recompute_threshold, int) or recompute_threshold < 0):
            raise LocalPairError(f"LocalPair: recompute_threshold expected an int >= 0, "
                                 f"got {recompute_threshold!r}")
        if mode == "push" and (ttl_s is not None or recompute_threshold is not None):
            raise LocalPairError("LocalPair: ttl_s and recompute_threshold apply to mode "
                                 "'bidirectional' (vLLM's push connector refuses bidirectional)")
        if prefill_engine_id == decode_engine_id:
            raise LocalPairError("LocalPair: prefill_engine_id and decode_engine_id must differ")
        if isinstance(layout, str):
            if layout not in LAYOUTS:
                raise LocalPairError(f"LocalPair: layout expected one of {sorted(LAYOUTS)}, "
                                     f"got {layout!r}")
            layout = LAYOUTS[layout]
        self.layout = layout
        self.regime = lab_regime(regime)
        """The engines' KV cache sizes and ``--max-model-len`` (:mod:`kvtune.local.regime`)."""
        self.fabric = fabric
        """``None``: loopback (UCX picks shared memory or TCP on 127.0.0.1); a :class:`ShapedLink`
        (opened by the caller): the decode runs in the link's namespace and NIXL uses TCP on it."""
        self.mode = mode
        self.connector = connector
        self.workdir = Path(workdir)
        self.spans_dir = Path(spans_dir) if spans_dir is not None else None
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.extra_env = dict(extra_env or {})
        self.kv_extra_config = dict(kv_extra_config or {})
        unknown = set(role_kv_extra_config or {}) - {"prefill", "decode"}
        if unknown:
            raise LocalPairError(f"LocalPair: role_kv_extra_config keys expected 'prefill' and/or "
                                 f"'decode', got {sorted(unknown)}")
        self.role_kv_extra_config = {k: dict(v) for k, v in (role_kv_extra_config or {}).items()}
        self.ttl_s = ttl_s
        self.recompute_threshold = recompute_threshold
        self.prefill_engine_id = prefill_engine_id
        self.decode_engine_id = decode_engine_id
        self.cpu_cores = cpu_cores
        self.warmup_transfer = warmup_transfer
        self.kv_both = kv_both
        """Both engines start with ``kv_role: kv_both`` (each request's leg from its params)
        instead of ``kv_producer`` / ``kv_consumer``."""
        self.router_overrides = dict(router_overrides or {})
        """:class:`RouterConfig` fields for the pair's router (e.g. the renewable decode lease's
        ``lease_s``), applied over what :meth:`router_config` derives."""
        self._router: RouterInThread | None = None
        self._store: SqliteConversationStore | None = None
        self._legs: dict[str, dict[str, LegRecord]] = {}
        self._legs_changed = threading.Condition()
        self._servers = []
        self.prefill: VllmServer | None = None
        self.decode: VllmServer | None = None

    # --- configuration -------------------------------------------------------------------------
    def kv_transfer_config(self, role: str) -> dict[str, Any]:
        """The ``--kv-transfer-config`` of the prefill (``role="prefill"``) or decode server."""
        extra: dict[str, Any] = {vllm_pd.KV_LEASE_DURATION: KV_LEASE_DURATION_S,
                                 **self.layout.kv_extra_config(self.mode)}
        if self.ttl_s is not None:
            extra[vllm_pd.DECODER_KV_BLOCKS_TTL] = self.ttl_s
        if self.recompute_threshold is not None:
            extra[vllm_pd.KV_RECOMPUTE_THRESHOLD] = self.recompute_threshold
        extra.update(self.kv_extra_config)
        extra.update(self.role_kv_extra_config.get(role, {}))
        plain = self.connector == "vllm" and any(
            extra.get(k) is not None for k in AGENT_SETTING_KEYS)
        return vllm_pd.kv_transfer_config(
            role, self.mode, connector="plain" if plain else self.connector,
            engine_id=self.prefill_engine_id if role == "prefill" else self.decode_engine_id,
            kv_buffer_device="cpu", extra_config=extra,
            kv_role=vllm_pd.KV_BOTH if self.kv_both else None)

    def router_config(self) -> RouterConfig:
        """The configuration of the router that drives this pair's requests (running servers)."""
        prefill, decode = self._require("prefill"), self._require("decode")
        extra = self.kv_transfer_config("decode")[vllm_pd.KV_CONNECTOR_EXTRA_CONFIG]
        timeout_s = self._leg_timeout_s
        return RouterConfig(
            # push: the decode handshakes with the prefill's side channel, which listens on the
            # prefill's address (its namespace's on a shaped link)
            prefill=(InstanceConfig(prefill.url, engine_id=self.prefill_engine_id,
                                    kv_host=self.fabric.host("prefill") if self.fabric else HOST,
                                    kv_port=self.prefill_side_channel_port),),
            decode=(InstanceConfig(decode.url),), mode=Mode(self.mode), host=HOST, port=0,
            state=":memory:",
            decoder_ttl_s=float(extra.get(vllm_pd.DECODER_KV_BLOCKS_TTL,
                                          vllm_pd.DEFAULT_DECODER_KV_BLOCKS_TTL_S)),
            prefill_timeout_s=timeout_s, decode_timeout_s=timeout_s,
            stream_idle_timeout_s=timeout_s).replace(**self.router_overrides)

    @property
    def prefill_url(self) -> str:
        return self._require("prefill").url

    @property
    def decode_url(self) -> str:
        return self._require("decode").url

    @property
    def prefill_side_channel_port(self) -> int:
        port = self._require("prefill").side_channel_port
        assert port is not None
        return port

    def _require(self, name: str) -> VllmServer:
        srv = self.prefill if name == "prefill" else self.decode
        if srv is None or srv.proc is None:
            raise LocalPairError(f"LocalPair: {name} server not running "
                                 "(use 'with LocalPair(...)')")
        return srv

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> LocalPair:
        module = vllm_pd.KVTUNE_CONNECTOR_MODULE
        if self.connector == "kvtune" and importlib.util.find_spec(module) is None:
            raise LocalPairError(f"LocalPair: connector='kvtune' needs {module}, "
                                 "which is not importable here; use connector='vllm'")
        model_dir = self.model_dir or make_tiny_model(default_model_dir())
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**self.extra_env}
        if self.spans_dir is not None:
            self.spans_dir.mkdir(parents=True, exist_ok=True)
            env[SPANS_DIR_ENV] = str(self.spans_dir.resolve())
            env.setdefault(SPAN_EXPORT_DELAY_ENV, str(SPAN_EXPORT_DELAY_MS))
        for pair_attempt in range(1, PAIR_START_ATTEMPTS + 1):
            try:
                self._start_once(model_dir, env)
                return self
            except LocalPairError as exc:
                if pair_attempt == PAIR_START_ATTEMPTS or not self.warmup_transfer:
                    raise
                # A guard, not a budget: the quiet layout had no hung start in 40 (bench/
                # pair_starts.py); a restart here is a defect to report, with the stacks.
                _log.error("LocalPair %s: HANG GUARD: the P/D warm-up failed on start %d/%d; "
                           "restarting both servers (stacks, if a leg passed %g s: %s): %s",
                           self.mode, pair_attempt, PAIR_START_ATTEMPTS, HANG_BOUND_S,
                           self.workdir / "stacks", str(exc).splitlines()[0][:300])
        raise AssertionError("unreachable")

    def _start_once(self, model_dir: Path, env: dict[str, str]) -> None:
        p_port, d_port, p_side, d_side = free_ports(4)
        link = self.fabric
        self.prefill, self.decode = (VllmServer(
            role, model_dir=model_dir, workdir=self.workdir, port=port, cpu_core=core,
            kv_transfer_config=self.kv_transfer_config(role),
            env={**self.layout.env(core), **(link.env(role) if link else {}), **env},
            side_channel_port=side, max_model_len=self.regime.max_model_len,
            num_blocks=(self.regime.prefill_kv_blocks if role == "prefill"
                        else self.regime.decode_kv_blocks),
            **({"host": link.host(role), "launch_prefix": link.prefix(role)} if link else {}))
            for role, port, side, core in (("prefill", p_port, p_side, self.cpu_cores[0]),
                                           ("decode", d_port, d_side, self.cpu_cores[1])))
        self._servers = [self.prefill, self.decode]
        if self._watchdog is None:  # one per pair: its dump files are numbered across restarts
            self._watchdog = StackWatchdog(
                self.workdir / "stacks", bound_s=HANG_BOUND_S,
                leaders=lambda: [s.proc.pid for s in self._servers if s.proc is not None])
        self._start_servers()
        try:
            for srv in self._servers:  # plain warm-up: no KV transfer
                self._call(srv, "warm-up", _body(list(WARMUP_PROMPT), 2, ignore_eos=True,
                                                 stream=False, kv_transfer_params=None),
                           {"X-Request-Id": f"kvtune-warmup-{srv.name}-{uuid.uuid4().hex[:8]}"})
            self._leg_timeout_s = (WARMUP_LEG_TIMEOUT_S if self.warmup_transfer
                                   else LEG_TIMEOUT_S)
            try:
                self._start_router()
                if self.warmup_transfer:
                    self._warmup_transfers()
            finally:
                del self._leg_timeout_s
            assert self._router is not None
            # The router reads its config per request: the warm-up's leg timeouts end here.
            self._router.router.config = self.router_config()
        except BaseException:
            self.stop()
            raise

    def _start_router(self) -> None:
        config = self.router_config()
        self._store = SqliteConversationStore(":memory:", params_ttl_s=config.params_ttl_s,
                                              retention_s=config.state_retention_s)
        self._router = RouterInThread(config, store=self._store, tracer=trace.NoOpTracer(),
                                      on_leg=self._on_leg, trusted_client=True)
        self._router.start()

    def stop(self) -> None:
        """Stop the pair's router and both servers (terminate, then kill); idempotent."""
        if self._router is not None:
            try:
                self._router.stop()
            except Exception:
                _log.warning("LocalPair: stopping the router failed", exc_info=True)
            self._router = None
        super().stop()

    def _warmup_transfers(self) -> None:
        """P/D warm-up so that every NIXL handshake of this mode is done before the caller's
        requests: decode -> prefill (pull, push), prefill -> decode (push's WRITE side, and the
        bidirectional reverse pull, which needs a second turn long enough to beat the recompute
        threshold). A handshake waits only 5 s for the peer's metadata (vLLM's ``RCVTIMEO``), so on
        a loaded machine the first contact can fail with HTTP 500 (see ``kvtune/local/README.md``):
        retried here, bounded, each failure logged."""
        extra = self.kv_transfer_config("prefill")[vllm_pd.KV_CONNECTOR_EXTRA_CONFIG]
        threshold = int(extra.get(vllm_pd.KV_RECOMPUTE_THRESHOLD,
                                  vllm_pd.DEFAULT_KV_RECOMPUTE_THRESHOLD_TOKENS))
        # Turn 1's prompt (24 tokens) fills no 128-token block, so the prefill's own prefix cache
        # holds none of the history and it must pull prompt + output - 1 >= threshold tokens.
        turn1_tokens = min(max(threshold, 1) + 8, WARMUP_MAX_OUTPUT_TOKENS)
        last: LocalPairError | None = None
        for attempt in range(1, WARMUP_ATTEMPTS + 1):
            tag = f"kvtune-warmup-pd-{uuid.uuid4().hex[:8]}"
            conv = tag if self.mode == "bidirectional" else None
            try:
                first = self.complete(list(WARMUP_PROMPT) * 3, turn1_tokens if conv else 2,
                                      request_id=f"{tag}-1", conversation=conv)
                if conv is not None:
                    prompt2 = list(WARMUP_PROMPT) * 3 + list(first.token_ids) + list(WARMUP_PROMPT)
                    self.complete(prompt2, 2, request_id=f"{tag}-2", conversation=conv)
                return
            except LocalPairError as exc:
                last = exc
                _log.warning("LocalPair %s: P/D warm-up attempt %d/%d failed: %s", self.mode,
                             attempt, WARMUP_ATTEMPTS, str(exc).splitlines()[0][:500])
            finally:
                if conv is not None:
                    self.forget(conv)
        assert last is not None
        raise last

    def __enter__(self) -> LocalPair:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- requests ------------------------------------------------------------------------------
    def complete(self, prompt: Sequence[int] | str, max_tokens: int, *,
                 request_id: str | None = None, conversation: str | None = None,
                 traceparent: str | None = None, ignore_eos: bool = True) -> PairResult:
        """One completion through the P/D flow of this pair's mode (temperature 0, fixed seed).

        ``conversation`` (bidirectional only) links turns: the decode's retained blocks from the
        previous turn of that conversation are offered to this turn's prefill. ``traceparent``
        (W3C) goes on both legs as a header and inside ``kv_transfer_params``.
        """
        prompt_field = _prompt_field(prompt)
        _check_max_tokens(max_tokens)
        if conversation is not None and self.mode != "bidirectional":
            raise LocalPairError(f"complete: conversation applies to mode 'bidirectional', "
                                 f"this pair is {self.mode!r}")
        rid = request_id or f"kvtune-{uuid.uuid4().hex[:16]}"
        url = self._router_url()
        # Only non-streamed answers carry the decode's kv_transfer_params on vLLM 0.32 (see
        # kvtune.vllm_pd.STREAMED_PARAMS_SINCE): bidirectional turns need them.
        stream = self.mode != Mode.BIDIRECTIONAL.value
        body = _body(prompt_field, max_tokens, ignore_eos=ignore_eos, stream=stream,
                     kv_transfer_params=None)
        watch = (self._watchdog.watch(f"{self.mode} {rid}") if self._watchdog is not None
                 else contextlib.nullcontext())
        try:
            with watch:
                # Both legs go through the router: the client waits for both of them in turn.
                r = client.complete(url, body, headers=_headers(rid, traceparent, conversation),
                                    timeout_s=2 * self._leg_timeout_s)
        except client.HttpError as exc:
            raise self._failed(rid, exc) from exc
        legs = self._take_legs(rid, self._leg_timeout_s)
        p, d = legs.get("prefill"), legs.get("decode")
        for leg, rec in (("prefill", p), ("decode", d)):
            if rec is None or rec.error is not None:
                why = (rec.error if rec is not None
                       else f"no answer within {self._leg_timeout_s:.0f} s")
                raise LocalPairError(f"{leg} leg of {rid}: {why}\n{self.logs()}")
        assert p is not None and d is not None
        push = self.mode == Mode.PUSH.value
        return PairResult(
            text=r.text, token_ids=r.token_ids, request_id=rid, prefill_ms=p.elapsed_ms,
            decode_ms=d.elapsed_ms, ttft_ms=r.first_token_ms,
            # pull/bidirectional: what the prefill returned (the decode was given it); push:
            # what the decode was given.
            kv_transfer_params=_without_context(d.sent_kv_transfer_params if push
                                                else p.kv_transfer_params),
            decode_kv_transfer_params=r.kv_transfer_params,
            prompt_token_ids=_prompt_ids(p.answer or {}))

    def _router_url(self) -> str:
        self._require("prefill")
        self._require("decode")
        if self._router is None:
            raise LocalPairError("LocalPair: router not running (use 'with LocalPair(...)')")
        return self._router.url

    def _on_leg(self, record: LegRecord) -> None:
        """The router's ``on_leg`` observer (on the router's thread)."""
        with self._legs_changed:
            self._legs.setdefault(record.request_id, {})[record.leg] = record
            while len(self._legs) > MAX_UNCLAIMED_LEGS:  # legs of requests that failed first
                self._legs.pop(next(iter(self._legs)))
            self._legs_changed.notify_all()

    def _take_legs(self, rid: str, timeout_s: float) -> dict[str, LegRecord]:
        """The records of ``rid``'s legs, once both are in (or ``timeout_s`` passed)."""
        with self._legs_changed:
            self._legs_changed.wait_for(lambda: len(self._legs.get(rid, ())) == 2, timeout_s)
            return self._legs.pop(rid, {})

    def _failed(self, rid: str, exc: client.HttpError) -> LocalPairError:
        """The error for a request the router answered with an error: names the failed leg and
        server (from the router's leg records, else its JSON error) and appends the logs."""
        failed = [r for r in self._take_legs(rid, 0.0).values() if r.error is not None]
        leg = failed[0].leg if failed else None
        if leg is None:
            try:
                leg = json.loads(exc.body)["error"].get("leg")
            except (ValueError, KeyError, TypeError, AttributeError):
                leg = None
        srv = self.prefill if leg == "prefill" else self.decode if leg == "decode" else None
        if srv is None:
            return LocalPairError(f"request {rid} through the pair's router: expected HTTP 200 "
                                  f"with a completion; {exc}\n{self.logs()}")
        exited = srv.exited()
        state = f" (server exited with code {exited})" if exited is not None else ""
        return LocalPairError(f"{leg} leg to {srv.name} ({srv.url}){state}: expected HTTP 200 "
                              f"with a completion; {exc}\n{self.logs()}")

    def forget(self, conversation: str) -> None:
        """Drop what the pair holds for ``conversation`` (its next turn starts fresh)."""
        if self._store is not None:
            self._store.forget(conversation)

    def end_conversation(self, conversation: str) -> dict[str, Any]:
        """Tell the pair's router that ``conversation`` is over (``POST``
        :data:`kvtune.router.lease.END_PATH`); its answer (``released``: a lease was released)."""
        from kvtune.router import client as router_client
        from kvtune.router.lease import END_PATH
        r = router_client.post(self._router_url() + END_PATH, {"conversation_id": conversation},
                               timeout_s=60.0)
        if r.status != 200:
            raise LocalPairError(f"ending conversation {conversation!r}: expected HTTP 200, got "
                                 f"{r.status}: {r.body[:500]!r}")
        return dict(r.json())

    def router_health(self) -> dict[str, Any]:
        """The pair's router's ``/health`` answer."""
        from kvtune.router import client as router_client
        r = router_client.get(self._router_url() + "/health", timeout_s=60.0)
        if r.status != 200:
            raise LocalPairError(f"router /health: expected HTTP 200, got {r.status}")
        return dict(r.json())

    def conversation_params(self, conversation: str) -> dict[str, Any] | None:
        """The decode's retained-block params stored for ``conversation`` (bidirectional)."""
        return self._store.peek_params(conversation) if self._store is not None else None

    # --- evidence ------------------------------------------------------------------------------
    def decode_prompt_sources(self) -> PromptTokenSources:
        """The decode server's cumulative prompt tokens by source (from its ``/metrics``)."""
        return prompt_token_sources(self.decode_url)

    def prefill_prompt_sources(self) -> PromptTokenSources:
        """The prefill server's cumulative prompt tokens by source (from its ``/metrics``)."""
        return prompt_token_sources(self.prefill_url)


def _without_context(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``params`` without kvtune's per-request carriers (traceparent, conversation, turn)."""
    if params is None:
        return None
    return {k: v for k, v in params.items() if k not in vllm_pd.CONTEXT_KEYS}


def _prompt_ids(body: Mapping[str, Any]) -> tuple[int, ...]:
    try:
        return tuple(body["choices"][0].get("prompt_token_ids") or ())
    except (KeyError, IndexError, TypeError, AttributeError):
        return ()


class SingleServer(_Servers):
    """One plain vLLM server (no KV connector) for reference outputs; a context manager."""

    def __init__(self, *, workdir: str | os.PathLike[str],
                 model_dir: str | os.PathLike[str] | None = None,
                 extra_env: Mapping[str, str] | None = None, cpu_core: int = 0,
                 name: str = "single") -> None:
        self.workdir = Path(workdir)
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.extra_env = dict(extra_env or {})
        self.cpu_core = cpu_core
        self.name = name
        self._servers = []
        self.server: VllmServer | None = None

    @property
    def url(self) -> str:
        if self.server is None or self.server.proc is None:
            raise LocalPairError("SingleServer: not running (use 'with SingleServer(...)')")
        return self.server.url

    def start(self) -> SingleServer:
        model_dir = self.model_dir or make_tiny_model(default_model_dir())
        self.workdir.mkdir(parents=True, exist_ok=True)
        (port,) = free_ports(1)
        self.server = VllmServer(self.name, model_dir=model_dir, workdir=self.workdir, port=port,
                                 cpu_core=self.cpu_core, env=self.extra_env)
        self._servers = [self.server]
        self._start_servers()
        return self

    def __enter__(self) -> SingleServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def complete(self, prompt: Sequence[int] | str, max_tokens: int, *,
                 request_id: str | None = None, ignore_eos: bool = True) -> PairResult:
        """One streamed completion (temperature 0, fixed seed)."""
        prompt_field = _prompt_field(prompt)
        _check_max_tokens(max_tokens)
        rid = request_id or f"kvtune-{uuid.uuid4().hex[:16]}"
        assert self.server is not None
        r = self._call(self.server, "single", _body(prompt_field, max_tokens,
                                                    ignore_eos=ignore_eos, stream=True,
                                                    kv_transfer_params=None),
                       _headers(rid, None))
        return PairResult(text=r.text, token_ids=r.token_ids, request_id=rid, prefill_ms=None,
                          decode_ms=r.elapsed_ms, ttft_ms=r.first_token_ms,
                          prompt_token_ids=_prompt_ids(r.body))
