"""Recorded workloads: the conversations ``kvtune verify`` replays, as a JSON file.

Format (``FORMAT`` = ``kvtune.workload/1``)::

    {"format": "kvtune.workload/1",
     "conversations": [
       {"conversation_id": "c0", "start_s": 0.0,
        "system_tokens": [5, 6, 7],
        "turns": [{"user_tokens": [8, 9], "max_tokens": 16, "think_time_s": 0.0},
                  {"user_tokens": [10], "max_tokens": 8, "think_time_s": 2.5}]}]}

Token ids are non-negative integers; ``turn`` numbers are implied by order (from 1); the first
turn's ``think_time_s`` must be 0. A conversation may say ``"link_turns": false`` (default true):
its turns then reach the router as unrelated requests, so no history is offered back. Turn k's
prompt is the system tokens, every earlier user message and every earlier actual output, then
the new user message (as :mod:`kvtune.local.workload` sends it). Sizes are capped
(:data:`MAX_FILE_BYTES` and friends).
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from kvtune.errors import ConfigError
from kvtune.local.workload import ConversationPlan, TurnPlan

FORMAT: Final = "kvtune.workload/1"
MAX_FILE_BYTES: Final = 64 * 1024 * 1024
MAX_CONVERSATIONS: Final = 100_000
MAX_TURNS: Final = 1000
MAX_TOKENS_PER_MESSAGE: Final = 1_000_000


def to_json(plans: Sequence[ConversationPlan]) -> dict[str, Any]:
    """The plans in the file format."""
    return {"format": FORMAT, "conversations": [
        {"conversation_id": p.conversation_id, "start_s": p.start_s,
         "system_tokens": list(p.system_tokens),
         "turns": [{"user_tokens": list(t.user_tokens), "max_tokens": t.max_tokens,
                    "think_time_s": t.think_time_s} for t in p.turns],
         **({} if p.link_turns else {"link_turns": False})} for p in plans]}


def save(plans: Sequence[ConversationPlan], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(plans)))
    return path


def load(path: str | Path) -> list[ConversationPlan]:
    """Read and validate a workload file; errors name the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"workload file {path}: no such file")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ConfigError(f"workload file {path}: {size} bytes; expected at most {MAX_FILE_BYTES}")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"workload file {path}: expected JSON ({FORMAT}): {exc}") from None
    return from_json(data, source=f"workload file {path}")


def from_json(data: Any, *, source: str = "workload") -> list[ConversationPlan]:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object at top level")
    if data.get("format") != FORMAT:
        raise ConfigError(f"{source}: field 'format': expected {FORMAT!r}, "
                          f"got {data.get('format')!r}")
    convs = data.get("conversations")
    if not isinstance(convs, list) or not convs:
        raise ConfigError(f"{source}: field 'conversations': expected a non-empty list")
    if len(convs) > MAX_CONVERSATIONS:
        raise ConfigError(f"{source}: field 'conversations': {len(convs)} entries; expected at "
                          f"most {MAX_CONVERSATIONS}")
    plans, seen = [], set()
    for i, c in enumerate(convs):
        where = f"{source}: field 'conversations[{i}]"
        if not isinstance(c, dict):
            raise ConfigError(f"{where}': expected an object")
        cid = c.get("conversation_id")
        if not isinstance(cid, str) or not cid or len(cid) > 200:
            raise ConfigError(f"{where}.conversation_id': expected a non-empty string "
                              f"(<= 200 chars), got {cid!r}"[:300])
        if cid in seen:
            raise ConfigError(f"{where}.conversation_id': {cid!r} appears twice; expected unique")
        seen.add(cid)
        start = _number(c.get("start_s", 0.0), f"{where}.start_s'")
        turns_raw = c.get("turns")
        if not isinstance(turns_raw, list) or not turns_raw or len(turns_raw) > MAX_TURNS:
            raise ConfigError(f"{where}.turns': expected a list of 1..{MAX_TURNS} turns")
        turns = []
        for k, t in enumerate(turns_raw, start=1):
            tw = f"{where}.turns[{k - 1}]"
            if not isinstance(t, dict):
                raise ConfigError(f"{tw}': expected an object")
            mt = t.get("max_tokens")
            if not isinstance(mt, int) or isinstance(mt, bool) or not 1 <= mt <= 1_000_000:
                raise ConfigError(f"{tw}.max_tokens': expected an integer >= 1, got {mt!r}")
            think = _number(t.get("think_time_s", 0.0), f"{tw}.think_time_s'")
            if k == 1 and think != 0.0:
                raise ConfigError(f"{tw}.think_time_s': expected 0 for the first turn "
                                  f"(use start_s), got {think}")
            turns.append(TurnPlan(turn=k, user_tokens=_tokens(t.get("user_tokens"),
                                                              f"{tw}.user_tokens'", empty=False),
                                  max_tokens=mt, think_time_s=think))
        link = c.get("link_turns", True)
        if not isinstance(link, bool):
            raise ConfigError(f"{where}.link_turns': expected true or false, got {link!r}"[:300])
        plans.append(ConversationPlan(conversation_id=cid, start_s=start,
                                      system_tokens=_tokens(c.get("system_tokens", []),
                                                            f"{where}.system_tokens'", empty=True),
                                      turns=tuple(turns), link_turns=link))
    return sorted(plans, key=lambda p: p.start_s)


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ConfigError(f"{where}: expected a finite number >= 0, got {v!r}"[:300])
    return float(v)


def _tokens(v: Any, where: str, *, empty: bool) -> tuple[int, ...]:
    if not isinstance(v, list) or (not empty and not v) or len(v) > MAX_TOKENS_PER_MESSAGE:
        raise ConfigError(f"{where}: expected a {'' if empty else 'non-empty '}list of token ids "
                          f"(at most {MAX_TOKENS_PER_MESSAGE})")
    for t in v:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ConfigError(f"{where}: expected non-negative integer token ids, got {t!r}"[:300])
    return tuple(v)
