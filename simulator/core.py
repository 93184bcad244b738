"""The simulator's event loop and worker model (``Simulation``), driven by ``simulator/simulate.simulate``.

Each worker has a KV cache of ``cap`` blocks (a block is a trace hash id), LRU eviction of unreferenced blocks, a
FIFO prefill queue (chunked prefill mixed with decode, as the engine's token-budget scheduler) and continuous
batched decode. Events are ``(time, kind, seq, data)`` in a heap: at equal times a step's end comes before a
hand-off, and both before an arrival; ``seq`` keeps the order of equal events, so runs are deterministic.

Invariants: a decode-only step event may cover ``k`` steps (up to the next finish, or the first step boundary at
or after the next elastic tick); work that reaches a busy worker (a placement, a hand-off, a live migration)
cuts its pending event at the first step boundary at or after the arrival (``join``), so it enters the batch
at the next step boundary, as in the engine; a cut event is replaced, the old one is stale (``gen``) and
ignored. A worker's step boundaries do not depend on how its steps are grouped into events, so ticks that
change nothing change no result. ``elastic`` None (no migration, no planner): no tick.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import time
from bisect import bisect_left

from shared import progress
from services.router.fair_gate import may_overcommit
from services.router.policy.placement import place_request
from services.router.policy.profiles import Profile
from simulator.state import SimRequest, SimWorker
from simulator.tier import SimTier
from simulator.trace import TraceRequest
from services.router.policy.types import ClusterView, Placement, RequestInfo, WorkerView

# event kinds, in their order at equal times: finish work before taking new arrivals; ticks see it all
_STEP, _HANDOFF, _ARRIVAL, MOVED, START, TICK = 0, 1, 2, 3, 4, 5


class Simulation:
    def __init__(self, trace, policy, profile: Profile, num_workers: int, prefill_workers: int,
                 kv_capacity_blocks: int, ttft_slo_s: float | None, tier: SimTier, retention: str,
                 block_size: int, priorities: list[int] | None = None,
                 ttft_targets: list[float | None] | None = None, gate: bool = False):
        """``priorities`` / ``ttft_targets`` (per trace position, SLO classes: ``simulator/classes.py``): the
        order of each worker's waiting queue (lower first, then arrival) and the TTFT a placement must be
        predicted to meet; None: arrival order and ``ttft_slo_s`` for all. ``gate``: the router's dispatch window
        (the decode workers' seats; beyond it requests wait at the router by priority, then arrival, and a more
        urgent one dispatches beyond a window full of less urgent ones, up to twice the window:
        ``services/router/fair_gate.py`` for one tenant)."""
        self.trace, self.policy, self.p, self.bs = trace, policy, profile, block_size
        self.ttft_slo = ttft_slo_s
        self.priorities, self.ttft_targets = priorities, ttft_targets
        self.waiting: list[tuple[int, int]] = []   # the gate's queue: (priority, trace position), a heap
        self.dispatched_at: dict[int, int] = {}    # priority -> requests dispatched and not finished
        self.kv_capacity_blocks = kv_capacity_blocks
        start = trace[0].arrival_s if trace else 0.0
        roles = ["prefill"] * prefill_workers + (["decode"] if prefill_workers else ["both"]) * num_workers
        self.workers = [SimWorker(i, role, kv_capacity_blocks, start) for i, role in enumerate(roles)]
        self.by_id = {w.wid: w for w in self.workers}
        self.window = num_workers * profile.max_num_seqs if gate else None   # the decode (or aggregated) seats
        self.tier, self.retention = tier, retention
        self.tier_hits = {"dram": 0, "ssd": 0}  # blocks pulled from each tier
        self.cost = profile.cost_model(block_size)
        self.block_s = profile.block_transfer_s(block_size)
        self.events: list = []
        self.seq = 0
        self.rejected = 0
        self.preemptions = 0   # seats taken back for more urgent requests (SLO classes on)
        self.done: list[SimRequest] = []
        self.hit_blocks = self.local_blocks = self.total_blocks = 0
        self.now = 0.0
        self.last_work_s = 0.0  # time of the last event that was not a tick or a worker start
        self.elastic = None  # sim_elastic.Elastic when migration or the planner is on
        self.next_tick = math.inf
        self.view_s = self.place_s = 0.0  # wall seconds building views / in place_request (not in results)

    def push(self, t: float, kind: int, data) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, data))

    # --- arrivals ---------------------------------------------------------------------------------------
    def view(self, tr: TraceRequest) -> ClusterView:
        """What the policy sees: every worker taking placements (neither draining nor removed); a decode
        worker's waiting requests include those placed there whose prefill or hand-off is under way, as the
        router counts its own placements (``SimWorker.num_waiting``)."""
        views, overlap = [], {}
        for w in self.workers:
            if w.draining or w.removed:
                continue
            views.append(WorkerView(w.wid, w.role, len(w.running), len(w.queue) + w.incoming,  # w.num_waiting
                                    w.queued_tokens + w.prefill_left, max(0, w.cap - w.used), w.cap, self.bs))
            overlap[w.wid] = w.prefix(tr.hash_ids)
        pre = tuple(v for v in views if v.role in ("prefill", "both"))
        dec = tuple(v for v in views if v.role == "decode")
        if not self.tier.enabled:
            return ClusterView(pre, dec, overlap, 0, self.cost)
        held = self.tier.prefix(tr.hash_ids, self.now)
        cost = dataclasses.replace(self.cost, block_transfer_s=held.block_s()) if held.blocks else self.cost
        return ClusterView(pre, dec, overlap, held.blocks, cost)

    def arrive(self, tr: TraceRequest, pos: int = 0) -> None:
        """A request reaches the router: dispatched now, or queued at the gate (``gate``)."""
        priority = 0 if self.priorities is None else self.priorities[pos]
        if self.window is not None and (self.waiting and self.waiting[0][0] <= priority
                                        or not self._may_dispatch(priority)):
            heapq.heappush(self.waiting, (priority, pos))
            return
        self.dispatch(tr, pos)

    def _may_dispatch(self, priority: int) -> bool:
        return sum(self.dispatched_at.values()) < self.window or may_overcommit(self.dispatched_at, self.window,
                                                                                priority)

    def _pump(self) -> None:
        while self.waiting and self._may_dispatch(self.waiting[0][0]):
            _, pos = heapq.heappop(self.waiting)
            self.dispatch(self.trace[pos], pos)

    def dispatch(self, tr: TraceRequest, pos: int) -> None:
        """Place the request (or refuse it on the policy's prediction) and queue it at its worker."""
        t0 = time.perf_counter()
        view = self.view(tr)
        target = self.ttft_slo if self.ttft_targets is None else self.ttft_targets[pos]
        info = RequestInfo(f"r{tr.idx}", tr.input_length, tr.hash_ids, tr.output_length, target)
        t1 = time.perf_counter()
        placed = place_request(self.policy, info, view)
        self.place_s += time.perf_counter() - t1
        self.view_s += t1 - t0
        if not isinstance(placed, Placement):
            self.rejected += 1
            return
        dw = self.by_id[placed.decode_worker]
        pw = self.by_id[placed.prefill_worker] if placed.prefill_worker else dw
        hit = max(view.overlap[pw.wid], view.remote_overlap)
        r = SimRequest(tr, dw.idx, max(1, tr.input_length - hit * self.bs))
        r.pos, r.priority = pos, 0 if self.priorities is None else self.priorities[pos]
        if self.window is not None:
            self.dispatched_at[r.priority] = self.dispatched_at.get(r.priority, 0) + 1
        if pw is not dw:
            dw.incoming += 1
        self.enqueue(pw, r)
        pw.queued_tokens += r.est
        self.join(pw)

    @staticmethod
    def enqueue(w: SimWorker, r: SimRequest) -> None:
        """Into ``w``'s waiting queue at its place: after every request as urgent or more (arrival order within a
        priority; all priorities equal: FIFO)."""
        q = w.queue
        j = len(q)
        while j > 0 and q[j - 1].priority > r.priority:
            j -= 1
        q.insert(j, r)

    # --- worker steps ------------------------------------------------------------------------------------
    def join(self, w: SimWorker) -> None:
        """Work reached ``w`` now: an idle worker plans a step; a busy one ends its pending multi-step at the
        first step boundary at or after now (steps already under way complete), so the work enters the batch
        there."""
        if not w.busy:
            self.plan(w)
            return
        ends = w.step_ends
        j = bisect_left(ends, self.now)
        if j >= len(ends) - 1:  # the pending event ends at that boundary already
            return
        w.gen += 1
        w.step_ends = ends[:j + 1]
        self.push(ends[j], _STEP, (w.idx, w.gen, j + 1, (), w.step_decoding))

    def admit(self, w: SimWorker) -> SimRequest | None:
        """Move the queue's head into the running batch if its blocks fit (FIFO: a head that does not fit
        waits for running requests to free blocks); None when it must wait."""
        r = w.queue[0]
        hashes = r.tr.hash_ids
        local, total, need = self._needs(w, r)
        if not self._fits(w, r):
            return None
        w.queue.popleft()
        w.queued_tokens -= r.est
        for h in hashes[:local]:
            w.pin(h)
        r.pinned, r.private, r.total_blocks, r.local = hashes[:local], need, total, local
        w.private += need
        w.evict()
        if self.tier.enabled:
            self.pull(r, local)
        r.hit = max(local, r.hit)
        r.uncached = max(1, r.tr.input_length - r.hit * self.bs)
        if r.first_s is not None:   # preempted while decoding: its output so far is recomputed too
            r.uncached += r.generated
        self.hit_blocks += r.hit
        self.local_blocks += local
        self.total_blocks += len(hashes)
        w.running.append(r)
        w.prefill_left += r.uncached
        return r

    def _needs(self, w: SimWorker, r: SimRequest) -> tuple[int, int, int]:
        """``(local prefix blocks, total blocks, blocks to reserve)`` of admitting ``r`` on ``w``."""
        hashes = r.tr.hash_ids
        local = w.prefix(hashes)
        decodes_here = w.role != "prefill" and r.decode_w == w.idx
        total = max(-(-(r.tr.input_length + (r.tr.output_length if decodes_here else 0)) // self.bs), len(hashes))
        return local, total, total - local

    def _fits(self, w: SimWorker, r: SimRequest) -> bool:
        """Whether ``r``'s blocks fit on ``w`` now (a worker holding nothing takes any request)."""
        local, _, need = self._needs(w, r)
        newly_pinned = sum(1 for h in r.tr.hash_ids[:local] if h not in w.pinned)
        return w.cap - (len(w.pinned) + newly_pinned + w.private) >= need or not (w.pinned or w.private)

    def take_seats(self, w: SimWorker) -> None:
        """The priority policy's preemption (at a step boundary, before the step is planned): while the queue's
        head finds no seat or no room for its blocks and is more urgent than the least urgent running request
        (the latest admitted of them), that one is preempted: its blocks freed (cached ones stay), back in the
        queue, its prompt and output so far recomputed when readmitted."""
        while w.queue and w.running and (len(w.running) >= self.p.max_num_seqs or not self._fits(w, w.queue[0])):
            victim = max(reversed(w.running), key=lambda r: r.priority)
            if victim.priority <= w.queue[0].priority:
                return
            w.running.remove(victim)
            if victim.first_s is not None:   # decoding: its context leaves the batch's KV
                w.kv_tokens -= victim.tr.input_length + victim.generated
            else:
                w.prefill_left -= victim.uncached - victim.done
            w.release(victim)
            victim.done = 0
            self.preemptions += 1
            self.enqueue(w, victim)
            w.queued_tokens += victim.est

    def pull(self, r: SimRequest, local: int) -> None:
        """``r`` (admitted where it holds ``local`` blocks) pulls the tier's blocks beyond them; its first
        prefill chunk pays the pull time."""
        held = self.tier.prefix(r.tr.hash_ids, self.now)
        if held.blocks > local:
            r.hit, r.pull_s = held.blocks, held.pull_s(local)
            r.tier_tokens = held.tokens(local, r.tr.input_length, self.bs)
            for src, n in self.tier.use(r.tr.hash_ids[local:held.blocks], self.retention, self.now).items():
                self.tier_hits[src] += n

    def _chunk_s(self, r: SimRequest, c: int) -> float:
        ctx = r.tr.input_length - r.uncached + r.done  # tokens already in the KV (prefix + earlier chunks)
        return self.p.chunk_s(ctx, c) + (r.pull_s if r.done == 0 else 0.0)

    def plan(self, w: SimWorker) -> None:
        """Schedule the worker's next step exactly as the engine's token-budget scheduler does: running
        requests in admission order (with SLO classes: the most urgent class first), a decode taking 1 token, a
        prefill the rest of its prompt up to the budget (once the budget is spent the rest of the batch waits a
        step), then queued requests are admitted while budget, blocks and ``max_num_seqs`` allow."""
        if self.priorities is not None:
            self.take_seats(w)
        budget = self.p.chunk_tokens
        chunks: list[tuple[SimRequest, int]] = []
        decoding: list[SimRequest] = []
        batch = w.running if self.priorities is None else sorted(w.running, key=lambda r: r.priority)
        for r in batch:   # by class first (the priority policy's running order), admission order within
            if budget <= 0:
                break
            if r.done < r.uncached:
                c = min(r.uncached - r.done, budget)
                chunks.append((r, c))
                budget -= c
            else:
                decoding.append(r)
                budget -= 1
        while w.queue and budget > 0 and len(w.running) < self.p.max_num_seqs:
            r = self.admit(w)
            if r is None:
                break
            c = min(r.uncached, budget)
            chunks.append((r, c))
            budget -= c
        decodes = len(decoding)
        if not chunks and not decodes:
            w.busy, w.step_ends, w.step_decoding = False, [], []
            return
        w.busy = True
        if chunks:
            dt = max(self.p.prefill_c, self.p.decode_base_s if decodes else 0.0)
            dt += sum(self._chunk_s(r, c) for r, c in chunks)
            if decodes:
                dt += self.p.decode_step_s(decodes, w.kv_tokens) - self.p.decode_base_s
            w.step_ends, w.step_decoding = [self.now + dt], decoding
            self.push(self.now + dt, _STEP, (w.idx, w.gen, 1, chunks, decoding))
            return
        # decode only: k steps at once, up to the next finish or the first step boundary at or after the next tick
        # (its policies see the cluster between steps); work arriving meanwhile cuts the event short (join)
        kmax = min(r.tr.output_length - r.generated for r in decoding)
        t, kv, ends = self.now, w.kv_tokens, []
        while len(ends) < kmax:
            t += self.p.decode_step_s(decodes, kv)
            kv += decodes
            ends.append(t)
            if t >= self.next_tick:
                break
        w.step_ends, w.step_decoding = ends, decoding
        self.push(t, _STEP, (w.idx, w.gen, len(ends), (), decoding))

    def step_done(self, widx: int, gen: int, k: int, chunks, decoding) -> None:
        """``k`` steps ended: each request in ``decoding`` gained ``k`` tokens, each chunk was computed. Streams
        ordered to migrate leave now, between steps; a draining worker left with nothing completes its drain."""
        w = self.workers[widx]
        w.kv_tokens += k * len(decoding)
        for r in decoding:
            r.generated += k
            if r.generated >= r.tr.output_length:
                self.finish(w, r)
        for r, c in chunks:
            r.done += c
            w.prefill_left -= c
            if r.done >= r.uncached:
                self.prefilled(w, r)
        if w.moves_out:
            self.elastic.detach(w)
        self.plan(w)
        if w.draining:
            self.elastic.maybe_retire(w)

    def prefilled(self, w: SimWorker, r: SimRequest) -> None:
        hashes = r.tr.hash_ids
        for h in hashes[r.local:]:
            w.pin(h)
        w.private -= len(hashes) - r.local
        r.private -= len(hashes) - r.local
        r.pinned = hashes
        w.evict()
        if self.tier.enabled:
            self.tier.put(hashes[::-1], self.retention, self.now)  # tail first: the head is the most recent
        if r.decode_w != w.idx:  # disaggregated: ship the KV to the decode worker
            w.running.remove(r)
            w.release(r)
            self.push(self.now + len(hashes) * self.block_s, _HANDOFF, r)
            return
        self.start_decode(w, r)

    def start_decode(self, w: SimWorker, r: SimRequest) -> None:
        """The step that finished ``r``'s prompt sampled its first token (a preempted request's recompute: its
        next one); it decodes from the next step."""
        if r.first_s is None:
            r.first_s = self.now
            r.generated = 1
        if r not in w.running:  # arrived by hand-off
            w.running.append(r)
        if r.generated >= r.tr.output_length:
            self.finish(w, r)
            return
        w.kv_tokens += r.tr.input_length + r.generated

    def handoff(self, r: SimRequest) -> None:
        w = self.workers[r.decode_w]
        w.incoming -= 1
        r.total_blocks = -(-(r.tr.input_length + r.tr.output_length) // self.bs)
        r.private = r.total_blocks
        r.done = r.uncached  # the prompt's KV arrived: nothing to compute here
        w.private += r.private
        w.evict()
        self.start_decode(w, r)
        self.join(w)
        if w.draining:  # a one-token request ends on arrival
            self.elastic.maybe_retire(w)

    def finish(self, w: SimWorker, r: SimRequest) -> None:
        w.running.remove(r)
        w.release(r)
        if r.generated > 1 or r.tr.output_length > 1:
            w.kv_tokens -= r.tr.input_length + r.generated
        r.generated = r.tr.output_length
        self.done.append((r, self.now))
        if self.window is not None:   # its dispatch slot goes to the gate's next
            self.dispatched_at[r.priority] -= 1
            self._pump()

    def stale(self, kind: int, data) -> bool:
        """A step event replaced by a shorter one (``join``)."""
        return kind == _STEP and data[1] != self.workers[data[0]].gen

    def run(self) -> None:
        if self.trace:
            self.push(self.trace[0].arrival_s, _ARRIVAL, 0)
        if self.elastic is not None:
            self.elastic.start()
        with progress.bar(len(self.trace), "simulating", "req") as shown:
            self._run_events(shown)

    def _run_events(self, shown) -> None:
        while self.events:
            t, kind, _, data = heapq.heappop(self.events)
            if self.stale(kind, data):
                continue
            self.now = t
            if kind < START:
                self.last_work_s = t
            if kind == _ARRIVAL:
                shown.update(1)
                if data + 1 < len(self.trace):
                    self.push(self.trace[data + 1].arrival_s, _ARRIVAL, data + 1)
                self.arrive(self.trace[data], data)
            elif kind == _STEP:
                self.step_done(*data)
            elif kind == _HANDOFF:
                self.handoff(data)
            else:
                self.elastic.on_event(kind, data)
