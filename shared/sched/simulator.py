"""Discrete-event cluster simulator: replays a Mooncake-format trace through the SAME placement policies.

Each worker has a KV cache of ``kv_capacity_blocks`` blocks (a block is a trace hash id, 512 tokens), LRU
eviction of unreferenced blocks, a FIFO prefill queue (chunked prefill, one request at a time, mixed with
decode) and continuous batched decode. An optional shared cache tier (``sim_tier.SimTier``: the block
store's DRAM + SSD model with retention classes) serves prefixes at the profile's tier bandwidths: a
placement sees its prefix as ``remote_overlap`` at the mean pull cost of the blocks it would serve, a request
pulls the tier blocks beyond its worker's own prefix when admitted, and every block of a request is written
into the tier (with the run's retention class) once its prefill completes. No wall clock: same inputs and
seed, same output.
"""
from __future__ import annotations

import dataclasses
import heapq
import inspect
import math

from shared.accounting import Prices
from shared.kv.store.retention import RetentionPolicy
from shared.sched.placement import place_request
from shared.sched.policies import make_policy
from shared.sched.profiles import Profile, get_profile
from shared.sched.sim_metrics import (account, distinct_blocks, format_table, ideal_hit_rate, json_line,
                                      plot_ttft_cdf, served_metrics)
from shared.sched.sim_state import _Req, _Worker
from shared.sched.sim_tier import SimTier
from shared.sched.trace import TraceRequest, load_trace
from shared.sched.types import ClusterView, Placement, RequestInfo, WorkerView

__all__ = ["TraceRequest", "load_trace", "simulate", "format_table", "json_line", "plot_ttft_cdf",
           "ideal_hit_rate", "distinct_blocks"]
_STEP, _HANDOFF, _ARRIVAL = 0, 1, 2  # event kinds; equal times: finish work before taking new arrivals


