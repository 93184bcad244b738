"""Token-budget scheduler: continuous batching with chunked prefill and preemption by recompute.

Each step spends at most ``max_num_batched_tokens`` tokens. Running requests go first, in arrival order,
each advancing ``num_computed_tokens`` by up to its remaining tokens (1 for a decode, a chunk for a prefill);
then waiting requests are admitted (prefix-cache hit first) while budget, blocks and ``max_num_seqs``
allow. There are no prefill/decode phases: only token counts.

A waiting request with a ``reimport`` (blocks pulled from the cache tier) has them published again right before
each admission attempt, until it is admitted: an import leaves free cached blocks, which other requests'
allocations may evict while it waits (sliding-window pools are small), and without this it would recompute.

When a running request cannot get a block, the most recently admitted running request is preempted: its
blocks are freed (hashed ones stay cached), ``num_computed_tokens`` returns to 0, and it goes to the front of
the waiting queue to be recomputed later (its output tokens are kept: recompute reproduces their KV).

A victim's KV may be offered to the cache tier before its blocks are freed (``preempted_kv``, the KV port's
``PreemptedKV``, when a worker enabled it): the victim then *awaits* it, and when it is next to be admitted
(head of ``waiting``, a seat free) admission holds there — running requests keep stepping — until its blocks are
pulled back (``PreemptedKV.resume`` sets its ``reimport``) or ``resume_wait_s`` has passed since it was wanted
(then it recomputes).

Policies (vLLM's): ``fcfs`` as above. ``priority``: ``waiting`` and ``running`` are kept in (``params.priority``,
arrival) order — lower priority values first, arrival order within one — so the token budget goes to the
highest class first and the preemption victim is the lowest-priority, latest-arrived running request; a waiting
request that finds no room — no KV, or no seat among ``max_num_seqs`` — preempts running requests of a strictly
lower priority (lowest first, taking back their budget if they were scheduled this step) until it fits. With every priority equal it schedules exactly as
``fcfs`` does (``tests/unit/test_priority_scheduling.py``).
"""
from __future__ import annotations

