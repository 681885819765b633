"""The discrete-event core: router, prefill instances, decode engine loops, links and retention.

Time is in milliseconds of simulated time from 0. One heap of ``(time_ms, seq, handler, arg)``
events; ``seq`` keeps the order of simultaneous events deterministic. The mechanisms:

* **prefill**: each instance serves its FIFO queue ``parallel_requests`` at a time
  (:class:`~kvtune.sim.config.PrefillModel`); the router sends a request to the instance with the
  fewest queued prompt tokens (or the one holding the conversation's prefix when prefix caching is
  on).
* **push**: the router picks the decode at arrival (early). The decode allocates the destination
  blocks (waiting for KV memory if needed) and registers them with the prefill while it computes;
  the prefill's background sender thread builds the descriptors as soon as the registration
  arrives, and posts the WRITE when the prefill is done; the decode engine sees the notification
  at its next loop boundary.
* **pull** (and the forward leg of **bidirectional**): the prefill answers the router, which picks
  the decode then (late). At its next loop boundary the decode engine allocates the blocks, builds
  the descriptors and posts the READ inline (the fabric's per-descriptor cost plus the engine
  loop's own, ``DecodeModel.loop_per_descriptor_us``), stalling its running decodes; it sees the completion
  at a later boundary and schedules the request at the one after.
* **bidirectional**: a decode retains a finished request's KV for ``ttl_s`` (LRU-evicted when its
  KV memory is needed). The next turn goes to that decode; the prefill pulls the history back
  when it holds at least ``threshold_tokens`` (building the descriptors inline, in one of its
  slots, at the fabric's and its engine loop's per-descriptor cost), else recomputes it.
* **the way in** (``Overheads``): each leg reaches its engine's API server one hop after the
  router, which reads and tokenises the whole prompt (``tokenize_per_kilotoken_ms``) and stamps
  its arrival; the engine then takes it in (``prefill_intake_ms`` / ``decode_intake_ms``: IPC to
  the engine core, its loop picking the request up) before it queues or acts. Pull's handoff
  (prefill answer -> decode leg) grows with the prompt (``handoff_per_kilotoken_ms``); push's
  WRITE leaves ``handover_ms`` after the prefill finished (the request finishing at the engine's
  next step). The decode acts on arrived KV ``TransferModel.notify_ms`` after the transfer's end
  (push: the notification; pull: its READ's completion polled). These are the request's time
  outside the named engine spans: a trace measures them (``kvtune.analysis.path``).
* **links**: each instance's NIC is a FIFO for ``bytes/bandwidth``; the floor is latency on top.
* **decode steps**: step time grows with the batch and its context; while nothing changes, up to
  ``MAX_RUN_STEPS`` steps are one event (an arrival cuts the run at the next step boundary).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any


from kvtune import spans
from kvtune.sim.config import SimConfig
from kvtune.sim.timeline import RequestTimeline, Retention, Timeline
from kvtune.sim.workload import Arrival, Traffic
from kvtune.vllm_pd import router_ttl_s

PUSH, PULL, BIDI = spans.Mode.PUSH, spans.Mode.PULL, spans.Mode.BIDIRECTIONAL
_PROGRESS_EVERY_EVENTS = 20000  # progress bar refresh period, in events
MAX_RUN_STEPS = 128
"""Most decode steps simulated as one event (a wake-up cuts the run at the next boundary)."""


class _Route:
    """Where a conversation's last turn went and what became of its retained history."""

    __slots__ = ("dinst", "last_outcome")

    def __init__(self) -> None:
        self.dinst = -1
        self.last_outcome = ""


class _Prefill:
    __slots__ = ("idx", "queue", "active", "work_ms", "link_free", "sender_free", "cache", "cache_used",
                 "rev_jobs")

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.queue: deque[RequestTimeline] = deque()
        self.active = 0  # requests being computed (or reverse descriptors being built)
        self.work_ms = 0.0  # queued + running compute, for routing
        self.link_free = 0.0
        self.sender_free = 0.0
        self.cache: OrderedDict[int, int] = OrderedDict()
        self.cache_used = 0
        self.rev_jobs: deque[RequestTimeline] = deque()  # reverse pulls whose descriptors are not built yet


