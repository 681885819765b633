"""A multi-turn, agent-like workload: generate it (deterministically), then drive it at a target.

Each conversation starts at a Poisson arrival time with a shared system prompt (so the prefix
cache has something to share), then runs a few turns. Turn k's prompt is the whole history: the
system prompt, every earlier user message and every earlier *actual* model output, then the new user
message — the history must be what the model really produced, or KV retained on a decode instance
(bidirectional mode) would not match the prompt. Between a response and the next turn the
"user" thinks for a while (the inter-turn gap that ``decoder_kv_blocks_ttl`` has to cover).

Targets: ``HttpTarget`` (an OpenAI ``/v1/completions`` URL: kvtune's router or one vLLM server)
and ``PairTarget`` (a ``LocalPair``, doing the P/D flow itself). The driver runs one thread per
conversation, shows a tqdm bar on stderr, and returns one frozen result per request.
"""
from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from tqdm import tqdm

from kvtune.errors import ConfigError
from kvtune.local import client
from kvtune.local.errors import LocalPairError
from kvtune.local.server import SERVED_MODEL_NAME
from kvtune.local.tiny_model import FIRST_PLAIN_TOKEN_ID, VOCAB_SIZE
from kvtune.spans import CONVERSATION_HEADER

if TYPE_CHECKING:
    from kvtune.local.pair import LocalPair

REQUEST_TIMEOUT_S: Final = 300.0


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the workload; ranges are inclusive ``(lo, hi)``, drawn uniformly."""

    n_conversations: int = 6
    turns: tuple[int, int] = (2, 4)
    system_prompt_tokens: int = 64
    first_user_tokens: tuple[int, int] = (64, 256)
    follow_up_tokens: tuple[int, int] = (16, 96)
    output_tokens: tuple[int, int] = (8, 32)
    think_time_s: tuple[float, float] = (0.5, 3.0)
    """Gap between a response and the conversation's next request, seconds."""
    arrival_rate_per_s: float = 1.0
    """Conversation starts per second (Poisson process)."""
    vocab_size: int = VOCAB_SIZE
    seed: int = 0

    def validate(self) -> None:
        def rng_ok(name: str, lo: float, hi: float, minimum: float) -> None:
            if not (minimum <= lo <= hi):
                raise ConfigError(f"WorkloadConfig.{name}: expected {minimum} <= lo <= hi, "
                                  f"got ({lo}, {hi})")
        if self.n_conversations < 1:
            raise ConfigError(f"WorkloadConfig.n_conversations: expected >= 1, "
                              f"got {self.n_conversations}")
        rng_ok("turns", *self.turns, 1)
        rng_ok("first_user_tokens", *self.first_user_tokens, 1)
        rng_ok("follow_up_tokens", *self.follow_up_tokens, 1)
        rng_ok("output_tokens", *self.output_tokens, 1)
        rng_ok("think_time_s", *self.think_time_s, 0.0)
        if self.system_prompt_tokens < 0:
            raise ConfigError(f"WorkloadConfig.system_prompt_tokens: expected >= 0, "
                              f"got {self.system_prompt_tokens}")
        if not self.arrival_rate_per_s > 0:
            raise ConfigError(f"WorkloadConfig.arrival_rate_per_s: expected > 0, "
                              f"got {self.arrival_rate_per_s}")
        if self.vocab_size <= FIRST_PLAIN_TOKEN_ID:
            raise ConfigError(f"WorkloadConfig.vocab_size: expected > {FIRST_PLAIN_TOKEN_ID}, "
                              f"got {self.vocab_size}")


@dataclass(frozen=True)
class TurnPlan:
    turn: int
    """From 1."""
    user_tokens: tuple[int, ...]
    """The new user message of this turn (token ids)."""
    max_tokens: int
    think_time_s: float
    """Wait after the previous turn's response before sending this one (0 for turn 1)."""


