"""End to end: a real vLLM prefill/decode pair on CPU with kvtune's connectors, in pull, push and
bidirectional mode. Each test checks that the KV moved (the decode did not compute the prompt),
that the output equals a single-instance run with the same seed, and that the span files hold every
phase of each transfer in one trace. The last test runs one workload on the bidirectional pair and
on the same pair started with ``kv_role: kv_both`` on both engines, and compares their spans and
the tuning computed from them.

Run with ``flock "$VLLM_LOCK" pytest -m vllm tests/test_connectors_e2e.py`` (one vLLM
workload at a time on a shared machine). One pair per mode per module (and the kv_both pair); each
starts in ~30-90 s.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from kvtune import nb, spans
from kvtune.connectors.ids import derived_span_context
from kvtune.errors import KvtuneError

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")
from kvtune.local import server  # noqa: E402
from kvtune.local.pair import LocalPair, PairResult, SingleServer  # noqa: E402
from kvtune.local.pair import default_model_dir  # noqa: E402
from kvtune.local.workload import (  # noqa: E402
    PairTarget, RequestResult, WorkloadConfig, generate, run_workload,
)
from kvtune.traces import load  # noqa: E402

S = spans.SpanName
FAST_EXPORT_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
"""vLLM kills its engine processes at shutdown without flushing: export spans every 100 ms."""
SPANS_WAIT_S = 120.0
"""Bound on waiting for a transfer's spans to reach the files (busy 2-core machine)."""
STARTUP_TIMEOUT_S = 900.0
"""Bound on a server's start-up here (LocalPair's own default is 300 s)."""
MAX_TOKENS = 8
PROMPT = tuple(range(20, 116))       # 96 tokens: several blocks
PROMPT_2 = tuple(range(300, 380))    # another request, to check the handshake is not repeated
TURN2_EXTRA = tuple(range(500, 540))  # appended to turn 1's prompt + output in bidirectional mode

PULL_PHASES = (S.PREFILL, S.DESCRIPTOR_SETUP, S.RDMA, S.NOTIFY, S.DECODE_START)
PUSH_PHASES = (S.PREFILL, S.REGISTRATION, S.RENDEZVOUS, S.DESCRIPTOR_SETUP, S.RDMA, S.NOTIFY,
               S.DECODE_START)
REVERSE_PHASES = (S.REUSE_DECISION, S.DESCRIPTOR_SETUP, S.RDMA, S.NOTIFY, S.RETENTION)


# --- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def patient_startup() -> Iterator[None]:
    """Servers have needed over 300 s to start at load average 16 on this 2-core machine."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server, "wait_healthy", functools.partial(server.wait_healthy,
                                                             timeout_s=STARTUP_TIMEOUT_S))
        yield


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("connectors-e2e")


@pytest.fixture(scope="module")
def reference(workdir: Path) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Single-instance outputs (same model, seed, greedy) for every prompt the tests send."""
    prompts = [PROMPT, PROMPT_2]
    out: dict[tuple[int, ...], tuple[int, ...]] = {}
    with SingleServer(workdir=workdir / "single") as single:
        for p in prompts:
            out[p] = single.complete(list(p), MAX_TOKENS).token_ids
        turn1 = PROMPT + out[PROMPT]
        turn2 = turn1 + TURN2_EXTRA
        out[turn2] = single.complete(list(turn2), MAX_TOKENS).token_ids
    return out