class _Sim:
    def __init__(self, trace, policy, profile: Profile, num_workers: int, prefill_workers: int,
                 kv_capacity_blocks: int, ttft_slo_s: float | None, tier: SimTier, retention: str,
                 block_size: int):
        self.trace, self.policy, self.p, self.bs = trace, policy, profile, block_size
        self.ttft_slo = ttft_slo_s
        roles = ["prefill"] * prefill_workers + (["decode"] if prefill_workers else ["both"]) * num_workers
        self.workers = [_Worker(i, role, kv_capacity_blocks) for i, role in enumerate(roles)]
        self.by_id = {w.wid: w for w in self.workers}
        self.tier, self.retention = tier, retention
        self.tier_hits = {"dram": 0, "ssd": 0}  # blocks pulled from each tier
        self.cost = profile.cost_model(block_size)
        self.block_s = profile.block_transfer_s(block_size)
        self.events: list = []
        self.seq = 0
        self.handoffs: list[float] = []
        self.next_arrival = 0
        self.rejected = 0
        self.done: list[_Req] = []
        self.hit_blocks = self.local_blocks = self.total_blocks = 0
        self.now = 0.0

    def push(self, t: float, kind: int, data) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, data))

    # --- arrivals ---------------------------------------------------------------------------------------
    def view(self, tr: TraceRequest) -> ClusterView:
        views, overlap = [], {}
        for w in self.workers:
            used = len(w.pinned) + w.private
            views.append(WorkerView(w.wid, w.role, len(w.running), len(w.queue),
                                    w.queued_tokens + w.prefill_left, max(0, w.cap - used), w.cap, self.bs))
            overlap[w.wid] = w.prefix(tr.hash_ids)
        pre = tuple(v for v in views if v.role in ("prefill", "both"))
        dec = tuple(v for v in views if v.role == "decode")
        if not self.tier.enabled:
            return ClusterView(pre, dec, overlap, 0, self.cost)
        held = self.tier.prefix(tr.hash_ids, self.now)
        cost = dataclasses.replace(self.cost, block_transfer_s=held.block_s()) if held.blocks else self.cost
        return ClusterView(pre, dec, overlap, held.blocks, cost)

    def arrive(self, tr: TraceRequest) -> None:
        view = self.view(tr)
        info = RequestInfo(f"r{tr.idx}", tr.input_length, tr.hash_ids, tr.output_length, self.ttft_slo)
        placed = place_request(self.policy, info, view)
        if not isinstance(placed, Placement):
            self.rejected += 1
            return
        dw = self.by_id[placed.decode_worker]
        pw = self.by_id[placed.prefill_worker] if placed.prefill_worker else dw
        hit = max(view.overlap[pw.wid], view.remote_overlap)
        r = _Req(tr, dw.idx, max(1, tr.input_length - hit * self.bs))
        pw.queue.append(r)
        pw.queued_tokens += r.est
        self.kick(pw)

    # --- worker steps ------------------------------------------------------------------------------------
    def kick(self, w: _Worker) -> None:
        if not w.busy:
            self.plan(w)

    def admit(self, w: _Worker) -> _Req | None:
        """Move the queue's head into the running batch if its blocks fit (FIFO: a head that does not fit
        waits for running requests to free blocks); None when it must wait."""
        r = w.queue[0]
        hashes = r.tr.hash_ids
        local = w.prefix(hashes)
        decodes_here = w.role != "prefill" and r.decode_w == w.idx
        total = -(-(r.tr.input_length + (r.tr.output_length if decodes_here else 0)) // self.bs)
        total = max(total, len(hashes))
        need = total - local
        newly_pinned = sum(1 for h in hashes[:local] if h not in w.pinned)
        busy_elsewhere = w.pinned or w.private
        if w.cap - (len(w.pinned) + newly_pinned + w.private) < need and busy_elsewhere:
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
        self.hit_blocks += r.hit
        self.local_blocks += local
        self.total_blocks += len(hashes)
        w.running.append(r)
        w.prefill_left += r.uncached
        return r

    def pull(self, r: _Req, local: int) -> None:
        """``r`` (admitted where it holds ``local`` blocks) pulls the tier's blocks beyond them; its first
        prefill chunk pays the pull time."""
        held = self.tier.prefix(r.tr.hash_ids, self.now)
        if held.blocks > local:
            r.hit, r.pull_s = held.blocks, held.pull_s(local)
            r.tier_tokens = held.tokens(local, r.tr.input_length, self.bs)
            for src, n in self.tier.use(r.tr.hash_ids[local:held.blocks], self.retention, self.now).items():
                self.tier_hits[src] += n

    def _chunk_s(self, r: _Req, c: int) -> float:
        ctx = r.tr.input_length - r.uncached + r.done  # tokens already in the KV (prefix + earlier chunks)
        return self.p.chunk_s(ctx, c) + (r.pull_s if r.done == 0 else 0.0)

    def plan(self, w: _Worker) -> None:
        """Schedule the worker's next step exactly as the engine's token-budget scheduler does: running
        requests in admission order (a decode takes 1 token, a prefill the rest of its prompt up to the
        budget; once the budget is spent the rest of the batch waits a step), then queued requests are
        admitted while budget, blocks and ``max_num_seqs`` allow."""
        budget = self.p.chunk_tokens
        chunks: list[tuple[_Req, int]] = []
        decoding: list[_Req] = []
        for r in w.running:
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
            w.busy = False
            return
        w.busy = True
        if chunks:
            dt = max(self.p.prefill_c, self.p.decode_base_s if decodes else 0.0)
            dt += sum(self._chunk_s(r, c) for r, c in chunks)
            if decodes:
                dt += self.p.decode_step_s(decodes, w.kv_tokens) - self.p.decode_base_s
            self.push(self.now + dt, _STEP, (w.idx, 1, chunks, decoding))
            return
        # decode only: advance k steps at once, up to the next finish or the first step boundary after the next
        # event that could change this worker (an arrival or a handoff)
        limit = min(self.trace[self.next_arrival].arrival_s if self.next_arrival < len(self.trace) else math.inf,
                    self.handoffs[0] if self.handoffs else math.inf)
        kmax = min(r.tr.output_length - r.generated for r in decoding)
        t, kv, k = self.now, w.kv_tokens, 0
        while k < kmax:
            t += self.p.decode_step_s(decodes, kv)
            kv += decodes
            k += 1
            if t >= limit:
                break
        self.push(t, _STEP, (w.idx, k, (), decoding))

    def step_done(self, widx: int, k: int, chunks, decoding) -> None:
        """``k`` steps ended: each request in ``decoding`` gained ``k`` tokens, each chunk was computed."""
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
        self.plan(w)

    def prefilled(self, w: _Worker, r: _Req) -> None:
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
            t = self.now + len(hashes) * self.block_s
            heapq.heappush(self.handoffs, t)
            self.push(t, _HANDOFF, r)
            return
        self.start_decode(w, r)

    def start_decode(self, w: _Worker, r: _Req) -> None:
        """The step that finished ``r``'s prompt sampled its first token; it decodes from the next step."""
        r.first_s = self.now
        r.generated = 1
        if r not in w.running:  # arrived by hand-off
            w.running.append(r)
        if r.generated >= r.tr.output_length:
            self.finish(w, r)
            return
        w.kv_tokens += r.tr.input_length + 1

    def handoff(self, r: _Req) -> None:
        heapq.heappop(self.handoffs)
        w = self.workers[r.decode_w]
        r.total_blocks = -(-(r.tr.input_length + r.tr.output_length) // self.bs)
        r.private = r.total_blocks
        r.done = r.uncached  # the prompt's KV arrived: nothing to compute here
        w.private += r.private
        w.evict()
        self.start_decode(w, r)
        self.kick(w)

    def finish(self, w: _Worker, r: _Req) -> None:
        w.running.remove(r)
        w.release(r)
        if r.generated > 1 or r.tr.output_length > 1:
            w.kv_tokens -= r.tr.input_length + r.generated
        r.generated = r.tr.output_length
        self.done.append((r, self.now))

    def run(self) -> None:
        if self.trace:
            self.push(self.trace[0].arrival_s, _ARRIVAL, 0)
        while self.events:
            t, kind, _, data = heapq.heappop(self.events)
            self.now = t
            if kind == _ARRIVAL:
                self.next_arrival = data + 1
                if data + 1 < len(self.trace):
                    self.push(self.trace[data + 1].arrival_s, _ARRIVAL, data + 1)
                self.arrive(self.trace[data])
            elif kind == _STEP:
                self.step_done(*data)
            else:
                self.handoff(data)


def _make_policy(name: str, seed: int):
    from shared.sched.policies import POLICIES
    params = inspect.signature(POLICIES[name]).parameters if name in POLICIES else {}
    return make_policy(name, **({"seed": seed} if "seed" in params else {}))


def simulate(trace: list[TraceRequest], policy_name: str, profile: Profile | str = "llama70b-h200",
             num_workers: int = 8, kv_capacity_blocks: int | None = None, ttft_slo_s: float | None = 2.0,
             tpot_slo_s: float | None = 0.05, cache_tier_blocks: int = 0, seed: int = 0, speed: float = 1.0,
             prefill_workers: int = 0, block_size: int = 512, kv_capacity_frac: float = 0.3,
             prices: Prices | None = None, tier_dram_blocks: int = 0, tier_ssd_blocks: int = 0,
             retention: str = "chat", retention_policy: RetentionPolicy | None = None) -> dict:
    """Replay ``trace`` (already loaded; ``speed`` is recorded, apply it in ``load_trace``) and return metrics.

    ``num_workers`` aggregated workers, or with ``prefill_workers`` > 0: that many prefill workers plus
    ``num_workers`` decode workers. ``kv_capacity_blocks`` is per worker; None: ``kv_capacity_frac`` of the
    trace's distinct blocks spread over the workers. The cache tier holds ``tier_dram_blocks`` in DRAM and
    ``tier_ssd_blocks`` on SSD (both 0: no tier); ``cache_tier_blocks`` is the older name of a DRAM-only tier
    (same as ``tier_dram_blocks``). Every request has retention class ``retention`` of ``retention_policy``
    (default: chat 7 d, agent 3 d, none 0) and tenant ``default`` in the ``accounting`` ledger.
    """
    if cache_tier_blocks and tier_dram_blocks:
        raise ValueError("give cache_tier_blocks (a DRAM-only tier) or tier_dram_blocks, not both")
    tier_dram_blocks = tier_dram_blocks or cache_tier_blocks
    prof = get_profile(profile) if isinstance(profile, str) else profile
    retention_policy = retention_policy or RetentionPolicy()
    retention_policy.ttl(retention)  # an unknown class raises invalid_request
    tier = SimTier(tier_dram_blocks, tier_ssd_blocks, retention_policy, prof.tier_block_s("dram", block_size),
                   prof.tier_block_s("ssd", block_size))
    ndist = distinct_blocks(trace)
    if kv_capacity_blocks is None:
        kv_capacity_blocks = max(1, math.ceil(kv_capacity_frac * ndist / (num_workers + prefill_workers)))
    sim = _Sim(trace, _make_policy(policy_name, seed), prof, num_workers, prefill_workers, kv_capacity_blocks,
               ttft_slo_s, tier, retention, block_size)
    sim.run()
    served, ledger = account(sim.done, block_size, retention, prices or Prices())
    start = trace[0].arrival_s if trace else 0.0
    makespan = max([end for _, end in sim.done] + [sim.now]) - start if trace else 0.0
    res = {
        "policy": policy_name, "profile": prof.name, "workers": num_workers, "prefill_workers": prefill_workers,
        "kv_capacity_blocks": kv_capacity_blocks, "tier_dram_blocks": tier_dram_blocks,
        "tier_ssd_blocks": tier_ssd_blocks, "retention": retention, "seed": seed, "speed": speed,
        "ttft_slo_s": ttft_slo_s, "tpot_slo_s": tpot_slo_s, "requests": len(trace), "served": len(sim.done),
        "rejected": sim.rejected, "distinct_blocks": ndist,
        **served_metrics(served, len(trace), makespan, ttft_slo_s, tpot_slo_s),
    }
    ideal = ideal_hit_rate(trace)
    hit = sim.hit_blocks / sim.total_blocks if sim.total_blocks else 0.0
    gpu_hours = len(sim.workers) * prof.gpus_per_worker * makespan / 3600.0
    revenue = ledger.prices.cost(ledger.total.cached_tokens, ledger.total.uncached_tokens, ledger.total.output_tokens)
    res.update({
        "hit_rate": round(hit, 6), "local_hit_rate": round(sim.local_blocks / max(1, sim.total_blocks), 6),
        "ideal_hit_rate": round(ideal, 6), "hit_vs_ideal": round(hit / ideal, 6) if ideal else None,
        "tier_hit_blocks": dict(sim.tier_hits), "tier": tier.counters() if tier.enabled else {},
        "gpu_hours": round(gpu_hours, 6), "revenue": round(revenue, 6),
        "revenue_per_gpu_hour": round(revenue / gpu_hours, 6) if gpu_hours else 0.0,
        "accounting": ledger.as_dict(),
    })
    return res