@dataclass(frozen=True)
class ConversationPlan:
    conversation_id: str
    start_s: float
    """Offset of the first request from the start of the run, seconds."""
    system_tokens: tuple[int, ...]
    turns: tuple[TurnPlan, ...]
    link_turns: bool = True
    """Send every turn under ``conversation_id`` (the router links them: in bidirectional mode
    it offers the history back). False: each turn goes under an id of its own
    (``<conversation_id>.t<turn>``), so nothing links them and the history is recomputed."""
    batch: int = 0
    """Driven turn by turn (``run_workload(turn_major=True)``): the batches run one after the
    other, each turn by turn."""

    def router_conversation_id(self, turn: int) -> str:
        """The conversation id turn ``turn`` is sent under."""
        return self.conversation_id if self.link_turns else f"{self.conversation_id}.t{turn}"


def generate(config: WorkloadConfig = WorkloadConfig()) -> list[ConversationPlan]:
    """The conversations of ``config``; the same config gives the same plans."""
    config.validate()
    rng = random.Random(config.seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_PLAIN_TOKEN_ID, config.vocab_size) for _ in range(n))

    system = tokens(config.system_prompt_tokens)
    plans = []
    t = 0.0
    for i in range(config.n_conversations):
        if i > 0:
            t += rng.expovariate(config.arrival_rate_per_s)
        n_turns = rng.randint(*config.turns)
        turns = []
        for k in range(1, n_turns + 1):
            n_user = rng.randint(*(config.first_user_tokens if k == 1
                                   else config.follow_up_tokens))
            turns.append(TurnPlan(
                turn=k, user_tokens=tokens(n_user), max_tokens=rng.randint(*config.output_tokens),
                think_time_s=0.0 if k == 1 else rng.uniform(*config.think_time_s)))
        plans.append(ConversationPlan(conversation_id=f"conv-{config.seed}-{i:04d}",
                                      start_s=round(t, 6), system_tokens=system,
                                      turns=tuple(turns)))
    return plans


@dataclass(frozen=True)
class RequestResult:
    """One request of the workload as the client saw it; times relative to the run's start."""

    conversation_id: str
    turn: int
    request_id: str
    prompt_tokens: int
    output_tokens: int
    sent_s: float
    latency_ms: float
    ttft_ms: float | None
    ok: bool
    error: str = ""
    output_token_ids: tuple[int, ...] = ()


class Target(Protocol):
    """Something that completes a prompt; raises on failure."""

    def send(self, prompt: Sequence[int], max_tokens: int, *, request_id: str,
             conversation_id: str, turn: int) -> tuple[tuple[int, ...], float | None]:
        """Returns (output token ids, ttft_ms or None)."""
        ...


class HttpTarget:
    """An OpenAI-compatible ``/v1/completions`` endpoint (kvtune's router, or one vLLM server).

    The conversation id goes in the ``spans.CONVERSATION_HEADER`` header, the request id in
    ``X-Request-Id``. Streams by default, to time the first token.
    """

    def __init__(self, url: str, *, model: str = SERVED_MODEL_NAME, stream: bool = True,
                 headers: Mapping[str, str] | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.model, self.stream, self.timeout_s = model, stream, timeout_s
        self.headers = dict(headers or {})

    def send(self, prompt: Sequence[int], max_tokens: int, *, request_id: str,
             conversation_id: str, turn: int) -> tuple[tuple[int, ...], float | None]:
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens,
                "temperature": 0.0, "seed": 0, "ignore_eos": True, "return_token_ids": True,
                "stream": self.stream}
        headers = {**self.headers, "X-Request-Id": request_id,
                   CONVERSATION_HEADER: conversation_id}
        resp = client.complete(self.url, body, headers=headers, timeout_s=self.timeout_s)
        return resp.token_ids, resp.first_token_ms


class PairTarget:
    """A ``LocalPair``: the P/D flow of its mode (conversations link turns in bidirectional)."""

    def __init__(self, pair: LocalPair) -> None:
        self.pair = pair

    def send(self, prompt: Sequence[int], max_tokens: int, *, request_id: str,
             conversation_id: str, turn: int) -> tuple[tuple[int, ...], float | None]:
        conv = conversation_id if self.pair.mode == "bidirectional" else None
        r = self.pair.complete(prompt, max_tokens, request_id=request_id, conversation=conv)
        return r.token_ids, r.ttft_ms