class _OnePair:
    """At most one pair alive at a time: two pairs (four engines) on two cores starve each other."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.mode: str | None = None
        self._cm: LocalPair | None = None
        self.pair: LocalPair | None = None

    @staticmethod
    def name(mode: str, kv_both: bool = False) -> str:
        """The pair's directory under the workdir."""
        return f"{mode}-kv_both" if kv_both else mode

    def get(self, mode: str, kv_both: bool = False) -> LocalPair:
        name = self.name(mode, kv_both)
        if self.mode == name and self.pair is not None:
            return self.pair
        self.close()
        cm = LocalPair(mode, connector="kvtune", workdir=self.workdir / name / "work",
                       spans_dir=self.workdir / name / "spans", extra_env=FAST_EXPORT_ENV,
                       kv_both=kv_both)
        self.pair, self._cm, self.mode = cm.__enter__(), cm, name
        if mode == "bidirectional":
            # A two-turn warm-up: the prefill's first contact with the decode (its NIXL handshake,
            # which vLLM bounds by a 5 s receive timeout) happens here rather than inside the test.
            warm = tuple(range(900, 1000))
            first = self.pair.complete(list(warm), 2, conversation="warm-up")
            self.pair.complete(list(warm + first.token_ids + warm[:40]), 2, conversation="warm-up")
        return self.pair

    def close(self) -> None:
        cm, self._cm, self.pair, self.mode = self._cm, None, None, None
        if cm is not None:
            cm.__exit__(None, None, None)


@pytest.fixture(scope="module")
def pairs(workdir: Path, reference: Any) -> Iterator[_OnePair]:
    one = _OnePair(workdir)
    try:
        yield one
    finally:
        one.close()


@pytest.fixture
def pull_pair(pairs: _OnePair) -> LocalPair:
    return pairs.get("pull")


@pytest.fixture
def push_pair(pairs: _OnePair) -> LocalPair:
    return pairs.get("push")


@pytest.fixture
def bidi_pair(pairs: _OnePair) -> LocalPair:
    return pairs.get("bidirectional")


# --- helpers ----------------------------------------------------------------------------------
def _phase_spans(spans_dir: Path, transfer_id: str, phases: tuple[S, ...],
                 logs: Any) -> pd.DataFrame:
    """The spans of ``transfer_id`` once every phase is there (bounded wait)."""
    deadline = time.monotonic() + SPANS_WAIT_S
    seen: set[str] = set()
    while True:
        if any(spans_dir.glob("*.jsonl")):
            df = load(spans_dir)
            mine = df[df[spans.TRANSFER_ID] == transfer_id]
            seen = set(mine["name"])
            if {p.value for p in phases} <= seen:
                return mine
        if time.monotonic() > deadline:
            raise AssertionError(f"spans of {transfer_id}: expected phases "
                                 f"{sorted(p.value for p in phases)}, found {sorted(seen)}\n{logs()}")
        time.sleep(0.5)


def _assert_one_trace(df: pd.DataFrame, phases: tuple[S, ...], trace_id: str) -> None:
    for phase in phases:
        rows = df[df["name"] == phase.value]
        assert len(rows) >= 1, phase
        assert set(rows["trace_id"]) == {trace_id}, (phase, set(rows["trace_id"]))
        assert (rows["status"] != "ERROR").all(), rows[["name", "status", "status_message"]]


def _derived_trace(base: str) -> str:
    return f"{derived_span_context(base).trace_id:032x}"


def _decode_computed(pair: LocalPair) -> tuple[int, int]:
    s = pair.decode_prompt_sources()
    return s.local_compute_tokens, s.external_kv_transfer_tokens


def _run(pair: LocalPair, prompt: tuple[int, ...], rid: str, **kw: Any) -> tuple[PairResult, int, int]:
    computed0, external0 = _decode_computed(pair)
    result = pair.complete(list(prompt), MAX_TOKENS, request_id=rid, **kw)
    computed1, external1 = _decode_computed(pair)
    return result, computed1 - computed0, external1 - external0


def _assert_kv_moved(prompt: tuple[int, ...], computed: int, external: int) -> None:
    # The decode loaded (nearly) the whole prompt and computed at most the last token itself.
    assert external >= len(prompt) - 1, (computed, external)
    assert computed <= 1, (computed, external)


