"""The vLLM versions kvtune's connectors support, and every vLLM method they override.

vLLM's NIXL connector internals move between releases. The table of overridden methods is derived
from the overrides themselves: each kvtune connector class is registered with
:func:`instrumented`, each method of it that replaces vLLM's carries :func:`overrides` (naming the
span(s) it feeds), and :func:`wrapped_methods` reads them: vLLM class (the registered class's vLLM
base), method name and the parameters kvtune reads (the override's own named parameters, which it
passes on to vLLM's). :func:`registry_diff` finds overrides without the mark and marks on methods
vLLM does not have; a test keeps both empty.

At start-up :func:`check` looks up each entry in the installed vLLM. On a mismatch it says which
methods are missing, then either the connectors run *uninstrumented* (exactly vLLM's own classes,
with a warning) or, with ``kv_connector_extra_config: {"kvtune_strict": true}``, they refuse with
:class:`~kvtune.errors.ConnectorError`. They are never half-instrumented.

``python -m kvtune.connectors.compat`` (or ``kvtune doctor``) prints the installed vLLM and NIXL
versions and the outcome (exit status 0 when the version is supported and every method was found).
"""
from __future__ import annotations

import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from kvtune import spans
from kvtune.errors import ConnectorError

_logger = logging.getLogger("kvtune.connectors")

VLLM_REQUIREMENT: Final = "vllm>=0.32,<0.34"
"""The ``vllm`` extra of ``pyproject.toml`` (a test keeps them equal): the releases pip may pick."""
SUPPORTED_VLLM_VERSIONS: Final = ("0.32.0", "0.33.0")
"""vLLM releases the in-process connector suite passes on (``make test`` runs it on each)."""
STRICT_KEY: Final = "kvtune_strict"
"""``kv_connector_extra_config`` key: true -> refuse to start on a mismatch."""
NIXL_PKG: Final = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
OVERRIDE_MODULES: Final = ("kvtune.connectors.scheduler", "kvtune.connectors.worker",
                           "kvtune.connectors.connector")
"""Modules whose classes register with :func:`instrumented` (they import vLLM)."""

_S = spans.SpanName
_MARK: Final = "__kvtune_overrides__"
_F = TypeVar("_F", bound=Callable[..., Any])
_C = TypeVar("_C", bound=type)


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


def overrides(*feeds: _S | str) -> Callable[[_F], _F]:
    """Mark a method of a kvtune connector class as replacing vLLM's method of the same name.

    ``feeds``: the span(s) (or a few words on what) the override feeds."""
    if not feeds:
        raise TypeError("overrides(): name at least one span or purpose the override feeds")
    phase = ", ".join(f.value if isinstance(f, _S) else str(f) for f in feeds)

    def mark(fn: _F) -> _F:
        setattr(fn, _MARK, phase)
        return fn
    return mark


_INSTRUMENTED: list[type] = []


def instrumented(cls: _C) -> _C:
    """Register a kvtune subclass of a vLLM NIXL connector class (class decorator)."""
    if vllm_base(cls) is None:
        raise TypeError(f"instrumented: {cls.__qualname__} has no base class from {NIXL_PKG}")
    if cls not in _INSTRUMENTED:
        _INSTRUMENTED.append(cls)
    return cls


def vllm_base(cls: type) -> type | None:
    """The first class of ``cls``'s MRO that comes from vLLM's NIXL package."""
    return next((k for k in cls.__mro__[1:] if k.__module__.startswith(NIXL_PKG + ".")), None)


def _own_functions(cls: type) -> dict[str, Any]:
    """Functions defined by the kvtune classes of ``cls``'s MRO (those before its vLLM base),
    the most derived first."""
    base = vllm_base(cls)
    out: dict[str, Any] = {}
    for klass in cls.__mro__:
        if klass is base:
            break
        for name, value in vars(klass).items():
            if inspect.isfunction(value):
                out.setdefault(name, value)
    return out


def _params(fn: Any) -> tuple[str, ...]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in list(inspect.signature(fn).parameters.values())[1:]
                 if p.kind in kinds)


def table_of(cls: type) -> tuple[WrappedMethod, ...]:
    """The entries of one registered class: its marked methods, against its vLLM base."""
    base = vllm_base(cls)
    if base is None:
        raise TypeError(f"table_of: {cls.__qualname__} has no base class from {NIXL_PKG}")
    module = base.__module__.removeprefix(NIXL_PKG + ".")
    return tuple(WrappedMethod(module, base.__name__, name, _params(fn), getattr(fn, _MARK))
                 for name, fn in sorted(_own_functions(cls).items()) if hasattr(fn, _MARK))


def registered_classes() -> tuple[type, ...]:
    """Every class registered with :func:`instrumented` (imports :data:`OVERRIDE_MODULES`)."""
    for name in OVERRIDE_MODULES:
        importlib.import_module(name)
    return tuple(_INSTRUMENTED)


def wrapped_methods(classes: tuple[type, ...] | None = None) -> tuple[WrappedMethod, ...]:
    """Every vLLM method the instrumented connectors override, and the span(s) it feeds, derived
    from the registrations (imports vLLM)."""
    entries: dict[tuple[str, str, str], WrappedMethod] = {}
    for cls in registered_classes() if classes is None else classes:
        for e in table_of(cls):
            entries.setdefault((e.module, e.cls, e.method), e)
    return tuple(entries.values())


