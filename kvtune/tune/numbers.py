"""Numbers as the report shows them: rounded to what they can support, never more than 4 digits.

Every number a person reads in ``report.html`` goes through :func:`fmt_num` (or :func:`fmt_value`
for a recommended value next to its range), so the page never shows ``0.22157840746361993``.
"""
from __future__ import annotations

import math
import re
from typing import Any

MAX_SIG_DIGITS = 4
"""No number on the report shows more significant digits than this (the issue's rule: a fit from a
few hundred noisy transfers does not support more)."""
DEFAULT_SIG_DIGITS = 3
"""Significant digits of a measured quantity without an interval (fit R^2, floors, shares)."""
_SUFFIXES = ((1e12, 1e12, "T"), (1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k"))
"""Large magnitudes get a suffix (``131.1k``) rather than digits no one can read or trust; from 1e4
on, so 4-digit counts (ports, token counts) stay plain."""


def fmt_num(x: Any, sig: int = DEFAULT_SIG_DIGITS) -> str:
    """``x`` with at most ``sig`` (<= :data:`MAX_SIG_DIGITS`) significant digits.

    Integers below 10^4 print as they are; larger magnitudes get a k/M/G/T suffix; very small
    ones an exponent. Non-numbers print with ``str``; None, NaN and inf print as words."""
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if not isinstance(x, (int, float)):
        try:
            x = float(x)  # numpy scalars
        except (TypeError, ValueError):
            return str(x)
    sig = max(1, min(int(sig), MAX_SIG_DIGITS))
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "∞" if x > 0 else "-∞"
    ax = abs(x)
    if ax >= 1e15:
        return f"{x:.{sig - 1}e}".replace("e+", "e")
    for above, scale, suffix in _SUFFIXES:
        if ax >= above:
            return _trim(_round_sig(x / scale, sig)) + suffix
    if float(x) == int(x) and ax < 1e4:
        return _trim(_round_sig(int(x), sig)) if len(str(int(ax))) > sig else str(int(x))
    if ax < 1e-3:
        return f"{x:.{sig - 1}e}".replace("e-0", "e-")
    return _trim(_round_sig(x, sig))


NUMBER_IN_TEXT = re.compile(r"(?<![A-Za-z0-9_.])(?<![A-Za-z0-9]-)\d+(?:\.\d+)?(?![A-Za-z0-9_])")
"""A number standing alone in free text: not part of an identifier (``conv-12345``, hex ids)."""


def readable_text(text: str) -> str:
    """``text`` (a finding's message, an evidence string) with every number of more than
    :data:`MAX_SIG_DIGITS` significant digits rounded to that many (``183456 ms`` ->
    ``183.5k ms``); the rest of the text as it is. The exact values stay in recommendation.json."""
    def sub(m: re.Match[str]) -> str:
        tok = m.group(0)
        return fmt_num(float(tok), MAX_SIG_DIGITS) if significant_digits(tok) > MAX_SIG_DIGITS \
            else tok
    return NUMBER_IN_TEXT.sub(sub, text)


def fmt_value(value: Any, lo: Any, hi: Any) -> tuple[str, str, str]:
    """A recommended value and its range, each rounded to the range's resolution.

    The step is a tenth of the range's order of magnitude (range 410..690 -> step 10), so the
    digits shown are the ones the interval supports; never more than :data:`MAX_SIG_DIGITS`."""
    nums = [v for v in (value, lo, hi) if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(nums) < 3 or not all(math.isfinite(float(v)) for v in nums):
        return tuple(fmt_num(v, MAX_SIG_DIGITS) if isinstance(v, (int, float)) else str(v)
                     for v in (value, lo, hi))  # type: ignore[return-value]
    width = abs(float(hi) - float(lo))
    if width <= 0:
        return fmt_num(value, MAX_SIG_DIGITS), fmt_num(lo, MAX_SIG_DIGITS), fmt_num(hi, MAX_SIG_DIGITS)
    step = 10.0 ** (math.floor(math.log10(width)) - 1)
    out = []
    for v in (value, lo, hi):
        r = round(float(v) / step) * step
        sig = _sig_digits_needed(r, step)
        out.append(fmt_num(int(r) if step >= 1 else r, min(sig, MAX_SIG_DIGITS)))
    return out[0], out[1], out[2]


def fmt_share(x: Any) -> str:
    """A share in [0, 1] as a whole percentage (``0.853`` -> ``85%``)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{float(x):.0%}"


def _sig_digits_needed(x: float, step: float) -> int:
    if x == 0:
        return 1
    return max(1, math.floor(math.log10(abs(x))) - math.floor(math.log10(step)) + 1)


def _round_sig(x: float, sig: int) -> float:
    if x == 0:
        return 0.0
    digits = sig - 1 - math.floor(math.log10(abs(x)))
    out = round(x, digits)
    if abs(out) >= 10 ** (math.floor(math.log10(abs(x))) + 1) and digits > 0:
        out = round(x, digits - 1)  # 9.9996 -> 10.0, keep the digit count
    return out


def _trim(x: float) -> str:
    """Shortest text of an already-rounded number (``12.50`` -> ``12.5``, ``3.0`` -> ``3``)."""
    if float(x) == int(x):
        return str(int(x))
    text = f"{x:.6f}".rstrip("0").rstrip(".")
    return text


def significant_digits(token: str) -> int:
    """Significant digits of a number as written (``0.2216`` -> 4, ``12300`` -> 3, ``1,250`` -> 3).

    Trailing zeros of a whole number are not counted (they may be placeholders)."""
    t = token.replace(",", "").lstrip("+-")
    if "." in t:
        whole, frac = t.split(".", 1)
        digits = (whole + frac).lstrip("0")
        return len(digits) if digits else 1
    digits = t.lstrip("0").rstrip("0")
    return len(digits) if digits else 1