# --- tests ------------------------------------------------------------------------------------
def test_pull_moves_kv_matches_single_instance_and_traces_every_phase(
        pull_pair: LocalPair, reference: dict, workdir: Path) -> None:
    result, computed, external = _run(pull_pair, PROMPT, "e2e-pull-1")
    assert result.token_ids == reference[PROMPT]
    _assert_kv_moved(PROMPT, computed, external)

    tid = spans.transfer_id("e2e-pull-1", spans.Direction.FORWARD)
    df = _phase_spans(workdir / "pull" / "spans", tid, PULL_PHASES, pull_pair.logs)
    _assert_one_trace(df, PULL_PHASES, _derived_trace("e2e-pull-1"))
    by = {n: g for n, g in df.groupby("name")}
    prefill = by[S.PREFILL.value].iloc[0]
    assert prefill[spans.PROMPT_TOKENS] == len(PROMPT)
    assert prefill[spans.CACHED_TOKENS] + prefill[spans.COMPUTED_TOKENS] == len(PROMPT)
    assert set(by[S.PREFILL.value]["service"]) == {spans.service_name(spans.Role.PREFILL)}
    assert set(by[S.NOTIFY.value][spans.ROLE]) == {spans.Role.PREFILL.value}
    # The prefill held the blocks under vLLM's default kv_lease_duration until the READ's notice.
    (hold,) = by[S.NOTIFY.value].to_dict("records")
    assert hold[spans.PREFILL_LEASE_OUTCOME] == spans.PrefillLeaseOutcome.READ.value
    assert hold[spans.PREFILL_LEASE_S] == 30.0
    held, left = hold[spans.PREFILL_LEASE_HELD_S], hold[spans.PREFILL_LEASE_MARGIN_S]
    assert held > 0 and left > 0  # read before the expiry, which each heartbeat moves <= 20 s on
    assert held + left <= 30.0 + 20.0 * hold[spans.PREFILL_LEASE_RENEWALS] + 0.5
    rdma = by[S.RDMA.value]
    assert set(rdma[spans.NIXL_OP]) == {spans.NixlOp.READ.value}
    assert (rdma[spans.BYTES] > 0).all() and (rdma[spans.NIXL_XFER_US] >= 0).all()
    assert set(rdma[spans.ROLE]) == {spans.Role.DECODE.value}
    assert set(df[spans.MODE]) == {spans.Mode.PULL.value}


def test_pull_joins_the_callers_trace_and_handshakes_only_once(
        pull_pair: LocalPair, reference: dict, workdir: Path) -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    result, computed, external = _run(pull_pair, PROMPT_2, "e2e-pull-2", traceparent=traceparent)
    assert result.token_ids == reference[PROMPT_2]
    _assert_kv_moved(PROMPT_2, computed, external)
    tid = spans.transfer_id("e2e-pull-2", spans.Direction.FORWARD)
    df = _phase_spans(workdir / "pull" / "spans", tid, PULL_PHASES, pull_pair.logs)
    _assert_one_trace(df, PULL_PHASES, "4bf92f3577b34da6a3ce929d0e0e4736")
    assert set(df["parent_span_id"]) == {"00f067aa0ba902b7"}
    all_spans = load(workdir / "pull" / "spans")
    # The NIXL handshake happened once (the pair's warm-up), not per request.
    assert (all_spans["name"] == S.HANDSHAKE.value).sum() == 1


def test_push_moves_kv_matches_single_instance_and_traces_every_phase(
        push_pair: LocalPair, reference: dict, workdir: Path) -> None:
    result, computed, external = _run(push_pair, PROMPT, "e2e-push-1")
    assert result.token_ids == reference[PROMPT]
    _assert_kv_moved(PROMPT, computed, external)

    tid = spans.transfer_id("e2e-push-1", spans.Direction.FORWARD)
    df = _phase_spans(workdir / "push" / "spans", tid, PUSH_PHASES, push_pair.logs)
    _assert_one_trace(df, PUSH_PHASES, _derived_trace("e2e-push-1"))
    by = {n: g for n, g in df.groupby("name")}
    assert set(by[S.RDMA.value][spans.NIXL_OP]) == {spans.NixlOp.WRITE.value}
    assert set(by[S.RDMA.value][spans.ROLE]) == {spans.Role.PREFILL.value}
    assert set(by[S.REGISTRATION.value][spans.ROLE]) == {spans.Role.DECODE.value}
    assert set(by[S.NOTIFY.value][spans.ROLE]) == {spans.Role.DECODE.value}
    first = set(by[S.RENDEZVOUS.value][spans.FIRST_ARRIVAL])
    assert first <= {a.value for a in spans.FirstArrival} and len(first) == 1
    assert set(df[spans.MODE]) == {spans.Mode.PUSH.value}