class _Decode:
    __slots__ = ("idx", "running", "step_no", "ctx", "inbox", "ready", "busy", "link_free",
                 "first_pending", "assigned", "mem_running", "retained", "mem_retained", "steps",
                 "stall_ms", "reg_wait", "run_t0", "run_c0", "run_slope", "run_k", "run_token", "cache",
                 "cache_used")

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.running: list[tuple[int, int, RequestTimeline]] = []  # heap of (finish step, idx, req)
        self.step_no = 0
        self.ctx = 0.0
        self.inbox: list[RequestTimeline] = []   # pull: arrived, descriptors not built yet
        self.ready: list[RequestTimeline] = []   # KV in place, waiting to be scheduled
        self.busy = False
        self.link_free = 0.0
        self.first_pending: list[RequestTimeline] = []
        self.assigned = 0
        self.mem_running = 0
        self.retained: OrderedDict[int, Retention] = OrderedDict()
        self.mem_retained = 0
        self.steps = 0
        self.stall_ms = 0.0
        self.reg_wait: deque[RequestTimeline] = deque()  # push: registrations waiting for KV memory
        self.run_t0 = self.run_c0 = self.run_slope = 0.0  # the current run of decode steps
        self.run_k = 0
        self.run_token = 0
        self.cache: OrderedDict[int, int] = OrderedDict()  # prefix cache: conversation -> tokens
        self.cache_used = 0


