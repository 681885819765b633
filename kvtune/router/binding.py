"""Binding a conversation's held KV to the history it encodes (issue 29).

In bidirectional mode the decode keeps a turn's KV (prompt + answer) and the router offers those
blocks to the conversation's next prefill. The conversation id alone says nothing about what the
blocks hold: another client naming the same id, or an agent that edits or trims its history
(reasoning stripped, vLLM issue #43094), would have vLLM compute on KV for tokens it was not sent.
So the router stores with the params a :class:`History`: a SHA-256 digest of the history the KV
encodes, in one of three kinds, and offers the blocks only to a request whose prompt begins with
exactly that history (:func:`offer`):

- ``tokens``: a token-id prompt plus the answer's token ids (``choices[0].token_ids``, which vLLM
  returns with ``return_token_ids: true``); a token-id prompt without them cannot be bound;
- ``text``: a text prompt plus the answer's text (the next prompt must start with both, exactly);
- ``messages``: the chat messages plus the assistant's message as answered (content, and the
  reasoning when the answer had one: a history with the reasoning stripped does not match).
  Messages compare as canonical JSON with empty values (None, "", [], {}) left out.

A turn whose history cannot be bound (several choices, ``echo``, streamed tool calls, an answer
too long to hold) keeps no params for the next turn. A turn refused the stored params because its
prompt does not begin with their history leaves them stored and stores none of its own
(:class:`Claim`): an interloper's turn cannot deny the owner's next turn its blocks. The price:
a conversation whose own history was edited gets no reuse until the held params expire.

With a tenant key (:func:`store_key`) the store is keyed by tenant and conversation id together,
so one tenant cannot name another's conversation.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvtune import spans, vllm_pd

MAX_REPLY_CHARS = 16 * 1024 * 1024
"""Longest answer (characters of text, or token ids) held to bind a turn; a longer one is not
bound (the router's request bodies are 8 MiB at most, answers are bounded by ``max_tokens``)."""
_TENANT_DOMAIN = b"kvtune-tenant\0"


class HistoryKind(str, Enum):
    TOKENS = "tokens"
    TEXT = "text"
    MESSAGES = "messages"


@dataclass(frozen=True)
class History:
    """What a decode's held KV encodes: its kind, its length (tokens, characters or messages)
    and the SHA-256 of its canonical form."""

    kind: HistoryKind
    length: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "length": self.length, "sha256": self.sha256}

    @classmethod
    def from_json(cls, value: Any) -> History | None:
        """The history a stored value names, or None when it is not one."""
        if not isinstance(value, Mapping):
            return None
        kind, length, digest = value.get("kind"), value.get("length"), value.get("sha256")
        if kind not in {k.value for k in HistoryKind} or not isinstance(digest, str) \
                or not isinstance(length, int) or isinstance(length, bool) or length < 0:
            return None
        return cls(HistoryKind(kind), length, digest)


@dataclass(frozen=True)
class Offer:
    """What the prefill of this turn may be offered: ``params`` (the router's own keys removed),
    or None with ``refusal`` saying why not."""

    params: dict[str, Any] | None
    refusal: spans.ReuseRefusal | None = None
    detail: str = ""


@dataclass
class Reply:
    """The decode's answer as far as binding needs it: choice 0's text (or message), its token
    ids, and whether anything makes it unbindable. Fed whole answers (:meth:`from_answer`) or SSE
    events one by one (:meth:`feed_event`)."""

    text: list[str] = field(default_factory=list)
    reasoning: dict[str, list[str]] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    message: dict[str, Any] | None = None
    chars: int = 0
    problem: str | None = None
    """Why this answer cannot be bound (None: it can)."""
    token_ids_seen: bool = False

    @classmethod
    def from_answer(cls, answer: Mapping[str, Any]) -> Reply:
        reply = cls()
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            reply.problem = "the answer does not have exactly one choice"
            return reply
        choice = choices[0]
        message = choice.get("message")
        if isinstance(message, dict):
            reply.message = dict(message)
        elif isinstance(choice.get("text"), str):
            reply._add_text(choice["text"])
        reply._add_ids(choice.get("token_ids"))
        return reply

    def feed_event(self, event: Mapping[str, Any]) -> None:
        """One SSE event's choices (deltas of chat, text pieces of completions)."""
        if self.problem is not None:
            return
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self.problem = "the answer has several choices"
                return
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if delta.get("tool_calls"):
                    self.problem = "the streamed answer calls tools"
                    return
                if isinstance(delta.get("content"), str):
                    self._add_text(delta["content"])
                for key in ("reasoning_content", "reasoning"):
                    if isinstance(delta.get(key), str) and delta[key]:
                        self.reasoning.setdefault(key, []).append(delta[key])
                        self.chars += len(delta[key])
            elif isinstance(choice.get("text"), str):
                self._add_text(choice["text"])
            self._add_ids(choice.get("token_ids"))
        if self.chars > MAX_REPLY_CHARS:
            self.problem = f"the answer is longer than {MAX_REPLY_CHARS} characters"

    def _add_text(self, piece: str) -> None:
        self.text.append(piece)
        self.chars += len(piece)

    def _add_ids(self, ids: Any) -> None:
        if isinstance(ids, list) and all(_is_token(t) for t in ids):
            self.token_ids.extend(ids)
            self.token_ids_seen = True
        elif ids is not None:
            self.problem = "the answer's token_ids are not a list of token ids"

    def assistant_message(self) -> dict[str, Any]:
        """The assistant's message as a client sends it back (chat)."""
        if self.message is not None:
            return self.message
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        for key, pieces in self.reasoning.items():
            msg[key] = "".join(pieces)
        return msg


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _prompt_kind(body: Mapping[str, Any], chat: bool) -> tuple[HistoryKind, Any] | None:
    """(kind, prompt) of a request whose history can be bound, else None."""
    if chat:
        messages = body.get("messages")
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            return HistoryKind.MESSAGES, messages
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return HistoryKind.TEXT, prompt
    if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        return HistoryKind.TOKENS, prompt
    return None


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, dict)) and not value)


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items() if not _empty(v)}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def _digest(kind: HistoryKind, units: Sequence[Any]) -> str:
    h = hashlib.sha256(kind.value.encode() + b"\0")
    if kind == HistoryKind.TEXT:
        h.update("".join(units).encode("utf-8", "surrogatepass"))
    elif kind == HistoryKind.TOKENS:
        h.update(b",".join(b"%d" % t for t in units))
    else:
        for message in units:
            h.update(json.dumps(_canonical(message), sort_keys=True, ensure_ascii=True).encode())
            h.update(b"\n")
    return h.hexdigest()