def test_bidirectional_two_turns_reuse_the_history_and_trace_both_transfers(
        bidi_pair: LocalPair, reference: dict, workdir: Path) -> None:
    spans_dir = workdir / "bidirectional" / "spans"
    r1, computed, external = _run(bidi_pair, PROMPT, "e2e-bidi-t1", conversation="conv-e2e")
    assert r1.token_ids == reference[PROMPT]
    _assert_kv_moved(PROMPT, computed, external)
    assert r1.decode_kv_transfer_params and r1.decode_kv_transfer_params.get(
        spans.KV_PARAMS_RETAINED_TRACEPARENT)

    turn2 = PROMPT + r1.token_ids + TURN2_EXTRA
    p0 = bidi_pair.prefill_prompt_sources()
    r2, computed2, external2 = _run(bidi_pair, turn2, "e2e-bidi-t2", conversation="conv-e2e")
    p1 = bidi_pair.prefill_prompt_sources()
    assert r2.token_ids == reference[turn2]
    _assert_kv_moved(turn2, computed2, external2)
    # The prefill pulled turn 1's history back from the decode instead of recomputing it.
    assert p1.external_kv_transfer_tokens - p0.external_kv_transfer_tokens >= len(PROMPT)

    # Turn 1's forward transfer and the reverse transfer of its retained KV: turn 1's trace.
    fwd1 = _phase_spans(spans_dir, spans.transfer_id("e2e-bidi-t1", spans.Direction.FORWARD),
                        PULL_PHASES, bidi_pair.logs)
    _assert_one_trace(fwd1, PULL_PHASES, _derived_trace("e2e-bidi-t1"))
    rev = _phase_spans(spans_dir, spans.transfer_id("e2e-bidi-t1", spans.Direction.REVERSE),
                       REVERSE_PHASES, bidi_pair.logs)
    _assert_one_trace(rev, REVERSE_PHASES, _derived_trace("e2e-bidi-t1"))
    by = {n: g for n, g in rev.groupby("name")}
    decision = by[S.REUSE_DECISION.value].iloc[0]
    assert decision[spans.REUSE_OUTCOME] == spans.ReuseOutcome.PULL.value
    assert decision[spans.REUSE_REMOTE_TOKENS] >= len(PROMPT)
    assert decision[spans.REUSE_THRESHOLD_TOKENS] >= 0
    retention = by[S.RETENTION.value].iloc[0]
    assert retention[spans.RETENTION_OUTCOME] == spans.RetentionOutcome.REUSED.value
    assert retention[spans.RETENTION_TTL_S] > 0
    assert set(by[S.RDMA.value][spans.ROLE]) == {spans.Role.PREFILL.value}
    assert set(by[S.NOTIFY.value][spans.ROLE]) == {spans.Role.DECODE.value}
    assert set(rev[spans.MODE]) == {spans.Mode.BIDIRECTIONAL.value}

    # Turn 2's own forward transfer: turn 2's trace; its prefill reused the pulled history.
    fwd2 = _phase_spans(spans_dir, spans.transfer_id("e2e-bidi-t2", spans.Direction.FORWARD),
                        PULL_PHASES, bidi_pair.logs)
    _assert_one_trace(fwd2, PULL_PHASES, _derived_trace("e2e-bidi-t2"))
    prefill2 = fwd2[fwd2["name"] == S.PREFILL.value].iloc[0]
    assert prefill2[spans.PROMPT_TOKENS] == len(turn2)
    assert prefill2[spans.CACHED_TOKENS] >= len(PROMPT)


