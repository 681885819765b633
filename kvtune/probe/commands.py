"""The side channel's messages from an initiator, checked before the target acts on them.

Every field is checked with Python integers (no int64 wrap-around: ``2**63`` is refused, not turned
negative), every list and string is bounded, and every problem is a :class:`~kvtune.errors.ProbeError`
naming the command, the field and what was expected; the target replies with it and keeps serving.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtune.errors import ProbeError

COMMANDS = ("ping", "bye", "fill", "digest", "stats")
"""Commands a target answers once the session's hello is done."""
MAX_RANGES = 1 << 20
"""Most ``(offset, length)`` pairs in one fill/digest (a 1 MiB frame holds fewer anyway)."""
MAX_SEED_ABS = 1 << 64
"""Fill seeds are integers with ``|seed| < 2**64`` (the pattern mixes them modulo 2**64)."""
MAX_EXPECT = 1 << 32
"""Most notifications a ``stats`` command may wait for."""
MAX_STATS_WAIT_S = 120.0
"""Longest a ``stats`` command may ask the target to wait for notifications (the initiator asks
10 s); a longer wait would hold the one-at-a-time target."""
MAX_NAME_CHARS = 256
"""Longest fabric name a hello may carry (it becomes a span attribute)."""


@dataclass(frozen=True)
class Hello:
    """A checked hello: the buffer size asked for and the fabric name to record."""

    nbytes: int
    fabric: str


@dataclass(frozen=True)
class Command:
    """A checked command; ``ranges`` is an ``(n, 2)`` int64 array inside the buffer."""

    kind: str
    seed: int = 0
    ranges: np.ndarray | None = None
    expect: int = 0
    timeout_s: float = 0.0


def _int(msg: dict, name: str, default: int | None, lo: int, hi: int, what: str) -> int:
    value = msg.get(name, default)
    if type(value) is not int or not lo <= value <= hi:  # bool is not an int here
        raise ProbeError(f"{what}: field {name!r}: expected an integer in {lo}..{hi}, "
                         f"got {_show(value)}")
    return value


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_hello(msg: dict, version: int, max_bytes: int) -> Hello:
    """The hello's fields, or ``ProbeError`` naming what was expected."""
    if msg.get("type") != "hello":
        raise ProbeError(f"expected a 'hello' first, got {_show(msg.get('type'))}")
    got = msg.get("version")
    if type(got) is not int or got != version:
        raise ProbeError(f"hello: field 'version': expected {version}, got {_show(got)}")
    nbytes = msg.get("nbytes")
    if type(nbytes) is not int or not 0 < nbytes <= max_bytes:
        raise ProbeError(f"hello: buffer of {_show(nbytes)} bytes asked; this target allows "
                         f"1..{max_bytes} (serve --max-mem-mb)")
    fabric = msg.get("fabric") or ""
    if not isinstance(fabric, str) or len(fabric) > MAX_NAME_CHARS:
        raise ProbeError(f"hello: field 'fabric': expected a string of at most {MAX_NAME_CHARS} "
                         f"characters, got {_show(fabric)}")
    return Hello(nbytes, fabric)


def parse_ranges(raw: object, nbytes: int, what: str) -> np.ndarray:
    """``[[offset, length], ...]`` inside an ``nbytes`` buffer, touching at most ``nbytes`` bytes
    in all (so one command costs at most one pass over the buffer), as an ``(n, 2)`` int64 array."""
    if raw is None:
        raw = []
    if not isinstance(raw, list) or len(raw) > MAX_RANGES:
        raise ProbeError(f"{what}: field 'ranges': expected a list of at most {MAX_RANGES} "
                         f"[offset, length] pairs, got {_show(raw)}")
    total = 0
    for i, pair in enumerate(raw):
        if (not isinstance(pair, list) or len(pair) != 2
                or type(pair[0]) is not int or type(pair[1]) is not int):
            raise ProbeError(f"{what}: field 'ranges[{i}]': expected [offset, length] integers, "
                             f"got {_show(pair)}")
        off, length = pair
        if off < 0 or length < 0 or off + length > nbytes:
            raise ProbeError(f"{what}: field 'ranges[{i}]': expected (offset, length) inside the "
                             f"{nbytes}-byte buffer, got {_show(pair)}")
        total += length
        if total > nbytes:
            raise ProbeError(f"{what}: field 'ranges': expected at most {nbytes} bytes in all "
                             f"(the buffer's size), got more by range {i}")
    return np.array(raw, dtype=np.int64).reshape(-1, 2)


def parse_command(msg: dict, nbytes: int) -> Command:
    """A command's checked fields, or ``ProbeError`` naming the command, field and expectation."""
    kind = msg.get("type")
    if kind not in COMMANDS:
        raise ProbeError(f"unknown command {_show(kind)}; expected one of {', '.join(COMMANDS)}")
    if kind in ("ping", "bye"):
        return Command(kind)
    if kind in ("fill", "digest"):
        ranges = parse_ranges(msg.get("ranges"), nbytes, kind)
        seed = (_int(msg, "seed", 0, -MAX_SEED_ABS + 1, MAX_SEED_ABS - 1, kind)
                if kind == "fill" else 0)
        return Command(kind, seed=seed, ranges=ranges)
    expect = _int(msg, "expect", 0, 0, MAX_EXPECT, kind)
    timeout = msg.get("timeout_s", 5.0)
    # compared as Python numbers: NaN, infinities and huge integers all fall outside the range
    if type(timeout) not in (int, float) or not 0 <= timeout <= MAX_STATS_WAIT_S:
        raise ProbeError(f"stats: field 'timeout_s': expected seconds in 0..{MAX_STATS_WAIT_S:g}, "
                         f"got {_show(timeout)}")
    return Command(kind, expect=expect, timeout_s=float(timeout))
