"""What happened to each simulated request and retained history: the run's public timeline.

The engine fills these records as it plays the events; :class:`~kvtune.sim.result.SimResult`
hands them out (``result.timeline``), and the per-request table and the spans are both built
from them. Times are milliseconds of simulated time from 0; ``NaN`` means "did not happen".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

_NAN = math.nan


def request_id(idx: int) -> str:
    """The simulated request id (also its base request id)."""
    return f"sim-{idx:08d}"


def conversation_id(conv: int) -> str:
    """The simulated conversation id."""
    return f"conv-{conv:06d}"


class RequestTimeline:
    """One request's state and timeline (ms). NaN = did not happen.

    Identity: ``idx`` (see :func:`request_id`), ``conv``, ``turn``; sizes in tokens: ``prompt``,
    ``output``, ``history`` (previous turn's prompt + output), ``cached`` (not recomputed),
    ``computed``, ``fwd_tokens`` (forward transfer), ``rev_tokens`` (history pulled back),
    ``remote_tokens`` (history a decode offered); ``pinst`` / ``dinst``: prefill / decode
    instance; ``outcome``: the reuse decision (``kvtune.spans.ReuseOutcome`` value, "" outside
    bidirectional). Times: ``arrival``, ``at_prefill`` (the prefill's API server stamped its
    arrival), ``prefill_seen`` (its engine took it in), ``decision``, ``rev_*`` (reverse pull),
    ``queue_enter``, ``prefill_start``, ``prefill_end``, ``reg_*`` (push registration),
    ``at_decode`` / ``decode_seen`` (the same on the decode), ``setup_start``, ``setup_end``,
    ``rdma_post``, ``rdma_end``, ``notify``, ``kv_ready``, ``decode_start``, ``first_token``,
    ``last_token``, ``done``.
    """

    __slots__ = (
        "idx", "conv", "turn", "prompt", "output", "history", "arrival", "pinst", "dinst",
        "at_prefill", "prefill_seen", "decode_seen", "decision", "outcome", "remote_tokens", "cached", "computed",
        "rev_setup_start", "rev_setup_end", "rev_rdma_end", "rev_notify", "rev_tokens",
        "queue_enter", "prefill_start", "prefill_end",
        "reg_start", "reg_end", "reg_arrive", "at_decode",
        "setup_start", "setup_end", "rdma_post", "rdma_end", "notify", "fwd_tokens", "rev_rdma_post",
        "kv_ready", "decode_start", "first_token", "last_token", "done", "retention",
        "decode_assigned",
    )

    def __init__(self, idx: int, conv: int, turn: int, prompt: int, output: int, history: int,
                 arrival: float) -> None:
        self.idx, self.conv, self.turn = idx, conv, turn
        self.prompt, self.output, self.history, self.arrival = prompt, output, history, arrival
        self.pinst = self.dinst = -1
        self.at_prefill = self.prefill_seen = self.decode_seen = self.decision = _NAN
        self.outcome = ""
        self.remote_tokens = 0
        self.cached = 0
        self.computed = prompt
        self.rev_setup_start = self.rev_setup_end = self.rev_rdma_end = self.rev_notify = _NAN
        self.rev_tokens = 0
        self.queue_enter = self.prefill_start = self.prefill_end = _NAN
        self.reg_start = self.reg_end = self.reg_arrive = self.at_decode = _NAN
        self.setup_start = self.setup_end = self.rdma_post = self.rdma_end = self.notify = _NAN
        self.rev_rdma_post = _NAN
        self.fwd_tokens = prompt
        self.kv_ready = self.decode_start = self.first_token = self.last_token = self.done = _NAN
        self.retention: Retention | None = None
        self.decode_assigned = False


class Retention:
    """KV a decode kept for a conversation after its request finished (bidirectional):
    ``tokens`` held on decode ``dinst`` from ``start`` to ``end`` (ms), with its ``outcome``
    (``kvtune.spans.RetentionOutcome`` value) and the ``ttl_s`` in force; ``req_idx`` is the
    request whose history it holds."""

    __slots__ = ("conv", "tokens", "start", "end", "outcome", "dinst", "req_idx", "ttl_s")

    def __init__(self, conv: int, tokens: int, start: float, dinst: int, req_idx: int,
                 ttl_s: float) -> None:
        self.conv, self.tokens, self.start, self.dinst = conv, tokens, start, dinst
        self.req_idx, self.ttl_s = req_idx, ttl_s
        self.end = _NAN
        self.outcome = ""


@dataclass(frozen=True, eq=False)
class Timeline:
    """Every request (in order of creation, ``requests[i].idx == i``) and every retained history of
    one run."""

    requests: tuple[RequestTimeline, ...]
    retentions: tuple[Retention, ...]