# --- kv_both -----------------------------------------------------------------------------------
KV_BOTH_WORKLOAD = WorkloadConfig(n_conversations=3, turns=(3, 3), system_prompt_tokens=32,
                                  first_user_tokens=(60, 600), follow_up_tokens=(20, 40),
                                  output_tokens=(4, 8), think_time_s=(0.2, 0.5), seed=11)
"""Three three-turn conversations of different sizes, sent one request at a time (the same order
on both pairs): forward pulls of 1 to 6 blocks and history pulled back (or recomputed, as the
threshold decides: the same on both)."""
PROBE_SPANS = Path(__file__).resolve().parent.parent / "examples" / "verify-shaped" / "tune" / \
    "spans" / "probe"
"""A real fabric probe's spans (``make tune``'s, committed with ``examples/verify-shaped``)."""
TIMED_COLUMNS = {"trace_id", "span_id", "parent_span_id", "start_ns", "end_ns", "duration_ms",
                 spans.NIXL_POST_US, spans.NIXL_XFER_US, spans.REQUEST_ID, spans.BASE_REQUEST_ID,
                 spans.TRANSFER_ID, spans.ENGINE_ID, spans.REMOTE_ENGINE_ID,
                 spans.NOTIFY_SENT_NS, spans.TTFT_MS, spans.PREFILL_LEASE_HELD_S,
                 spans.PREFILL_LEASE_MARGIN_S, spans.PREFILL_LEASE_RENEWALS,
                 spans.PREFILL_LEASE_HEARTBEATS_SENT, "resource", "host",
                 "status_message", "attrs"}
"""Columns that differ between two runs of one workload: times, ids (the workload's request ids
are random), the engines' names; every other column must be equal."""


def _workload_spans(spans_dir: Path, results: list[RequestResult], logs: Any) -> pd.DataFrame:
    """Every span of the workload's requests, once all their transfers' phases are in: each
    request's forward pull, and each later turn's reuse decision (with the reverse pull's phases
    when it pulled)."""
    rids = [r.request_id for r in results]
    later = {r.request_id for r in results if r.turn > 1}
    prev = {r.request_id: p.request_id for p, r in zip(results, results[1:])
            if r.conversation_id == p.conversation_id}
    deadline = time.monotonic() + SPANS_WAIT_S
    while True:
        missing: list[str] = []
        df = load(spans_dir) if any(spans_dir.glob("*.jsonl")) else None
        if df is not None:
            tid = df[spans.TRANSFER_ID].astype("object")
            for rid in rids:
                names = set(df.loc[tid == spans.transfer_id(rid, spans.Direction.FORWARD), "name"])
                missing += [f"{rid}:{p.value}" for p in PULL_PHASES if p.value not in names]
                if rid not in later:
                    continue
                rev = df[tid == spans.transfer_id(prev[rid], spans.Direction.REVERSE)]
                decided = set(rev.loc[rev["name"] == S.REUSE_DECISION.value, spans.REUSE_OUTCOME])
                want = (REVERSE_PHASES if spans.ReuseOutcome.PULL.value in decided
                        else (S.REUSE_DECISION,))
                missing += [f"{prev[rid]}:reverse:{p.value}" for p in want
                            if p.value not in set(rev["name"])]
            if not missing:
                mine = {spans.transfer_id(r, d) for r in rids for d in spans.Direction}
                return df[tid.isin(mine).to_numpy(dtype=bool)]
        if time.monotonic() > deadline:
            raise AssertionError(f"workload spans: missing {missing[:20]}\n{logs()}")
        time.sleep(0.5)


