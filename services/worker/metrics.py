"""Prefill and decode workers' metrics (``deepinfer_worker_*``), every series labelled ``worker`` and ``role``.

Two kinds, one registry per worker:
- Events the worker reports as they happen (``request_started`` … ``request_ended``, ``output``,
  ``prompt_done``, ``handoff``): requests by outcome, TTFT / TPOT / E2E histograms, prompt and generated
  tokens, KV hand-off bytes and seconds by transport and direction.
- Figures read at scrape time from what the worker already counts (``WorkerCollector``): the engine's load
  (running / waiting sequences, KV blocks), the prefix cache's query / hit tokens, preemptions, the cache-tier
  client's counters, speculative decoding's counters, handler errors. Nothing is counted twice.
- The same figures under vLLM's names (``services/worker/vllm_metrics.py``), labelled ``model_name``.

Invariants: every request ``request_started`` saw is counted exactly once by ``request_ended`` under one
outcome (``finished``, ``handed_off`` for a prefill whose KV went to a decode worker, ``migrated`` for a decode
stream moved to another decode worker, ``cancelled``, or the
error code that ended it); TTFT is observed only by the worker that streamed seq 0 (the prefill worker, or a
decode worker prefilling locally), from the request's arrival at this worker; E2E only by the worker that sent
the final chunk of a finished request (worker-local: a hand-off's E2E excludes the prefill); TPOT is the
engine's mean gap between output tokens on that worker. Hit rate = ``prefix_cache_hit_tokens_total /
prefix_cache_query_tokens_total``; the part of prompts served from caches = ``prompt_cached_tokens_total /
prompt_tokens_total`` (prompt tokens counted where they are prefilled, never on a hand-off's decode side).
"""
from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from shared.metrics.common import (E2E_BUCKETS, OUTCOME_FINISHED, TPOT_BUCKETS, TRANSFER_BUCKETS, TTFT_BUCKETS,
                                   BoundedLabel, counter, counter_by, error_counts, gauge, gauge_by, new_registry,
                                   outcome_label)
from services.worker.vllm_metrics import VllmRequestMetrics, vllm_engine_metrics

P = "deepinfer_worker"
OUTCOME_HANDED_OFF = "handed_off"
OUTCOME_MIGRATED = "migrated"  # a decode worker's running stream moved to another decode worker
FINISH_REASONS = ("stop", "length")  # an engine output finished with these is a served request


