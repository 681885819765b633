"""Grafana template-variable interpolation, for the syntax the dashboards' queries use.

``$name``, ``${name}`` and ``${name:format}`` with the formats ``regex``, ``pipe``, ``raw``,
``csv`` and ``queryparam``. A variable whose value is its custom "All" value (the dashboards use
``.*``) is inserted unformatted, as Grafana does for custom all-values.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final

from kvtune.errors import ConfigError

VARIABLE_RE: Final = re.compile(r"\$(?:\{(?P<braced>\w+)(?::(?P<fmt>\w+))?\}|(?P<plain>\w+))")
"""Grafana's variable reference forms: ``$var``, ``${var}``, ``${var:fmt}``."""

_REGEX_SPECIALS: Final = re.compile(r"[\\^$*+?.()|\[\]{}/]")
"""Characters Grafana's ``regex`` format escapes (its ``regexEscape``)."""


def variable_names(text: str) -> list[str]:
    """Names of the variables referenced in ``text``, in order of appearance."""
    return [m.group("braced") or m.group("plain") for m in VARIABLE_RE.finditer(text)]


def interpolate(text: str, values: Mapping[str, str | Sequence[str]], *,
                all_values: Mapping[str, str] | None = None) -> str:
    """Replace variable references in ``text`` as Grafana would.

    ``values`` maps a variable name to one value or a list of values (multi-value variables).
    ``all_values`` maps variable names to their custom "All" value; a variable whose value equals
    it is inserted as-is. Raises :class:`ConfigError` naming an undefined variable or unknown format.
    """
    all_values = all_values or {}

    def replace(m: re.Match[str]) -> str:
        name = m.group("braced") or m.group("plain")
        fmt = m.group("fmt") or ""
        if name.startswith("__"):
            return m.group(0)  # Grafana built-ins ($__all, ${__value.raw}, ...) stay for Grafana
        if name not in values:
            raise ConfigError(f"query {text!r}: variable ${name} has no value "
                              f"(expected one of {sorted(values)})")
        value = values[name]
        items = [value] if isinstance(value, str) else list(value)
        if name in all_values and items == [all_values[name]]:
            return items[0]
        return _format(items, fmt, name)

    return VARIABLE_RE.sub(replace, text)


def _format(items: list[str], fmt: str, name: str) -> str:
    if fmt == "regex":
        escaped = [_REGEX_SPECIALS.sub(lambda c: "\\" + c.group(0), v) for v in items]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"
    if fmt == "pipe":
        return "|".join(items)
    if fmt == "csv":
        return ",".join(items)
    if fmt == "queryparam":
        return "&".join(f"var-{name}={v}" for v in items)
    if fmt in ("", "raw"):
        return items[0] if len(items) == 1 else "{" + ",".join(items) + "}"
    raise ConfigError(f"variable ${{{name}:{fmt}}}: unknown format {fmt!r} "
                      "(expected regex, pipe, csv, queryparam or raw)")
