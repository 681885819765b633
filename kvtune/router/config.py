"""The router's configuration: :class:`RouterConfig`, read from a YAML/JSON file or CLI flags.

Configuration file keys (YAML or JSON; ``kvtune.export`` writes ``router.yaml`` with these keys)::

    mode: bidirectional          # pull | push | bidirectional (default: pull)
    host: 127.0.0.1              # address to bind (default 127.0.0.1)
    port: 8000                   # port to bind; 0 = any free port (default 8000)
    state: sqlite:router-state.db  # conversation store: sqlite:PATH (default) or redis://HOST:PORT/DB
    decoder_ttl_s: 480           # the decode's decoder_kv_blocks_ttl, seconds (vLLM's default 480)
    margin_s: 30                 # stored decode params expire this long before the decode's TTL
                                 #   (default: min(30, decoder_ttl_s / 4))
    state_retention_s: 86400     # how long a conversation's turn counter is kept after its last turn
    max_body_bytes: 8388608      # larger request bodies are refused with 413
    max_connections: 1024        # client connections open at once; more get 503 and are closed
    max_connections_per_client: 256  # connections one client address may hold (default: a quarter
                                 #   of max_connections); more get 429. Behind a proxy every
                                 #   client is the proxy's address: set it to max_connections
    header_timeout_s: 30         # a client must send a request's headers within this time (from
                                 #   connecting or from the previous answer), else it is closed
    connect_timeout_s: 10        # per upstream connection attempt
    prefill_timeout_s: 600       # whole prefill leg
    decode_timeout_s: 600        # whole non-streaming decode leg
    stream_idle_timeout_s: 300   # longest silence between two chunks of a streaming decode
    stream_deadline_s: 3600      # longest a streaming decode may run in all (a trickling upstream
                                 #   is cut off here: the client gets an SSE error event)
    tenant_header: X-Tenant      # optional: a request header holding the client's tenant key (e.g.
                                 #   a hash of its API key); conversation ids are scoped by it, and
                                 #   a request naming a conversation without it gets 400
    lease_s: 30                  # bidirectional: renew the decode's hold on a conversation's blocks
                                 #   for this long at a time (kvtune's decode connector with
                                 #   kvtune_lease_port; see kvtune.router.lease); default: off
    lease_renew_every_s: 10      # how often (default lease_s / 3; at most min(lease_s,
                                 #   decoder_ttl_s) - 6 s)
    lease_idle_s: 480            # renewals stop this long after a conversation's last turn
                                 #   without a new one or an explicit end (default 480)
    telemetry: {}                # keyword arguments for kvtune.telemetry.setup(Role.ROUTER, ...)
    prefill:                     # one or more prefill instances
      - url: http://127.0.0.1:8100
        engine_id: prefill-0     # push only: the prefill's fixed kv-transfer-config engine_id
        kv_host: 127.0.0.1       # push only: its NIXL side-channel host (default: the URL's host)
        kv_port: 5600            # push only: its VLLM_NIXL_SIDE_CHANNEL_PORT
        tp_size: 1               # its tensor-parallel size (default 1)
        pp_size: 1               # its pipeline-parallel size (default 1)
    decode:
      - url: http://127.0.0.1:8200

An instance may also be given as a plain URL string. Unknown keys are refused (a typo would
otherwise silently fall back to a default).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvtune.errors import ConfigError
from kvtune.redact import redact_url
from kvtune.spans import PD_MODES, Mode
from kvtune.vllm_pd import (DEFAULT_DECODER_KV_BLOCKS_TTL_S, MIN_ROUTER_MARGIN_S,
                            router_margin_s)

DEFAULT_DECODER_TTL_S = float(DEFAULT_DECODER_KV_BLOCKS_TTL_S)
"""vLLM's default ``decoder_kv_blocks_ttl`` (NIXL connector, bidirectional mode)."""
DEFAULT_LEASE_RENEWALS_PER_LEASE = 3
"""A lease is renewed this many times per ``lease_s`` unless ``lease_renew_every_s`` says."""
DEFAULT_LEASE_IDLE_S = float(DEFAULT_DECODER_KV_BLOCKS_TTL_S)
"""Renewals stop this long after a conversation's last turn (vLLM's fixed TTL: a lease holds no
longer than today's default unless asked to, and less when the conversation ends)."""
LEASE_FIELDS = ("lease_s", "lease_renew_every_s", "lease_idle_s")
"""The renewable decode lease's fields (written by :meth:`RouterConfig.to_dict` only when on)."""
DEFAULT_STREAM_DEADLINE_S = 3600.0
"""Longest a streamed decode may run in all: 32k tokens at 10 tokens/s take under an hour; an
upstream trickling a byte now and then (each within ``stream_idle_timeout_s``) is cut off here."""
DEFAULT_CLIENT_CONNECTION_SHARE = 0.25
"""Share of ``max_connections`` one client address may hold when ``max_connections_per_client``
is not set: one client cannot fill the router, four are needed."""


