"""Placement policies: ``place(request, view) -> Placement | Reject``, pure and deterministic.

- ``round_robin``: cycle through workers (the sanity baseline).
- ``least_loaded``: shortest queue for prefill, most KV headroom for decode.
- ``cache_aware``: SGLang router's rule. If the load spread exceeds both an absolute and a relative threshold,
  go to the shortest queue; else to the best prefix match if its match rate is above a threshold, else to the
  worker with the most free cache.
- ``kv_cost``: Dynamo's KV router cost: ``w * (prefill blocks left after overlap credit + queued prefill
  blocks) + (active decode blocks + this request's blocks)``, argmin (or a softmax sample at temperature > 0
  from a seeded generator).
- ``predictive`` (default): predicted TTFT = queue wait + prefill time of the uncached tokens + time to pull
  blocks held in a slower tier, per prefill candidate, plus half the prefill time it spends (work that
  delays the requests queued behind it); decode worker by KV headroom then active sequences;
  prefill locally on the decode worker when that is predicted no slower; reject when even the best
  prediction misses the request's TTFT SLO.
"""
from __future__ import annotations

import math
import random
from typing import Protocol

from services.router.policy.types import ClusterView, Placement, Reject, RequestInfo, WorkerView


class Policy(Protocol):
    name: str

    def place(self, request: RequestInfo, view: ClusterView) -> Placement | Reject: ...


def _load(w: WorkerView) -> int:
    return w.num_running + w.num_waiting