def history_of(body: Mapping[str, Any], chat: bool, reply: Reply) -> tuple[History | None, str]:
    """The history a turn's KV encodes (its request ``body`` and the decode's ``reply``), or
    (None, why it cannot be bound)."""
    if reply.problem is not None:
        return None, reply.problem
    if isinstance(body.get("n"), int) and body["n"] > 1 or \
            isinstance(body.get("best_of"), int) and body["best_of"] > 1:
        return None, "the request asks for several choices"
    if body.get("echo"):
        return None, "the request asks for its prompt echoed"
    found = _prompt_kind(body, chat)
    if found is None:
        return None, ("the request's prompt is neither text, token ids nor a list of messages "
                      "(a batch of prompts, or empty)")
    kind, prompt = found
    if kind == HistoryKind.TOKENS:
        if not reply.token_ids_seen:
            return None, ("the answer carries no token ids (ask for return_token_ids: true to "
                          "reuse the history of token-id prompts)")
        units: list[Any] = [*prompt, *reply.token_ids]
    elif kind == HistoryKind.TEXT:
        units = [prompt, "".join(reply.text)]
        return History(kind, len(prompt) + sum(len(t) for t in reply.text),
                       _digest(kind, units)), ""
    else:
        units = [*prompt, reply.assistant_message()]
    return History(kind, len(units), _digest(kind, units)), ""


def begins_with(body: Mapping[str, Any], chat: bool, history: History) -> bool:
    """Whether the request's prompt begins with exactly ``history``."""
    found = _prompt_kind(body, chat)
    if found is None or found[0] != history.kind:
        return False
    kind, prompt = found
    if len(prompt) < history.length:
        return False
    head = [prompt[:history.length]] if kind == HistoryKind.TEXT else prompt[:history.length]
    return _digest(kind, head) == history.sha256


def bind(params: Mapping[str, Any], history: History) -> dict[str, Any]:
    """``params`` to store, with ``history`` under :data:`kvtune.vllm_pd.KV_PARAMS_HISTORY`."""
    return {**params, vllm_pd.KV_PARAMS_HISTORY: history.to_json()}


def offer(stored: Mapping[str, Any], body: Mapping[str, Any], chat: bool) -> Offer:
    """What a turn may be offered of its conversation's ``stored`` params: all of them (the
    router's keys removed) when its prompt begins with the history they are bound to, else
    nothing and why."""
    history = History.from_json(stored.get(vllm_pd.KV_PARAMS_HISTORY))
    if history is None:
        return Offer(None, spans.ReuseRefusal.UNBOUND, "the stored params carry no history digest")
    if not begins_with(body, chat, history):
        return Offer(None, spans.ReuseRefusal.HISTORY_DIFFERS,
                     f"the prompt does not begin with the {history.length} "
                     f"{'characters' if history.kind == HistoryKind.TEXT else history.kind.value} "
                     f"the held KV encodes")
    return Offer({k: v for k, v in stored.items() if k not in vllm_pd.ROUTER_ONLY_KEYS})


class Claim:
    """A turn's ``accept`` for :meth:`kvtune.router.state.ConversationStore.begin_turn`: decides
    on the stored params with :func:`offer` and keeps the answer (``offer``, and ``tokens``: the
    history tokens the stored params hold). Params bound to another history are left stored
    (False): a turn that does not continue the held history (another client naming the id, or an
    edited history) is served without reuse and cannot make the rightful owner's next turn
    recompute. Params it cannot judge (``UNBOUND``) are taken and dropped, so the turn may store
    its own."""

    def __init__(self, body: Mapping[str, Any], chat: bool) -> None:
        self._body, self._chat = body, chat
        self.offer: Offer | None = None
        self.tokens: int | None = None

    def __call__(self, stored: Mapping[str, Any]) -> bool:
        self.offer = offer(stored, self._body, self._chat)
        self.tokens = vllm_pd.offered_tokens(stored)
        return self.offer.refusal != spans.ReuseRefusal.HISTORY_DIFFERS


def store_key(conversation_id: str, tenant: str | None) -> str:
    """The conversation store's key: the conversation id, or (with a tenant key) a digest of the
    tenant and the id together, so equal ids of two tenants are two conversations."""
    if tenant is None:
        return conversation_id
    h = hashlib.sha256(_TENANT_DOMAIN)
    for part in (tenant, conversation_id):
        raw = part.encode("utf-8", "surrogatepass")
        h.update(b"%d:" % len(raw) + raw)
    return f"tenant-{h.hexdigest()}"