def registry_diff(classes: tuple[type, ...] | None = None
                  ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(overrides missing from the table, table entries that override nothing).

    The first: methods of a registered class that replace one of its vLLM base's without
    :func:`overrides`. The second: marked methods whose vLLM base has no such method."""
    unmarked: list[str] = []
    stray: list[str] = []
    for cls in registered_classes() if classes is None else classes:
        base = vllm_base(cls)
        for name, fn in sorted(_own_functions(cls).items()):
            in_vllm = hasattr(base, name)
            if in_vllm and not hasattr(fn, _MARK):
                unmarked.append(f"{cls.__name__}.{name} (replaces {base.__name__}.{name})")
            elif hasattr(fn, _MARK) and not in_vllm:
                stray.append(f"{cls.__name__}.{name} ({base.__name__} has no {name})")
    return tuple(unmarked), tuple(stray)


NIXL_AGENT_METHODS: Final = ("make_prepped_xfer", "transfer", "check_xfer_state",
                             "get_xfer_telemetry", "release_xfer_handle")
"""NIXL agent methods (``nixl._api.nixl_agent``) observed through
:class:`~kvtune.connectors.nixl_agent.ObservedNixlAgent`."""

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


def find_missing(table: tuple[WrappedMethod, ...] | None = None, package: str = NIXL_PKG
                 ) -> tuple[str, ...]:
    """Entries of ``table`` (default: :func:`wrapped_methods`) absent from the installed vLLM
    (module, class, method or parameter), and the metadata fields and NIXL methods kvtune uses."""
    missing: list[str] = []
    if table is None:
        try:
            table = wrapped_methods()
        except ImportError as exc:  # the installed vLLM lacks a class or module kvtune subclasses
            missing.append(f"kvtune.connectors (cannot import against this vLLM: {exc})")
            table = ()
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
    except Exception:  # any failure here is a mismatch
        missing.append("metadata.NixlConnectorMetadata")
    try:
        from nixl._api import nixl_agent
        missing.extend(f"nixl_agent.{m}" for m in NIXL_AGENT_METHODS if not hasattr(nixl_agent, m))
    except ImportError:
        missing.append("nixl._api.nixl_agent (NIXL not importable)")
    return tuple(missing)


def installed_vllm_version() -> str:
    """``vllm.__version__`` of the vLLM this interpreter imports (or ``not installed``)."""
    try:
        import vllm
        return str(getattr(vllm, "__version__", "unknown"))
    except ImportError:
        return "not installed"


def installed_nixl_version() -> str:
    """The version of the NIXL distribution installed (metadata; or ``not installed``)."""
    from importlib import metadata
    for name in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def _version_supported(version: str) -> bool:
    core = version.split("+")[0]
    return core in SUPPORTED_VLLM_VERSIONS


_CACHED: dict[str, CompatReport] = {}


def check(*, strict: bool = False, version: str | None = None,
          table: tuple[WrappedMethod, ...] | None = None, package: str = NIXL_PKG
          ) -> CompatReport:
    """Check the installed vLLM against ``table`` (default: :func:`wrapped_methods`, derived from
    the overrides); log the outcome.

    Returns the report; the caller instruments only when ``report.instrumentable``. With
    ``strict`` a mismatch (missing methods or an unsupported version) raises
    :class:`ConnectorError` naming what is missing.
    """
    key = f"{version}|{id(table) if table is not None else 'derived'}|{package}"
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


def register(sub: Any) -> None:
    """``kvtune doctor``: the same as ``python -m kvtune.connectors.compat``."""
    p = sub.add_parser("doctor", help="is the installed vLLM one kvtune's connectors support?")
    p.set_defaults(func=lambda args: main([]))


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtune.connectors.compat`` / ``kvtune doctor``: is the installed vLLM one
    kvtune supports? Prints the versions and the outcome; 0 when supported and instrumentable."""
    del argv
    logging.basicConfig(level=logging.ERROR)
    report = check()
    print(f"vLLM {report.vllm_version} (kvtune supports {', '.join(SUPPORTED_VLLM_VERSIONS)}; "
          f"pyproject allows {VLLM_REQUIREMENT}), NIXL {installed_nixl_version()}")
    if report.missing:
        print(f"NOT instrumentable: {len(report.missing)} method(s) kvtune overrides are missing: "
              + ", ".join(report.missing))
        print("kvtune's connectors would run uninstrumented (vLLM's own behaviour, no spans).")
    else:
        print(f"all {len(wrapped_methods())} overridden vLLM methods found")
    if not report.version_supported:
        print("this vLLM version is untested with kvtune's connectors")
    ok = report.instrumentable and report.version_supported
    print("OK" if ok else "NOT SUPPORTED")
    return 0 if ok else 1


if __name__ == "__main__":
    # Run as a script this file is a second module, __main__: the override modules register with
    # the importable kvtune.connectors.compat, so ask that one.
    from kvtune.connectors import compat as _compat
    sys.exit(_compat.main())