class WorkerMetrics:
    def __init__(self, worker_id: str, role: str, registry: CollectorRegistry | None = None,
                 model_name: str = "") -> None:
        self.registry = registry if registry is not None else new_registry()
        self.labels = {"worker": worker_id, "role": role}
        self.vllm_labels = {"model_name": model_name, "worker": worker_id}
        self.vllm = VllmRequestMetrics(self.registry, self.vllm_labels)
        names, r = list(self.labels), self.registry
        self._requests = Counter(f"{P}_requests", "Requests this worker accepted, by how they ended",
                                 [*names, "outcome"], registry=r)
        self.ttft = Histogram(f"{P}_ttft_seconds", "Arrival at this worker to the first token streamed (seq 0)",
                              names, buckets=TTFT_BUCKETS, registry=r).labels(**self.labels)
        self.tpot = Histogram(f"{P}_tpot_seconds", "Mean time per output token after the first, per request",
                              names, buckets=TPOT_BUCKETS, registry=r).labels(**self.labels)
        self.e2e = Histogram(f"{P}_e2e_seconds", "Arrival at this worker to the final chunk of a finished request",
                             names, buckets=E2E_BUCKETS, registry=r).labels(**self.labels)
        self.prompt_tokens = Counter(f"{P}_prompt_tokens", "Prompt tokens of the requests prefilled here",
                                     names, registry=r).labels(**self.labels)
        self.prompt_cached_tokens = Counter(f"{P}_prompt_cached_tokens", "Of the prompt tokens prefilled here, "
                                            "those whose KV came from a cache (device pool or cache tier)",
                                            names, registry=r).labels(**self.labels)
        self.prompt_tier_tokens = Counter(f"{P}_prompt_tier_tokens", "Of the cached prompt tokens, those pulled "
                                          "from the cache tier", names, registry=r).labels(**self.labels)
        self.generation_tokens = Counter(f"{P}_generation_tokens", "Tokens this worker sampled and streamed",
                                         names, registry=r).labels(**self.labels)
        self._handoff_bytes = Counter(f"{P}_kv_handoff_bytes", "KV bytes handed off (sent: prefill side; "
                                      "received: decode side)", [*names, "transport", "direction"], registry=r)
        self._handoff_seconds = Histogram(f"{P}_kv_handoff_seconds", "KV hand-off time (sent: staging until the "
                                          "decode worker acknowledged; received: the fetch)",
                                          [*names, "transport", "direction"], buckets=TRANSFER_BUCKETS, registry=r)
        self._transport = BoundedLabel("transport", cap=8)
        self._started: dict[str, float] = {}  # request id -> arrival (perf_counter), until request_ended

    def watch(self, worker: Any) -> None:
        """Read ``worker``'s own counters at every scrape (see ``WorkerCollector``); call once."""
        self.registry.register(WorkerCollector(worker, self.labels, self.vllm_labels))

    # -- events ------------------------------------------------------------------------------------------
    def request_started(self, request_id: str, now: float | None = None) -> None:
        self._started[request_id] = time.perf_counter() if now is None else now

    def request_ended(self, request_id: str, outcome: str) -> None:
        """Count the request once under ``outcome``; a request never started here is ignored."""
        self.vllm.forget(request_id)
        if self._started.pop(request_id, None) is None:
            return
        label = outcome if outcome in (OUTCOME_HANDED_OFF, OUTCOME_MIGRATED) else outcome_label(outcome)
        self._requests.labels(**self.labels, outcome=label).inc()

    def output(self, request_id: str, seq: int, num_tokens: int, finish_reason: str | None,
               tpot_s: float | None, now: float | None = None) -> None:
        """One chunk streamed by this worker: its tokens; seq 0 → TTFT; a served final chunk → TPOT, E2E."""
        now = time.perf_counter() if now is None else now
        if num_tokens:
            self.generation_tokens.inc(num_tokens)
        start = self._started.get(request_id)
        self.vllm.output(request_id, start, seq, num_tokens, finish_reason, tpot_s, now)
        if start is None:
            return
        if seq == 0:
            self.ttft.observe(max(0.0, now - start))
        if finish_reason in FINISH_REASONS:
            self.e2e.observe(max(0.0, now - start))
            if tpot_s:
                self.tpot.observe(tpot_s)

    def prompt_done(self, prompt_tokens: int, cached_tokens: int, tier_tokens: int) -> None:
        """A prompt prefilled here: its tokens, those served from a cache, those from the cache tier."""
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.vllm.prompt_done(prompt_tokens)
        self.prompt_cached_tokens.inc(max(0, min(cached_tokens, prompt_tokens)))
        self.prompt_tier_tokens.inc(max(0, min(tier_tokens, cached_tokens)))

    def handoff(self, transport: str, direction: str, nbytes: int, seconds: float) -> None:
        """One KV hand-off; ``direction``: ``sent`` (prefill side), ``received`` (decode side) or ``migrated``
        (a decode worker's running stream, sent to another decode worker)."""
        labels = {**self.labels, "transport": self._transport(transport), "direction": direction}
        self._handoff_bytes.labels(**labels).inc(max(0, nbytes))
        self._handoff_seconds.labels(**labels).observe(max(0.0, seconds))

    @property
    def num_tracked(self) -> int:
        return len(self._started)