@dataclass(frozen=True)
class InstanceConfig:
    """One vLLM instance behind the router."""

    url: str
    engine_id: str | None = None
    kv_host: str | None = None
    kv_port: int | None = None
    tp_size: int = 1
    pp_size: int = 1

    @property
    def side_channel_host(self) -> str:
        """The NIXL side-channel host: ``kv_host`` or the URL's host."""
        return self.kv_host or (urlsplit(self.url).hostname or "127.0.0.1")


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs; see the module docstring for the file keys."""

    prefill: tuple[InstanceConfig, ...]
    decode: tuple[InstanceConfig, ...]
    mode: Mode = Mode.PULL
    host: str = "127.0.0.1"
    port: int = 8000
    state: str = "sqlite:router-state.db"
    decoder_ttl_s: float = DEFAULT_DECODER_TTL_S
    margin_s: float | None = None
    """None: :func:`kvtune.vllm_pd.router_margin_s` of ``decoder_ttl_s`` (set in
    ``__post_init__``): stored params expire this long before the decode frees the blocks."""
    state_retention_s: float = 86400.0
    max_body_bytes: int = 8 * 1024 * 1024
    max_connections: int = 1024
    header_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    prefill_timeout_s: float = 600.0
    decode_timeout_s: float = 600.0
    stream_idle_timeout_s: float = 300.0
    stream_deadline_s: float = DEFAULT_STREAM_DEADLINE_S
    """Longest a streamed decode may run in all, seconds (see :data:`DEFAULT_STREAM_DEADLINE_S`)."""
    max_connections_per_client: int | None = None
    """Connections one client address may hold; None: :data:`DEFAULT_CLIENT_CONNECTION_SHARE` of
    ``max_connections`` (:attr:`connections_per_client`)."""
    tenant_header: str | None = None
    """A request header whose value (a tenant key) scopes conversation ids; None: no tenants."""
    lease_s: float | None = None
    """Renewable decode lease (:mod:`kvtune.router.lease`): seconds per renewal; None: off."""
    lease_renew_every_s: float | None = None
    """Seconds between renewals; None: ``lease_s`` / :data:`DEFAULT_LEASE_RENEWALS_PER_LEASE`."""
    lease_idle_s: float | None = None
    """Renewals stop this long after a conversation's last turn; None: :data:`DEFAULT_LEASE_IDLE_S`."""
    telemetry: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.margin_s is None and isinstance(self.decoder_ttl_s, (int, float)):
            object.__setattr__(self, "margin_s", router_margin_s(self.decoder_ttl_s))
        if isinstance(self.lease_s, (int, float)):
            if self.lease_renew_every_s is None:
                object.__setattr__(self, "lease_renew_every_s",
                                   self.lease_s / DEFAULT_LEASE_RENEWALS_PER_LEASE)
            if self.lease_idle_s is None:
                object.__setattr__(self, "lease_idle_s", DEFAULT_LEASE_IDLE_S)
        _validate(self)

    @property
    def params_ttl_base_s(self) -> float:
        """How long a fixed-TTL decode's stored params are used: ``decoder_ttl_s - margin_s``."""
        assert self.margin_s is not None  # set in __post_init__
        return self.decoder_ttl_s - self.margin_s

    @property
    def params_ttl_s(self) -> float:
        """How long the store keeps decode params: :attr:`params_ttl_base_s`, or with the lease on
        the longest a lease can live (``lease_idle_s + lease_s``; the lease decides each offer)."""
        if self.lease_s is None or self.lease_idle_s is None:
            return self.params_ttl_base_s
        return max(self.params_ttl_base_s, self.lease_idle_s + self.lease_s)

    @property
    def connections_per_client(self) -> int:
        """Connections one client address may hold: ``max_connections_per_client``, else
        :data:`DEFAULT_CLIENT_CONNECTION_SHARE` of ``max_connections`` (at least 1)."""
        if self.max_connections_per_client is not None:
            return self.max_connections_per_client
        return max(1, math.ceil(self.max_connections * DEFAULT_CLIENT_CONNECTION_SHARE))

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, in the file format (round-trips through :func:`config_from_dict`)."""
        out = dataclasses.asdict(self)
        out["mode"] = self.mode.value
        out["telemetry"] = dict(self.telemetry)
        if self.lease_s is None:
            for name in LEASE_FIELDS:
                del out[name]
        return out

    def replace(self, **changes: Any) -> RouterConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name for f in dataclasses.fields(RouterConfig)}
_INSTANCE_FIELDS = {f.name for f in dataclasses.fields(InstanceConfig)}


def _validate(cfg: RouterConfig, source: str = "router config") -> None:
    if not isinstance(cfg.mode, Mode) or cfg.mode not in PD_MODES:
        raise ConfigError(f"{source}: field 'mode': expected one of "
                          f"{[m.value for m in PD_MODES]}, got {cfg.mode!r}")
    if not cfg.prefill:
        raise ConfigError(f"{source}: field 'prefill': expected at least one instance")
    if not cfg.decode:
        raise ConfigError(f"{source}: field 'decode': expected at least one instance")
    for role, instances in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        for i, inst in enumerate(instances):
            parts = urlsplit(inst.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"{source}: field '{role}[{i}].url': expected an http(s) URL, "
                                  f"got {redact_url(inst.url)!r}")
            if inst.tp_size < 1 or inst.pp_size < 1:
                raise ConfigError(f"{source}: field '{role}[{i}].tp_size/pp_size': expected >= 1")
            if role == "prefill" and cfg.mode == Mode.PUSH and (
                    not inst.engine_id or inst.kv_port is None):
                raise ConfigError(
                    f"{source}: field '{role}[{i}]': push mode names the prefill up front, so each "
                    f"prefill needs 'engine_id' (its kv-transfer-config engine_id) and 'kv_port' "
                    f"(its NIXL side-channel port); got engine_id={inst.engine_id!r}, "
                    f"kv_port={inst.kv_port!r}")
    if not (0 <= cfg.port <= 65535):
        raise ConfigError(f"{source}: field 'port': expected 0..65535, got {cfg.port}")
    for name in ("decoder_ttl_s", "connect_timeout_s", "prefill_timeout_s", "decode_timeout_s",
                 "stream_idle_timeout_s", "state_retention_s", "header_timeout_s",
                 "stream_deadline_s"):
        value = getattr(cfg, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ConfigError(f"{source}: field {name!r}: expected a positive number of seconds, "
                              f"got {value!r}")
    if not (isinstance(cfg.margin_s, (int, float)) and 0 <= cfg.margin_s <= cfg.decoder_ttl_s):
        # margin == TTL: the router never offers retained history back (a decode TTL too short
        # for vLLM's readback margin, kvtune.vllm_pd.READBACK_SAFETY_MARGIN_S)
        raise ConfigError(f"{source}: field 'margin_s': expected 0 <= margin_s <= decoder_ttl_s "
                          f"({cfg.decoder_ttl_s}), got {cfg.margin_s!r}")
    if not (isinstance(cfg.max_connections, int) and cfg.max_connections >= 1):
        raise ConfigError(f"{source}: field 'max_connections': expected an integer >= 1, "
                          f"got {cfg.max_connections!r}")
    per_client = cfg.max_connections_per_client
    if per_client is not None and not (isinstance(per_client, int) and per_client >= 1):
        raise ConfigError(f"{source}: field 'max_connections_per_client': expected an integer >= 1 "
                          f"(or nothing: a quarter of max_connections), got {per_client!r}")
    if cfg.max_body_bytes < 1024:
        raise ConfigError(f"{source}: field 'max_body_bytes': expected >= 1024, "
                          f"got {cfg.max_body_bytes!r}")
    if cfg.tenant_header is not None and not (
            isinstance(cfg.tenant_header, str) and cfg.tenant_header.isascii()
            and cfg.tenant_header and all(c.isalnum() or c in "-_" for c in cfg.tenant_header)):
        raise ConfigError(f"{source}: field 'tenant_header': expected an HTTP header name "
                          f"(letters, digits, '-', '_'), got {cfg.tenant_header!r:.80}")
    _validate_lease(cfg, source)
    if not (cfg.state.startswith("sqlite:") or cfg.state.startswith("redis://")
            or cfg.state == ":memory:"):
        raise ConfigError(f"{source}: field 'state': expected 'sqlite:PATH' or 'redis://HOST:PORT/DB', "
                          f"got {redact_url(cfg.state)!r}")


def _validate_lease(cfg: RouterConfig, source: str) -> None:
    if cfg.lease_s is None:
        for name in LEASE_FIELDS[1:]:
            if getattr(cfg, name) is not None:
                raise ConfigError(f"{source}: field {name!r}: applies with 'lease_s' only "
                                  f"(the renewable decode lease is off)")
        return
    for name in LEASE_FIELDS:
        value = getattr(cfg, name)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and value > 0):
            raise ConfigError(f"{source}: field {name!r}: expected a positive number of seconds, "
                              f"got {value!r}")
    # Each renewal must reach the decode while the deadline in force is still more than its
    # renewal guard (vLLM's readback margin) away: the first one runs against decoder_ttl_s.
    limit = min(cfg.lease_s, cfg.decoder_ttl_s) - MIN_ROUTER_MARGIN_S
    assert cfg.lease_renew_every_s is not None
    if cfg.lease_renew_every_s > limit:
        raise ConfigError(f"{source}: field 'lease_renew_every_s': expected at most min(lease_s, "
                          f"decoder_ttl_s) - {MIN_ROUTER_MARGIN_S:g} s = {limit:g} s (a renewal "
                          f"must land well before the deadline it extends), got "
                          f"{cfg.lease_renew_every_s!r}")


def _instance(value: Any, where: str) -> InstanceConfig:
    if isinstance(value, str):
        return InstanceConfig(url=value.rstrip("/"))
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a URL string or a mapping with 'url', got {value!r}")
    unknown = set(value) - _INSTANCE_FIELDS
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; expected some of "
                          f"{sorted(_INSTANCE_FIELDS)}")
    if "url" not in value:
        raise ConfigError(f"{where}: field 'url': expected an http(s) URL, got nothing")
    try:
        return InstanceConfig(
            url=str(value["url"]).rstrip("/"),
            engine_id=None if value.get("engine_id") is None else str(value["engine_id"]),
            kv_host=None if value.get("kv_host") is None else str(value["kv_host"]),
            kv_port=None if value.get("kv_port") is None else int(value["kv_port"]),
            tp_size=int(value.get("tp_size", 1)), pp_size=int(value.get("pp_size", 1)))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: expected integer kv_port/tp_size/pp_size: {exc}") from None


def config_from_dict(data: Mapping[str, Any], *, source: str = "router config") -> RouterConfig:
    """Build a :class:`RouterConfig` from file data; errors name ``source`` and the field."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping at top level, got {type(data).__name__}")
    unknown = set(data) - _FIELDS
    if unknown:
        raise ConfigError(f"{source}: unknown keys {sorted(unknown)}; expected some of {sorted(_FIELDS)}")
    kwargs: dict[str, Any] = {}
    for role in ("prefill", "decode"):
        raw = data.get(role)
        if raw is None:
            raise ConfigError(f"{source}: field {role!r}: expected at least one instance")
        if isinstance(raw, (str, Mapping)):
            raw = [raw]
        if not isinstance(raw, Sequence):
            raise ConfigError(f"{source}: field {role!r}: expected a list of instances")
        kwargs[role] = tuple(_instance(v, f"{source}: field '{role}[{i}]'") for i, v in enumerate(raw))
    if "mode" in data:
        try:
            kwargs["mode"] = Mode(str(data["mode"]))
        except ValueError:
            raise ConfigError(f"{source}: field 'mode': expected one of "
                              f"{[m.value for m in PD_MODES]}, got {data['mode']!r}") from None
    for name in ("host", "state"):
        if name in data:
            kwargs[name] = str(data[name])
    if data.get("tenant_header") is not None:
        kwargs["tenant_header"] = str(data["tenant_header"])
    for name in ("port", "max_body_bytes", "max_connections", "max_connections_per_client"):
        if name in data and not (name == "max_connections_per_client" and data[name] is None):
            try:
                kwargs[name] = int(data[name])
            except (TypeError, ValueError):
                raise ConfigError(f"{source}: field {name!r}: expected an integer, "
                                  f"got {data[name]!r}") from None
    for name in ("decoder_ttl_s", "margin_s", "state_retention_s", "connect_timeout_s",
                 "prefill_timeout_s", "decode_timeout_s", "stream_idle_timeout_s",
                 "header_timeout_s", "stream_deadline_s", *LEASE_FIELDS):
        if name in data and not (name in LEASE_FIELDS and data[name] is None):
            try:
                kwargs[name] = float(data[name])
            except (TypeError, ValueError):
                raise ConfigError(f"{source}: field {name!r}: expected a number of seconds, "
                                  f"got {data[name]!r}") from None
    if "telemetry" in data:
        if not isinstance(data["telemetry"], Mapping):
            raise ConfigError(f"{source}: field 'telemetry': expected a mapping of keyword arguments")
        kwargs["telemetry"] = dict(data["telemetry"])
    try:
        return RouterConfig(**kwargs)
    except ConfigError as exc:  # name the file, not the generic "router config"
        raise ConfigError(str(exc).replace("router config", source, 1)) from None


def load_config(path: str | Path) -> RouterConfig:
    """Read a router config file (``.yaml``/``.yml`` or ``.json``)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read router config: {exc.strerror or exc}") from None
    from kvtune import safe_yaml
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"{p}: not valid JSON: {str(exc)[:500]}") from None
    else:  # aliases bounded, messages truncated (a 380-byte alias bomb fails at once)
        data = safe_yaml.load(text, source=str(p))
    return config_from_dict(data if data is not None else {}, source=str(p))


def write_config(cfg: RouterConfig, path: str | Path) -> Path:
    """Write ``cfg`` as YAML (or JSON when ``path`` ends in ``.json``)."""
    p = Path(path)
    data = cfg.to_dict()
    if p.suffix.lower() == ".json":
        p.write_text(json.dumps(data, indent=2) + "\n")
    else:
        import yaml
        p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p