def _blocks(request: RequestInfo, w: WorkerView) -> int:
    return -(-(request.num_prompt_tokens + request.max_tokens) // w.block_size)


def _pick_decode(request: RequestInfo, decode: tuple[WorkerView, ...]) -> WorkerView:
    """Among workers with KV room for the request: fewest active sequences (running + waiting), then most
    KV headroom."""
    fits = [w for w in decode if w.num_free_blocks >= _blocks(request, w)] or list(decode)
    return min(fits, key=lambda w: (_load(w), -w.num_free_blocks, w.worker_id))


def _finish(request: RequestInfo, view: ClusterView, prefill: WorkerView, reason: str,
            ttft: float | None = None) -> Placement | Reject:
    """Pair a chosen prefill worker with a decode worker (itself when aggregated or already a decode)."""
    if prefill.role != "prefill" or not view.decode:
        return Placement(prefill.worker_id, None, ttft, reason)
    return Placement(_pick_decode(request, view.decode).worker_id, prefill.worker_id, ttft, reason)


def _no_workers() -> Reject:
    return Reject("unavailable: no live workers")


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def place(self, request: RequestInfo, view: ClusterView) -> Placement | Reject:
        workers = sorted(view.prefill or view.decode, key=lambda w: w.worker_id)
        if not workers:
            return _no_workers()
        chosen = workers[self._next % len(workers)]
        self._next += 1
        if chosen.role != "prefill" or not view.decode:
            return Placement(chosen.worker_id, None, None, "round robin")
        decode = sorted(view.decode, key=lambda w: w.worker_id)
        return Placement(decode[(self._next - 1) % len(decode)].worker_id, chosen.worker_id, None, "round robin")


class LeastLoaded:
    name = "least_loaded"

    def place(self, request: RequestInfo, view: ClusterView) -> Placement | Reject:
        if not (view.prefill or view.decode):
            return _no_workers()
        chosen = min(view.prefill or view.decode,
                     key=lambda w: (w.queued_prefill_tokens, _load(w), w.worker_id))
        return _finish(request, view, chosen, "least loaded")


class CacheAware:
    name = "cache_aware"

    def __init__(self, balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.0001,
                 cache_threshold: float = 0.5) -> None:
        self.abs_t, self.rel_t, self.cache_t = balance_abs_threshold, balance_rel_threshold, cache_threshold

    def place(self, request: RequestInfo, view: ClusterView) -> Placement | Reject:
        workers = view.prefill or view.decode
        if not workers:
            return _no_workers()
        loads = [_load(w) for w in workers]
        if max(loads) - min(loads) > self.abs_t and max(loads) > self.rel_t * min(loads):
            chosen = min(workers, key=lambda w: (_load(w), w.worker_id))
            return _finish(request, view, chosen, "imbalanced: shortest queue")
        n = max(1, len(request.block_hashes))
        best = min(workers, key=lambda w: (-view.overlap.get(w.worker_id, 0), _load(w), w.worker_id))
        if view.overlap.get(best.worker_id, 0) / n > self.cache_t:
            return _finish(request, view, best, "best prefix match")
        chosen = min(workers, key=lambda w: (-w.num_free_blocks, _load(w), w.worker_id))
        return _finish(request, view, chosen, "low match: most free cache")


class KvCost:
    name = "kv_cost"

    def __init__(self, overlap_weight: float = 1.0, temperature: float = 0.0, seed: int = 0) -> None:
        self.overlap_weight, self.temperature = overlap_weight, temperature
        self._rng = random.Random(seed)

    def cost(self, request: RequestInfo, view: ClusterView, w: WorkerView) -> float:
        prompt_blocks = -(-request.num_prompt_tokens // w.block_size)
        prefill_blocks = prompt_blocks - view.overlap.get(w.worker_id, 0) + w.queued_prefill_tokens / w.block_size
        active_blocks = (w.num_total_blocks - w.num_free_blocks) + _blocks(request, w)
        return self.overlap_weight * prefill_blocks + active_blocks

    def place(self, request: RequestInfo, view: ClusterView) -> Placement | Reject:
        workers = sorted(view.prefill or view.decode, key=lambda w: w.worker_id)
        if not workers:
            return _no_workers()
        costs = [self.cost(request, view, w) for w in workers]
        if self.temperature <= 0:
            chosen = workers[min(range(len(workers)), key=lambda i: (costs[i], i))]
        else:  # softmax over normalised negative costs
            lo, hi = min(costs), max(costs)
            span = (hi - lo) or 1.0
            weights = [math.exp(-(c - lo) / span / self.temperature) for c in costs]
            chosen = self._rng.choices(workers, weights=weights)[0]
        return _finish(request, view, chosen, "kv cost")


class Predictive:
    name = "predictive"
    decides_prefill_site = True  # weighs local prefill itself (services/router/policy/placement.py defers to it)

    def __init__(self, local_prefill_tokens: int = 64, work_weight: float = 0.5) -> None:
        self.local_prefill_tokens = local_prefill_tokens
        self.work_weight = work_weight

    def estimate(self, request: RequestInfo, view: ClusterView, w: WorkerView) -> tuple[float, float]:
        """(predicted TTFT, score) on ``w``. TTFT = queue wait + prefill of the uncached tokens + pulling blocks
        held only in a slower tier. Score = TTFT + ``work_weight`` x the prefill time this placement spends:
        recomputing a prefix another worker holds delays every request queued behind it there and duplicates
        its blocks, a cost the request's own TTFT does not see (0.5: the best goodput of a sweep over 0..2 on
        the Mooncake trace)."""
        own = view.overlap.get(w.worker_id, 0)
        uncached = max(1, request.num_prompt_tokens - max(own, view.remote_overlap) * w.block_size)
        pull = max(0, view.remote_overlap - own) * view.cost.block_transfer_s
        work = view.cost.prefill_s(uncached)
        ttft = view.cost.prefill_s(w.queued_prefill_tokens) + work + pull
        return ttft, ttft + self.work_weight * work

    def ttft(self, request: RequestInfo, view: ClusterView, w: WorkerView) -> float:
        return self.estimate(request, view, w)[0]

    def place(self, request: RequestInfo, view: ClusterView) -> Placement | Reject:
        candidates = view.prefill or view.decode
        if not candidates:
            return _no_workers()
        best_key, best, best_ttft = None, candidates[0], 0.0
        for w in candidates:
            ttft, score = self.estimate(request, view, w)
            key = (score, _load(w), w.worker_id)
            if best_key is None or key < best_key:
                best_key, best, best_ttft = key, w, ttft
        placement = _finish(request, view, best, "predicted TTFT", best_ttft)
        if placement.prefill_worker is not None:  # disaggregated: is prefilling on the decode worker better?
            decode = next(w for w in view.decode if w.worker_id == placement.decode_worker)
            local = self.ttft(request, view, decode)
            handoff = -(-request.num_prompt_tokens // best.block_size) * view.cost.block_transfer_s
            idle = _load(decode) == 0 and decode.queued_prefill_tokens == 0
            # local prefill stalls every sequence decoding there: only for short prompts, on an idle decode
            # worker when it is no slower, or when it is strictly faster than the best prefill worker
            if (request.num_prompt_tokens <= self.local_prefill_tokens or (idle and local <= best_ttft + handoff)
                    or local < best_ttft):
                placement = Placement(decode.worker_id, None, local, "local prefill predicted no slower")
                best_ttft = local
        if request.ttft_slo_s is not None and best_ttft > request.ttft_slo_s:
            chosen_id = placement.prefill_worker or placement.decode_worker
            chosen = next(w for w in (*view.prefill, *view.decode) if w.worker_id == chosen_id)
            busy = sum(1 for w in candidates if w.queued_prefill_tokens > 0)
            # shed load only: a request that is merely long is served on an idle worker while the cluster is
            # lightly loaded, so its blocks warm the cache for the conversation's next turns
            if chosen.queued_prefill_tokens > 0 or 2 * busy >= len(candidates):
                return Reject(f"overloaded: predicted TTFT {best_ttft:.3f} s exceeds the SLO "
                              f"{request.ttft_slo_s:.3f} s", best_ttft)
        return placement


POLICIES = {p.name: p for p in (RoundRobin, LeastLoaded, CacheAware, KvCost, Predictive)}


def make_policy(name: str, **kwargs) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)