class WorkerCollector(Collector):
    """Scrape-time figures of a worker (duck-typed: ``aengine``, ``engine``, ``runtime``, ``tier``, ``active``).
    Reads only ints and floats the engine thread writes (racy but safe, as the heartbeat's ``load``); before the
    engine is up it yields nothing."""

    def __init__(self, worker: Any, labels: dict[str, str], vllm_labels: dict[str, str] | None = None) -> None:
        self.worker, self.labels, self.vllm_labels = worker, labels, vllm_labels

    def collect(self):
        w, lb = self.worker, self.labels
        if getattr(w, "aengine", None) is None:
            return
        eng = w.engine
        load, bm = w.aengine.load(), eng.block_manager
        yield gauge(f"{P}_running_sequences", "Sequences in the running batch", lb, load["num_running"])
        yield gauge(f"{P}_waiting_sequences", "Sequences queued for admission", lb, load["num_waiting"])
        yield gauge(f"{P}_queued_prefill_tokens", "Prompt tokens not yet computed", lb, load["queued_prefill_tokens"])
        yield gauge(f"{P}_active_requests", "Requests held by this worker (queued, running or handing off)", lb,
                    len(w.active))
        yield gauge(f"{P}_held_requests", "Finished requests whose KV blocks are still held (write-back, hand-off)",
                    lb, len(eng.kv_port.held))
        free = load["num_free_blocks"]
        yield gauge_by(f"{P}_kv_blocks", "KV cache blocks by state", lb, "state",
                       [("used", bm.num_blocks - free), ("free", free)])
        yield gauge(f"{P}_kv_capacity_blocks", "KV cache blocks in all", lb, bm.num_blocks)
        pools = eng.kv_pools()
        yield gauge_by(f"{P}_kv_pool_blocks", "Blocks of each KV pool (kv; or full and window for sliding-window "
                       "models: the KV budget's split)", lb, "pool", [(p["name"], p["blocks"]) for p in pools])
        yield gauge_by(f"{P}_kv_pool_free_blocks", "Free blocks of each KV pool (cached ones included)", lb, "pool",
                       [(p["name"], p["free"]) for p in pools])
        yield gauge_by(f"{P}_kv_pool_block_bytes", "Bytes of one block of each KV pool (all its layers)", lb, "pool",
                       [(p["name"], p["block_bytes"]) for p in pools])
        yield gauge(f"{P}_kv_block_size_tokens", "Tokens per KV block", lb, bm.block_size)
        yield gauge(f"{P}_kv_usage_ratio", "Fraction of KV blocks in use", lb, load["kv_usage"])
        yield gauge(f"{P}_prefix_cache_blocks", "Blocks the prefix cache can hit (in use or free)", lb,
                    len(bm.cached))
        yield counter(f"{P}_prefix_cache_query_tokens", "Tokens looked up in the prefix cache", lb,
                      bm.num_query_tokens)
        yield counter(f"{P}_prefix_cache_hit_tokens", "Tokens found in the prefix cache", lb, bm.num_hit_tokens)
        yield counter(f"{P}_preemptions", "Sequences preempted (resumed from the cache tier or recomputed later)",
                      lb, eng.num_preemptions)
        if eng.kv_port.preempted.enabled:
            pc = eng.kv_port.preempted.counters
            yield counter_by(f"{P}_preempted_kv", "Preempted sequences whose KV was offered to the cache tier, by "
                             "how they resumed (not_offered: over preempt_offer_mib; kept: the device cache still "
                             "held it all)", lb, "result",
                             [("offered", pc.offers), ("not_offered", pc.not_offered), ("kept", pc.kept), ("resumed", pc.resumed),
                              ("recomputed", pc.recomputed)])
            yield counter(f"{P}_preempted_kv_resumed_blocks", "Blocks preempted sequences found again in their "
                          "prefix lookup, pulled back from the cache tier", lb, pc.resumed_blocks)
        if self.vllm_labels is not None:
            yield from vllm_engine_metrics(self.vllm_labels, load, bm, eng.num_preemptions)
        load_of = getattr(eng.model, "expert_load", None)
        if load_of is not None:   # an MoE model: tokens routed to each expert of each MoE layer
            family = CounterMetricFamily(f"{P}_moe_expert_tokens", "Tokens routed to each expert, by MoE layer "
                                         "(the load an expert balancer needs)", labels=[*lb, "layer", "expert"])
            for layer, counts in load_of().items():
                for expert, n in enumerate(counts):
                    family.add_metric([*lb.values(), str(layer), str(expert)], n)
            yield family
        rt = getattr(w, "runtime", None)
        if rt is not None:
            yield gauge(f"{P}_draining", "1 while the worker drains (SIGTERM, or a role switch)", lb,
                        int(rt.draining))
            yield gauge_by(f"{P}_serving_role", "1 for the role the worker serves now (a switchable worker's "
                           "changes)", lb, "serving", [(rt.info.role, 1)])
            yield counter(f"{P}_role_switches", "Role switches made (switchable workers)", lb,
                          getattr(w, "role_switches", 0))
            yield error_counts(P, lb, rt.error_counts)
        if getattr(w, "tier", None) is not None:
            yield from tier_client_metrics(lb, w.tier)
        if eng.speculator is not None:
            yield from speculative_metrics(lb, eng.speculator)


