"""kvtune's exceptions: one root, each naming the input, the field and what was expected."""
from __future__ import annotations


class KvtuneError(Exception):
    """Root of every error kvtune raises on purpose."""


class TraceFormatError(KvtuneError):
    """A trace record is malformed: names the source (file and line), the field and what was expected."""

    def __init__(self, source: str, field: str, expected: str, *, line: int | None = None,
                 got: object = None) -> None:
        self.source, self.field, self.expected, self.line, self.got = source, field, expected, line, got
        where = f"{source}:{line}" if line is not None else source
        msg = f"{where}: field {field!r}: expected {expected}"
        if got is not None:
            msg += f", got {got!r}"[:300]
        super().__init__(msg)


class TraceSourceError(KvtuneError):
    """A trace source cannot be read (missing file, unreachable Tempo, unknown scheme)."""


class AnalysisError(KvtuneError):
    """The spans cannot support the requested analysis (no transfers, too few sizes, ...)."""


class ProbeError(KvtuneError):
    """The fabric probe failed: which side, which transfer, why."""


class ConnectorError(KvtuneError):
    """Instrumented connectors cannot run as asked (unsupported vLLM with strict mode, ...)."""


class RouterError(KvtuneError):
    """Router configuration or state error."""


class ConfigError(KvtuneError):
    """A parameter or configuration value is invalid: names it and what was expected."""


class SimError(KvtuneError):
    """Simulator configuration error."""