import logging
import time
import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from shared.engine.kv_manager import KVManager
from shared.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) run this step

    @property
    def samples(self) -> bool:
        """True when this step completes the known tokens (and any drafted ones), so a next token is sampled
        (for a speculating request: its drafts are verified)."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens_with_spec


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: KVManager, max_num_batched_tokens: int,
                 max_num_seqs: int, policy: str = "fcfs") -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.by_priority = policy == "priority"
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._arrivals = itertools.count()
        self._key: dict[str, tuple[int, int]] = {}   # request id -> (priority, arrival), while queued or running
        self.preempted_kv = None   # PreemptedKV (offer / wanted / gone / gave_up hooks), set by the engine

    def key(self, request: Request) -> tuple[int, int]:
        """The request's place under the priority policy: (priority, arrival order)."""
        rid = request.request_id
        if rid not in self._key:
            self._key[rid] = (request.params.priority, next(self._arrivals))
        return self._key[rid]

    def _insert(self, queue, request: Request) -> None:
        """Put ``request`` in ``queue`` (waiting or running) at its priority place."""
        keys = [self.key(r) for r in queue]
        queue.insert(bisect.bisect_right(keys, self.key(request)), request)

    def add(self, request: Request) -> None:
        self.key(request)
        if self.by_priority:
            self._insert(self.waiting, request)
        else:
            self.waiting.append(request)

    def has_seat(self) -> bool:
        """Whether one more request may run now (``max_num_seqs``)."""
        return len(self.running) < self.max_num_seqs

    def join_running(self, request: Request) -> None:
        """Put a request whose KV is in place (imported, or reattached) straight into the running batch."""
        if self.by_priority:
            self._insert(self.running, request)
        else:
            self.key(request)
            self.running.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request, free_blocks: bool = True) -> None:
        """Take a request out of the queues; free its blocks unless the caller holds them for a hand-off."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.preempted_kv is not None:
            self.preempted_kv.gone(request)
        if free_blocks:
            self.bm.free(request.request_id)
        self._key.pop(request.request_id, None)

    def _preempt(self, victim: Request) -> None:
        if self.preempted_kv is not None:
            self.preempted_kv.offer(victim)   # its blocks are still allocated here
        self.bm.free(victim.request_id)
        victim.spec_token_ids, victim.spec_features = [], []
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.stats.num_preemptions += 1
        if self.by_priority:
            self._insert(self.waiting, victim)   # before later arrivals of its priority
        else:
            self.waiting.appendleft(victim)
        logger.debug("preempted %s (recompute %d tokens)", victim.request_id, victim.num_tokens)

    def _fit_spec(self, req: Request, budget: int) -> int:
        """Tokens to run for a running request: its pending ones plus the drafts that fit the budget and the
        free blocks (drafts are dropped before anyone is preempted for them)."""
        pending = req.num_tokens - req.num_computed_tokens
        if req.spec_token_ids:
            keep = max(0, min(len(req.spec_token_ids), budget - pending))
            total = req.num_computed_tokens + pending + keep
            if not self.bm.has_room(req, total):
                keep = 0
            req.spec_token_ids, req.spec_features = req.spec_token_ids[:keep], req.spec_features[:keep]
        return min(pending + len(req.spec_token_ids), budget)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._fit_spec(req, budget)
            while self.bm.allocate_slots(req, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing after it can run either
        if out.preempted:
            return out  # memory is tight: admit nobody this step
        now = time.perf_counter()
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if len(self.running) >= self.max_num_seqs:   # no seat: only a more urgent request takes one back
                if not (self.by_priority and self._preempt_for(req, out)):
                    break
                budget = self.max_num_batched_tokens - out.num_batched_tokens
                continue
            if req.reimport is not None:
                req.reimport()
            # prompt logprobs need every prompt position's logits: no cached prefix
            hits, num_cached = (([], 0) if req.params.prompt_logprobs is not None
                                else self.bm.get_computed_blocks(req))
            if req.resume_wait_s and self._awaits_kv(req, num_cached):
                break
            num_new = min(req.num_tokens - num_cached, budget)
            if self.bm.allocate_slots(req, num_new, hits) is None:
                if not (self.by_priority and self._preempt_for(req, out)):
                    break
                budget = self.max_num_batched_tokens - out.num_batched_tokens
                continue   # look the hit up again: the victims' freed blocks may have evicted part of it
            self.waiting.popleft()
            if (req.reimport is not None or req.resume_wait_s) and self.preempted_kv is not None:
                self.preempted_kv.admitted(req)
            req.reimport = None
            req.num_computed_tokens = num_cached
            if req.stats.first_scheduled_time is None:
                req.stats.first_scheduled_time = now
                req.stats.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if self.by_priority:
                self._insert(self.running, req)
            else:
                self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return out

    def _awaits_kv(self, req: Request, num_cached: int) -> bool:
        """Whether admission holds at ``req``, a preempted request next to be admitted whose KV was offered to the
        cache tier and whose prefix lookup found ``num_cached`` tokens: not when that covers all it offered (it is
        admitted as it is, if it fits); else while its blocks come back (asked for now if they were not yet; given
        up ``resume_wait_s`` after that)."""
        pk = self.preempted_kv
        if num_cached >= pk.offered_tokens(req):
            return False
        if not req.resume_wanted_at:
            pk.wanted(req)
            return True
        if time.monotonic() - req.resume_wanted_at < req.resume_wait_s:
            return True
        pk.gave_up(req)
        return False

    def _preempt_for(self, req: Request, out: SchedulerOutput) -> bool:
        """Priority policy: preempt the lowest-priority running request if its priority is strictly lower than
        ``req``'s (a request scheduled this step leaves the step); False when there is none."""
        if not self.running or self.key(self.running[-1])[0] <= self.key(req)[0]:
            return False
        victim = self.running.pop()
        if any(s.request is victim for s in out.scheduled):   # its blocks for this step were published unwritten
            out.scheduled = [s for s in out.scheduled if s.request is not victim]
            self.bm.withdraw_uncomputed(victim, victim.num_computed_tokens)
        self._preempt(victim)
        out.preempted.append(victim.request_id)
        return True