def tier_client_metrics(lb: dict[str, str], tier: Any):
    """The worker's cache-tier client (``services/worker/tier_client.py``: ``TierCounters``)."""
    c = tier.counters
    yield gauge(f"{P}_tier_up", "1 while the worker's cache tier heartbeats", lb, int(tier.alive))
    yield counter_by(f"{P}_tier_pulls", "Pulls of missing prompt blocks from the cache tier, by result", lb,
                     "result", [("hit", c.pull_hits), ("miss", max(0, c.pulls - c.pull_hits - c.pull_failures)),
                                ("failed", c.pull_failures)])
    yield counter(f"{P}_tier_pulled_blocks", "Blocks pulled from the cache tier", lb, c.blocks_pulled)
    yield gauge(f"{P}_tier_block_pull_seconds", "Moving average of seconds per block pulled", lb, c.block_pull_s)
    yield counter_by(f"{P}_tier_writebacks", "Write-backs to the cache tier, by result", lb, "result",
                     [("ok", c.writes), ("failed", c.write_failures), ("dropped", c.writes_dropped)])
    yield counter(f"{P}_tier_written_blocks", "Blocks written back to the cache tier", lb, c.blocks_written)
    yield gauge(f"{P}_tier_write_queue", "Write-backs staged and waiting for the tier", lb, tier.stats()["queued"])


def speculative_metrics(lb: dict[str, str], spec: Any):
    """Speculative decoding (``shared/engine/speculator.py``: ``SpecCounters``; a remote drafter's errors)."""
    c = spec.counters
    yield counter(f"{P}_spec_steps", "Engine steps that verified at least one proposal", lb, c.steps)
    yield counter(f"{P}_spec_proposals", "Sequence-steps with a verified proposal", lb, c.proposals)
    yield counter(f"{P}_spec_drafted_tokens", "Drafted tokens verified by the target model", lb, c.drafted)
    yield counter(f"{P}_spec_accepted_tokens", "Drafted tokens accepted", lb, c.accepted)
    yield counter(f"{P}_spec_emitted_tokens", "Tokens appended by verified sequence-steps (accepted + 1 each)",
                  lb, c.emitted)
    errors = [("drafter", c.drafter_errors)]
    drafter = spec.drafter
    if hasattr(drafter, "timeouts"):  # RemoteDrafter: the draft service was slow or failed
        errors += [("timeout", drafter.timeouts), ("remote", drafter.failures),
                   ("breaker_open", drafter.breaker.skipped)]
    yield counter_by(f"{P}_spec_draft_errors", "Steps that decoded without speculation, by cause", lb, "cause",
                     errors)
    if hasattr(drafter, "waited_s"):
        yield counter(f"{P}_spec_draft_wait_seconds", "Engine-thread time spent waiting for the draft service", lb,
                      drafter.waited_s)


__all__ = ["OUTCOME_FINISHED", "OUTCOME_HANDED_OFF", "OUTCOME_MIGRATED", "WorkerCollector", "WorkerMetrics"]