def run_workload(plans: Sequence[ConversationPlan], target: Target, *,
                 time_scale: float = 1.0, max_concurrency: int | None = None,
                 progress: bool = True, turn_major: bool = False,
                 on_result: Callable[[RequestResult], None] | None = None) -> list[RequestResult]:
    """Send every turn of every conversation to ``target``, keeping arrival times and gaps.

    ``time_scale`` multiplies all waits (0 sends as fast as possible). A failed request ends its
    conversation (later turns need its output) and is recorded with ``ok=False``. Results are in
    the order the requests were sent.

    ``turn_major``: one request at a time, every conversation's turn k (in the plans' order)
    before any turn k+1, batch after batch (:attr:`ConversationPlan.batch`); arrival times and
    think times are not waited for (the other conversations' turns are the gap: the lab's fleet
    regime, :mod:`kvtune.local.regime`).
    """
    if time_scale < 0:
        raise ConfigError(f"run_workload: time_scale expected >= 0, got {time_scale}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ConfigError(f"run_workload: max_concurrency expected >= 1, got {max_concurrency}")
    results: list[RequestResult] = []
    lock = threading.Lock()
    total = sum(len(p.turns) for p in plans)
    bar = tqdm(total=total, desc="workload", unit="req", disable=not progress, leave=False)
    t0 = time.monotonic()

    def record(r: RequestResult) -> None:
        with lock:
            results.append(r)
            bar.update(1)
        if on_result is not None:
            on_result(r)

    def send(plan: ConversationPlan, tp: TurnPlan, history: list[int]) -> list[int] | None:
        """One turn; the conversation's history after it (None: it failed, and so ends)."""
        prompt = history + list(tp.user_tokens)
        rid = f"{plan.conversation_id}-t{tp.turn}-{uuid.uuid4().hex[:8]}"
        sent = time.monotonic()
        try:
            out, ttft = target.send(prompt, tp.max_tokens, request_id=rid,
                                    conversation_id=plan.router_conversation_id(tp.turn),
                                    turn=tp.turn)
        except (client.HttpError, LocalPairError, OSError) as exc:
            record(RequestResult(plan.conversation_id, tp.turn, rid, len(prompt), 0,
                                 sent - t0, (time.monotonic() - sent) * 1e3, None, False,
                                 f"{type(exc).__name__}: {exc}"[:2000]))
            with lock:
                bar.update(len(plan.turns) - tp.turn)
            return None
        record(RequestResult(plan.conversation_id, tp.turn, rid, len(prompt), len(out),
                             sent - t0, (time.monotonic() - sent) * 1e3, ttft, True,
                             output_token_ids=tuple(out)))
        return prompt + list(out)

    def run_conversation(plan: ConversationPlan) -> None:
        _sleep_until(t0 + plan.start_s * time_scale)
        history: list[int] | None = list(plan.system_tokens)
        for tp in plan.turns:
            if tp.think_time_s:
                time.sleep(tp.think_time_s * time_scale)
            history = send(plan, tp, history)
            if history is None:
                return

    try:
        if turn_major:
            for b in sorted({p.batch for p in plans}):
                batch = [p for p in plans if p.batch == b]
                live: list[list[int] | None] = [list(p.system_tokens) for p in batch]
                for k in range(max(len(p.turns) for p in batch)):
                    for i, plan in enumerate(batch):
                        hist = live[i]
                        if hist is not None and k < len(plan.turns):
                            live[i] = send(plan, plan.turns[k], hist)
        else:
            workers = min(len(plans), max_concurrency or len(plans)) or 1
            with ThreadPoolExecutor(max_workers=workers,
                                    thread_name_prefix="kvtune-workload") as ex:
                for fut in [ex.submit(run_conversation, p) for p in plans]:
                    fut.result()
    finally:
        bar.close()
    return sorted(results, key=lambda r: r.sent_s)


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)