class Simulation:
    """Runs one :class:`SimConfig`; :meth:`run` fills :attr:`requests` and :attr:`retentions`."""

    def __init__(self, config: SimConfig, *, progress: bool = False) -> None:
        self.cfg = config
        self.mode = config.mode
        self.bidi = config.mode == BIDI
        self.early_decode = config.mode == PUSH
        self.progress = progress
        self.pm, self.dm, self.tm = config.prefill, config.decode, config.transfer
        self.rtm = config.reverse_transfer or config.transfer
        self.ov, self.ru = config.overheads, config.reuse
        self.decode_caching = (self.ru.prefix_caching if self.ru.decode_prefix_caching is None
                               else self.ru.decode_prefix_caching)
        self.prefills = [_Prefill(i) for i in range(config.prefill_instances)]
        self.decodes = [_Decode(i) for i in range(config.decode_instances)]
        self.requests: list[RequestTimeline] = []
        self.retentions: list[Retention] = []
        self.convs: dict[int, _Route] = {}
        self.traffic = Traffic(config.workload, seed=config.seed, requests=config.requests)
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self.now = 0.0
        self.events = 0

    # --- event plumbing -----------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg))

    def run(self) -> Simulation:
        for arrival in self.traffic.start():
            self.new_request(arrival)
        horizon_ms = self.traffic.horizon_ms
        heap, pop = self._heap, heapq.heappop
        bar = None
        if self.progress:
            from tqdm import tqdm
            bar = tqdm(total=round(horizon_ms / 1e3), unit="sim-s", desc=f"sim {self.mode.value}",
                       leave=False, mininterval=0.5)
        shown = 0
        n = 0
        while heap:
            t, _, fn, arg = pop(heap)
            self.now = t
            fn(arg)
            n += 1
            if bar is not None and n % _PROGRESS_EVERY_EVENTS == 0:
                sec = min(round(t / 1e3), bar.total)
                if sec > shown:
                    bar.update(sec - shown)
                    shown = sec
        self.events = n
        if bar is not None:
            bar.update(max(0, bar.total - shown))
            bar.close()
        for d in self.decodes:  # close retentions still open at the end
            for r in d.retained.values():
                r.end, r.outcome = self.now, spans.RetentionOutcome.RELEASED.value
            d.retained.clear()
        return self

    # --- arrivals -----------------------------------------------------------------------------
    @property
    def timeline(self) -> Timeline:
        return Timeline(tuple(self.requests), tuple(self.retentions))

    def new_request(self, a: Arrival) -> RequestTimeline:
        req = RequestTimeline(len(self.requests), a.conversation, a.turn, int(a.prompt_tokens),
                              max(1, int(a.output_tokens)), int(a.history_tokens), a.arrival_ms)
        self.requests.append(req)
        if a.conversation not in self.convs:
            self.convs[a.conversation] = _Route()
        self.at(a.arrival_ms, self.on_arrival, req)
        return req

    def on_arrival(self, req: RequestTimeline) -> None:
        ov = self.ov
        # each leg: one hop to the engine's API server, which reads and tokenises the prompt and
        # stamps its arrival; the engine then takes it in (intake) and queues it
        t = self.now + ov.router_ms + ov.hop_ms + ov.tokenize_ms(req.prompt)
        p = self.pick_prefill(req)
        req.pinst = p.idx
        if self.early_decode:
            d = self.pick_decode(req)
            self.assign_decode(req, d)
            req.at_decode = t
            self.at(t + ov.decode_intake_ms, self.on_push_decode_arrival, req)
        p.work_ms += req.prompt  # queued prompt tokens, for routing
        req.at_prefill = t
        self.at(t + ov.prefill_intake_ms, self.on_prefill_arrival, req)

    def pick_prefill(self, req: RequestTimeline) -> _Prefill:
        ps = self.prefills
        if len(ps) == 1:
            return ps[0]
        if self.ru.prefix_caching and req.history:
            for p in ps:
                if req.conv in p.cache:
                    return p
        return min(ps, key=lambda p: (p.work_ms, p.idx))

    def pick_decode(self, req: RequestTimeline) -> _Decode:
        ds = self.decodes
        if self.bidi and req.history:
            conv = self.convs.get(req.conv)
            if conv is not None and conv.dinst >= 0:
                d = ds[conv.dinst]
                if req.conv in d.retained:
                    return d
        if len(ds) == 1:
            return ds[0]
        return min(ds, key=lambda d: (d.assigned, d.idx))

    def assign_decode(self, req: RequestTimeline, d: _Decode) -> None:
        req.dinst = d.idx
        req.decode_assigned = True
        d.assigned += 1
        if self.decode_caching and req.history:
            # the decode's own prefix cache holds the conversation's last turn: a pull's READ
            # moves only the whole blocks it lacks (vLLM: prompt minus the local hit), and push
            # registers only those, so the prefill WRITEs only them (kv.bytes on the local pair)
            held = d.cache.get(req.conv)
            if held is not None:
                d.cache.move_to_end(req.conv)
                req.fwd_tokens = req.prompt - self.whole_blocks(min(held, req.history))

    def whole_blocks(self, tokens: int) -> int:
        """``tokens`` rounded down to whole KV blocks: prefix caches hit whole blocks only."""
        b = max(1, self.tm.block_tokens)
        return tokens // b * b

    # --- prefill ------------------------------------------------------------------------------
    def on_prefill_arrival(self, req: RequestTimeline) -> None:
        t = self.now
        req.prefill_seen = t
        p = self.prefills[req.pinst]
        local = 0
        if self.ru.prefix_caching and req.history:
            got = p.cache.get(req.conv)
            if got is not None:
                local = self.whole_blocks(min(got, req.history))
                p.cache.move_to_end(req.conv)
        if self.bidi:
            req.decision = t
            self.reuse_decision(req, p, local, t)
            if req.outcome == spans.ReuseOutcome.PULL.value:
                return  # enqueued when the reverse transfer completes
        else:
            req.cached = local
        req.computed = req.prompt - req.cached
        self.enqueue_prefill(req, p, t)

    def reuse_decision(self, req: RequestTimeline, p: _Prefill, local: int, t: float) -> None:
        RO = spans.ReuseOutcome
        conv = self.convs.get(req.conv)
        d = self.decodes[conv.dinst] if conv is not None and conv.dinst >= 0 else None
        ret = d.retained.get(req.conv) if d is not None else None
        # the router offers retained history back only within its TTL (the decode's minus the
        # margin vLLM's readback needs, kvtune.vllm_pd.router_ttl_s); the decode keeps it longer
        offered = ret is not None and t - ret.start <= router_ttl_s(ret.ttl_s) * 1e3
        if ret is None or not offered:
            req.remote_tokens = 0
            expired = req.history > 0 and conv is not None and (ret is not None or conv.last_outcome in (
                spans.RetentionOutcome.EXPIRED.value, spans.RetentionOutcome.EVICTED.value))
            if local:
                req.outcome, req.cached = RO.LOCAL_HIT.value, local
            else:
                req.outcome = RO.EXPIRED.value if expired else RO.NONE.value
            return
        remote = min(ret.tokens, req.history)
        req.remote_tokens = remote
        req.retention = ret
        if req.dinst < 0:  # the next turn goes to the decode that holds its history
            self.assign_decode(req, d)
        # vLLM pulls what its own prefix cache lacks, when that reaches the threshold
        # (nixl/pull_scheduler.py: count = remote tokens - locally computed; pull if >= threshold)
        pulled = local < remote and remote - local >= self.ru.threshold_tokens
        # retained blocks are reused when pulled back, or when the decode keeps them as its local
        # prefix (then the forward transfer moves only the rest); otherwise they are let go
        used = pulled or self.ru.decode_local_prefix
        self.end_retention(d, ret, (spans.RetentionOutcome.REUSED if used
                                    else spans.RetentionOutcome.RELEASED).value, t)
        if self.ru.decode_local_prefix:
            req.fwd_tokens = max(0, req.prompt - remote)
        if local >= remote:
            req.outcome, req.cached = RO.LOCAL_HIT.value, local
        elif pulled:
            req.outcome, req.cached = RO.PULL.value, remote
            req.rev_tokens = remote - local
            # the prefill engine loop builds the descriptors inline at its next boundary
            p.rev_jobs.append(req)
            self.prefill_next(p, t)
        else:
            req.outcome, req.cached = RO.RECOMPUTE.value, local

    def on_reverse_posted(self, req: RequestTimeline) -> None:
        p = self.prefills[req.pinst]
        rm = self.rtm
        req.rev_rdma_post = self.now
        start = max(self.now, p.link_free)
        p.link_free = start + rm.wire_ms(req.rev_tokens)
        req.rev_rdma_end = p.link_free + rm.floor_ms
        req.rev_notify = req.rev_rdma_end + rm.notify_ms
        self.at(req.rev_rdma_end, self.on_reverse_done, req)
        p.active -= 1
        self.prefill_next(p, self.now)

    def on_reverse_done(self, req: RequestTimeline) -> None:
        req.computed = req.prompt - req.cached
        self.enqueue_prefill(req, self.prefills[req.pinst], self.now)

    def enqueue_prefill(self, req: RequestTimeline, p: _Prefill, t: float) -> None:
        req.queue_enter = t
        p.queue.append(req)
        self.prefill_next(p, t)

    def prefill_next(self, p: _Prefill, t: float) -> None:
        """A prefill slot is free: reverse-pull descriptors first, then the next prefill (FIFO)."""
        slots = self.pm.parallel_requests
        while p.active < slots and p.rev_jobs:
            req = p.rev_jobs.popleft()
            p.active += 1
            req.rev_setup_start = t
            req.rev_setup_end = t + self.rtm.setup_ms(req.rev_tokens) + (
                self.pm.loop_per_descriptor_us * self.rtm.descriptors(req.rev_tokens) / 1e3)
            self.at(req.rev_setup_end, self.on_reverse_posted, req)
        while p.active < slots and p.queue:
            self.start_prefill(p, t)

    def start_prefill(self, p: _Prefill, t: float) -> None:
        req = p.queue.popleft()
        p.active += 1
        req.prefill_start = t
        req.prefill_end = t + self.pm.compute_ms(req.computed, req.cached)
        self.at(req.prefill_end, self.on_prefill_done, req)

    def on_prefill_done(self, req: RequestTimeline) -> None:
        t = self.now
        p = self.prefills[req.pinst]
        p.work_ms -= req.prompt
        p.active -= 1
        if self.ru.prefix_caching:
            self.cache_prompt(p, req)
        self.prefill_next(p, t)
        if self.early_decode:
            if req.reg_arrive <= t:
                self.push_send(req, t + self.ov.handover_ms)
        else:  # pull: back to the router, which picks the decode now; the decode's API server
            # tokenises the prompt and stamps its arrival, then the engine takes it in
            ov = self.ov
            req.at_decode = (t + 2 * ov.hop_ms + ov.tokenize_ms(req.prompt)
                             + req.prompt * ov.handoff_per_kilotoken_ms / 1e3)
            self.at(req.at_decode + self.ov.decode_intake_ms, self.on_pull_decode_arrival, req)

    def cache_prompt(self, p: _Prefill, req: RequestTimeline) -> None:
        self.cache_tokens(p, req.conv, req.prompt, self.ru.prefill_cache_tokens)

    def cache_tokens(self, inst: _Prefill | _Decode, conv: int, tokens: int, cap: int = 0) -> None:
        """LRU over conversations: ``inst`` now caches ``tokens`` of ``conv`` (``cap`` 0: the
        decode's KV capacity)."""
        cap = cap or self.dm.kv_capacity_tokens
        inst.cache_used -= inst.cache.pop(conv, 0)
        tokens = min(tokens, cap)
        while inst.cache and inst.cache_used + tokens > cap:
            _, n = inst.cache.popitem(last=False)
            inst.cache_used -= n
        inst.cache[conv] = tokens
        inst.cache_used += tokens

    # --- push ---------------------------------------------------------------------------------
    def on_push_decode_arrival(self, req: RequestTimeline) -> None:
        req.decode_seen = self.now
        d = self.decodes[req.dinst]
        if self.reserve(d, req):
            self.register(req, self.now)
        else:
            d.reg_wait.append(req)

    def register(self, req: RequestTimeline, t: float) -> None:
        reg = self.ov.registration_base_ms + self.tm.blocks(req.prompt) * self.ov.registration_per_block_us / 1e3
        req.reg_start, req.reg_end = t, t + reg
        req.reg_arrive = req.reg_end + self.ov.hop_ms
        self.at(req.reg_arrive, self.on_registration, req)

    def on_registration(self, req: RequestTimeline) -> None:
        # the prefill's sender thread builds the descriptors now, overlapping the prefill compute
        p = self.prefills[req.pinst]
        req.setup_start = max(self.now, p.sender_free)
        req.setup_end = req.setup_start + self.tm.setup_ms(req.fwd_tokens)
        p.sender_free = req.setup_end
        if req.prefill_end <= self.now:  # prefill finished first
            self.push_send(req, max(self.now, req.prefill_end + self.ov.handover_ms))

    def push_send(self, req: RequestTimeline, t: float) -> None:
        p = self.prefills[req.pinst]
        tm = self.tm
        req.rdma_post = max(req.setup_end, t)
        start = max(req.rdma_post, p.link_free)
        p.link_free = start + tm.wire_ms(req.fwd_tokens)
        req.rdma_end = p.link_free + tm.floor_ms
        req.notify = req.rdma_end + tm.notify_ms
        self.at(req.notify, self.on_push_notified, req)

    def on_push_notified(self, req: RequestTimeline) -> None:
        req.kv_ready = self.now
        d = self.decodes[req.dinst]
        d.ready.append(req)
        self.wake(d)

    # --- pull ---------------------------------------------------------------------------------
    def on_pull_decode_arrival(self, req: RequestTimeline) -> None:
        req.decode_seen = self.now
        if not req.decode_assigned:
            self.assign_decode(req, self.pick_decode(req))
        d = self.decodes[req.dinst]
        d.inbox.append(req)
        self.wake(d)

    def on_pull_done(self, req: RequestTimeline) -> None:
        req.kv_ready = self.now  # seen at the decode's next loop boundary
        d = self.decodes[req.dinst]
        d.ready.append(req)
        self.wake(d)

    # --- decode engine loop -------------------------------------------------------------------
    def wake(self, d: _Decode) -> None:
        if not d.busy:
            d.busy = True
            self.at(self.now, self.decode_tick, d)
        elif d.run_k > 1:  # cut a run of steps at the next step boundary
            now, t0, c0, slope = self.now, d.run_t0, d.run_c0, d.run_slope
            j = 1
            while j < d.run_k and t0 + j * c0 + slope * j * (j - 1) / 2 < now:
                j += 1
            if j < d.run_k:
                d.run_k = j
                d.run_token += 1
                self.at(t0 + j * c0 + slope * j * (j - 1) / 2, self.decode_step_end, (d, d.run_token))

    def decode_tick(self, d: _Decode) -> None:
        t = self.now
        stall = 0.0
        if d.inbox:  # pull: descriptors built and READs posted inline, running decodes wait
            tm, loop_us = self.tm, self.dm.loop_per_descriptor_us
            posted = 0
            for req in d.inbox:
                if not self.reserve(d, req):
                    break  # no KV memory for its blocks yet: stays in the inbox (FIFO)
                posted += 1
                req.setup_start = t + stall
                stall += tm.setup_ms(req.fwd_tokens) + loop_us * tm.descriptors(req.fwd_tokens) / 1e3
                req.setup_end = req.rdma_post = t + stall
                start = max(req.setup_end, d.link_free)
                d.link_free = start + tm.wire_ms(req.fwd_tokens)
                req.rdma_end = d.link_free + tm.floor_ms
                req.notify = req.rdma_end + tm.notify_ms
                self.at(req.notify, self.on_pull_done, req)  # its completion seen
            del d.inbox[:posted]
            d.stall_ms += stall
        t_adm = t + stall
        if d.ready:
            for req in d.ready:
                req.decode_start = t_adm
                heapq.heappush(d.running, (d.step_no + req.output, req.idx, req))
                d.ctx += req.prompt
                d.first_pending.append(req)
            d.ready.clear()
        if d.running:
            # Run k steps as one event while nothing changes: until the next request finishes,
            # one step only when a first token is due; wake() cuts the run if something arrives.
            # Step j lasts c0 + j*slope (the context grows by one token per sequence per step).
            batch = len(d.running)
            c0 = self.dm.step_ms(batch, d.ctx)
            k = 1 if d.first_pending else min(d.running[0][0] - d.step_no, MAX_RUN_STEPS)
            slope = batch * self.dm.step_per_kilotoken_us / 1e6
            d.run_t0, d.run_c0, d.run_slope, d.run_k = t_adm, c0, slope, k
            d.run_token += 1
            self.at(t_adm + k * c0 + slope * k * (k - 1) / 2, self.decode_step_end, (d, d.run_token))
        elif stall > 0:
            self.at(t_adm, self.decode_tick, d)
        else:
            d.busy = False

    def decode_step_end(self, arg: tuple[_Decode, int]) -> None:
        d, token = arg
        if token != d.run_token:
            return  # a run cut short by wake(): its later end was rescheduled
        t = self.now
        k = d.run_k
        d.run_k = 0
        d.step_no += k
        d.steps += k
        d.ctx += len(d.running) * k
        if d.first_pending:
            for req in d.first_pending:
                req.first_token = t
            d.first_pending.clear()
        running = d.running
        while running and running[0][0] <= d.step_no:
            _, _, req = heapq.heappop(running)
            d.ctx -= req.prompt + req.output
            d.mem_running -= req.prompt + req.output
            self.finish(req, d, t)
        while d.reg_wait and self.reserve(d, d.reg_wait[0]):
            self.register(d.reg_wait.popleft(), t)
        self.decode_tick(d)

    def finish(self, req: RequestTimeline, d: _Decode, t: float) -> None:
        req.last_token = t
        req.done = t + self.ov.hop_ms
        d.assigned -= 1
        conv = self.convs.get(req.conv)
        if self.decode_caching:
            self.cache_tokens(d, req.conv, req.prompt + req.output)
        if self.bidi:
            self.retain(d, req, t)
            if conv is not None:
                conv.dinst = d.idx
        nxt = self.traffic.after(req.conv, req.turn, req.prompt, req.output, req.done)
        if nxt is not None:
            self.new_request(nxt)

    # --- retention (bidirectional) ------------------------------------------------------------
    def retain(self, d: _Decode, req: RequestTimeline, t: float) -> None:
        tokens = req.prompt + req.output
        old = d.retained.get(req.conv)
        if old is not None:
            self.end_retention(d, old, spans.RetentionOutcome.RELEASED.value, t)
        if self.ru.ttl_s <= 0:
            return
        ret = Retention(req.conv, tokens, t, d.idx, req.idx, self.ru.ttl_s)
        self.retentions.append(ret)
        if not self.make_room(d, tokens, t):
            ret.end, ret.outcome = t, spans.RetentionOutcome.EVICTED.value
            self._conv_outcome(ret)
            return
        d.retained[req.conv] = ret
        d.mem_retained += tokens
        self.at(t + self.ru.ttl_s * 1e3, self.on_ttl, ret)

    def reserve(self, d: _Decode, req: RequestTimeline) -> bool:
        """Allocate the request's KV blocks on the decode (evicting retained histories if needed)."""
        need = req.prompt + req.output
        if d.mem_running + need > self.dm.kv_capacity_tokens and d.mem_running > 0:
            return False
        self.make_room(d, need, self.now)
        d.mem_running += need
        return True

    def make_room(self, d: _Decode, tokens: int, t: float) -> bool:
        cap = self.dm.kv_capacity_tokens
        while d.retained and d.mem_running + d.mem_retained + tokens > cap:
            _, victim = next(iter(d.retained.items()))
            self.end_retention(d, victim, spans.RetentionOutcome.EVICTED.value, t)
        return d.mem_running + d.mem_retained + tokens <= cap

    def on_ttl(self, ret: Retention) -> None:
        d = self.decodes[ret.dinst]
        if d.retained.get(ret.conv) is ret:
            self.end_retention(d, ret, spans.RetentionOutcome.EXPIRED.value, self.now)

    def end_retention(self, d: _Decode, ret: Retention, outcome: str, t: float) -> None:
        del d.retained[ret.conv]
        d.mem_retained -= ret.tokens
        ret.end, ret.outcome = t, outcome
        self._conv_outcome(ret)

    def _conv_outcome(self, ret: Retention) -> None:
        conv = self.convs.get(ret.conv)
        if conv is not None:
            conv.last_outcome = ret.outcome