def _leg_by_engine(df: pd.DataFrame, pair: LocalPair) -> pd.Series:
    """The leg each span's engine serves in ``pair`` (the role a producer/consumer pair gives)."""
    return df[spans.ENGINE_ID].astype("object").map(
        {pair.prefill_engine_id: spans.Role.PREFILL.value,
         pair.decode_engine_id: spans.Role.DECODE.value})


def _relabelled(df: pd.DataFrame, roles: pd.Series) -> pd.DataFrame:
    """``df`` with each span's role (and service name) replaced by ``roles``'."""
    out = df.copy()
    out[spans.ROLE] = roles.astype(df[spans.ROLE].dtype)
    out["service"] = roles.astype("object").map(spans.service_name).astype(df["service"].dtype)
    return out


def _comparable(df: pd.DataFrame) -> list[tuple[str, ...]]:
    cols = sorted(c for c in df.columns if c not in TIMED_COLUMNS)
    return sorted(tuple(str(v) for v in row) for row in df[cols].itertuples(index=False))


def _tuning(df: pd.DataFrame, where: Path) -> dict[str, Any] | str:
    """What ``kvtune tune --traces`` computes from ``df`` and the committed fabric probe's spans
    (its defaults, the pair's model), or the error it stops with. The probe's transfers stand in
    for the floor fit, as in ``make tune`` on loopback: the pair's transfers here are too close in
    size and time to fit one."""
    try:
        return nb.tuning(pd.concat([df, load(PROBE_SPANS)], ignore_index=True), "",
                         traces=str(where), model=str(default_model_dir() / "config.json"),
                         hbm_budget_gb=1.0).as_dict()
    except KvtuneError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_kv_both_pair_labels_every_span_by_its_leg_and_tunes_as_producer_consumer(
        pairs: _OnePair, workdir: Path) -> None:
    plans = generate(KV_BOTH_WORKLOAD)
    runs: dict[bool, pd.DataFrame] = {}
    for kv_both in (False, True):  # the producer/consumer pair first: it is running already
        pair = pairs.get("bidirectional", kv_both=kv_both)
        results = run_workload(plans, PairTarget(pair), max_concurrency=1, progress=False)
        assert [r.ok for r in results] == [True] * 9, [r.error for r in results]
        spans_dir = workdir / _OnePair.name("bidirectional", kv_both) / "spans"
        runs[kv_both] = _workload_spans(spans_dir, results, pair.logs)
        if kv_both:
            # Every span the kv_both engines made (warm-ups and handshakes too) carries the role
            # of the leg it served (each engine of the pair serves one leg only), and that
            # role's service name.
            every = load(spans_dir)
            leg = _leg_by_engine(every, pair)
            assert leg.notna().all() and set(leg) == {spans.Role.PREFILL.value,
                                                      spans.Role.DECODE.value}
            wrong = every[spans.ROLE].astype("object") != leg
            assert not wrong.any(), every.loc[wrong, ["name", spans.ROLE, spans.ENGINE_ID]]
            assert (every["service"].astype("object") == leg.map(spans.service_name)).all()
    pc, both = runs[False], runs[True]
    # The same spans (name, role, service, mode, direction, tokens, blocks, bytes, outcomes, ...),
    # but for times and ids.
    assert len(both) == len(pc) and _comparable(both) == _comparable(pc)
    assert {spans.ReuseOutcome.PULL.value} <= set(both[spans.REUSE_OUTCOME].dropna())

    # The tuning from the kv_both spans is the one from the same spans labelled as a producer/
    # consumer pair labels them (by engine) - and role labels do move it: the labels the
    # kv_both engines wrote before (every span the prefill's) give another one.
    tuned = _tuning(both, workdir)
    assert isinstance(tuned, dict), tuned
    assert _tuning(_relabelled(both, _leg_by_engine(both, pairs.pair)), workdir) == tuned
    old = pd.Series(spans.Role.PREFILL.value, index=both.index)
    assert _tuning(_relabelled(both, old), workdir) != tuned
