"""Discrete-event cluster simulator: replays a Mooncake-format trace through the SAME placement policies.

Each worker has a KV cache of ``kv_capacity_blocks`` blocks (a block is a trace hash id, 512 tokens), LRU
eviction of unreferenced blocks, a FIFO prefill queue (chunked prefill, one request at a time, mixed with
decode) and continuous batched decode (``simulator/core.py``). An optional shared cache tier
(``sim_tier.SimTier``: the block store's DRAM + SSD model with retention classes) serves prefixes at the
profile's tier bandwidths: a placement sees its prefix as ``remote_overlap`` at the mean pull cost of the blocks
it would serve, a request pulls the tier blocks beyond its worker's own prefix when admitted, and every block of
a request is written into the tier (with the run's retention class) once its prefill completes. A disaggregated
cluster may be elastic (``sim_elastic.Elastic``): live migration of decode streams and the online P:D planner,
the router's own policies run on a simulated tick. No wall clock: same inputs and seed, same output.
"""
from __future__ import annotations

import inspect
import math
import time

from shared.accounting import Prices
from shared.retention import RetentionPolicy
from services.router.policy.migration_policy import MigrationConfig
from services.router.policy.pd_planner import PlannerConfig
from services.router.policy.policies import make_policy
from services.router.policy.profiles import Profile, get_profile
from simulator.economics import Economics
from simulator.elastic import Elastic
from simulator.core import Simulation
from simulator.metrics import (account, distinct_blocks, format_table, ideal_hit_rate, json_line,
                                      plot_ttft_cdf, served_metrics)
from simulator.classes import ClassMix, class_metrics
from simulator.tier import SimTier
from simulator.trace import TraceRequest, load_trace

__all__ = ["TraceRequest", "load_trace", "simulate", "format_table", "json_line", "plot_ttft_cdf",
           "ideal_hit_rate", "distinct_blocks", "MigrationConfig", "PlannerConfig"]


def _make_policy(name: str, seed: int):
    from services.router.policy.policies import POLICIES
    params = inspect.signature(POLICIES[name]).parameters if name in POLICIES else {}
    return make_policy(name, **({"seed": seed} if "seed" in params else {}))


def simulate(trace: list[TraceRequest], policy_name: str, profile: Profile | str = "llama70b-h200",
             num_workers: int = 8, kv_capacity_blocks: int | None = None, ttft_slo_s: float | None = 2.0,
             tpot_slo_s: float | None = 0.05, cache_tier_blocks: int = 0, seed: int = 0, speed: float = 1.0,
             prefill_workers: int = 0, block_size: int = 512, kv_capacity_frac: float = 0.3,
             prices: Prices | None = None, tier_dram_blocks: int = 0, tier_ssd_blocks: int = 0,
             retention: str = "chat", retention_policy: RetentionPolicy | None = None,
             migration: MigrationConfig | None = None, planner: PlannerConfig | None = None, tick_s: float = 1.0,
             startup_s: float = 30.0, timings: dict | None = None, economics: Economics | None = None,
             classes: ClassMix | None = None) -> dict:
    """Replay ``trace`` (already loaded; ``speed`` is recorded, apply it in ``load_trace``) and return metrics.

    ``num_workers`` aggregated workers, or with ``prefill_workers`` > 0: that many prefill workers plus
    ``num_workers`` decode workers. ``kv_capacity_blocks`` is per worker; None: ``kv_capacity_frac`` of the
    trace's distinct blocks spread over the workers. The cache tier holds ``tier_dram_blocks`` in DRAM and
    ``tier_ssd_blocks`` on SSD (both 0: no tier); ``cache_tier_blocks`` is the older name of a DRAM-only tier
    (same as ``tier_dram_blocks``). Every request has retention class ``retention`` of ``retention_policy``
    (default: chat 7 d, agent 3 d, none 0) and tenant ``default`` in the ``accounting`` ledger; ``economics``
    (default ``Economics()``: $2 per GPU-hour, prices in dollars) turns the ledger and the GPU-hours into revenue,
    rent and margin (``res["economics"]``, ``simulator/economics.py``).

    ``classes`` (``simulator/classes.py``): each request drawn a class of the mix (seeded by ``seed``), the
    router's dispatch window modelled (on and off alike); with the mix on, the gate and the workers order by
    class, a more urgent request takes a seat back, placements are refused on the class's target; the result has
    ``classes`` (per class: requests, served, attainment against its own targets, TTFT percentiles) and
    ``classes_on``.

    Elastic (disaggregated only, else ``ValueError``): ``migration`` runs live migration and ``planner`` the P:D
    planner every ``tick_s`` simulated seconds; a worker the planner adds joins ``startup_s`` after the
    decision. The result then has ``migrations`` (moves, by reason, total pause) and ``planner`` (every
    decision: time, kind, role, reason; counts). ``timings``, if given, receives wall-clock figures (kept out of
    the result, which stays deterministic): ``wall_s``, ``view_s`` and ``place_s`` (in ``place_request``).
    """
    if cache_tier_blocks and tier_dram_blocks:
        raise ValueError("give cache_tier_blocks (a DRAM-only tier) or tier_dram_blocks, not both")
    if (migration is not None or planner is not None) and prefill_workers <= 0:
        raise ValueError("migration and the P:D planner need a disaggregated cluster (prefill_workers > 0)")
    wall0 = time.perf_counter()
    tier_dram_blocks = tier_dram_blocks or cache_tier_blocks
    prof = get_profile(profile) if isinstance(profile, str) else profile
    retention_policy = retention_policy or RetentionPolicy()
    retention_policy.ttl(retention)  # an unknown class raises invalid_request
    tier = SimTier(tier_dram_blocks, tier_ssd_blocks, retention_policy, prof.tier_block_s("dram", block_size),
                   prof.tier_block_s("ssd", block_size))
    ndist = distinct_blocks(trace)
    if kv_capacity_blocks is None:
        kv_capacity_blocks = max(1, math.ceil(kv_capacity_frac * ndist / (num_workers + prefill_workers)))
    assigned = classes.assign(len(trace), seed) if classes is not None else None
    sim = Simulation(trace, _make_policy(policy_name, seed), prof, num_workers, prefill_workers, kv_capacity_blocks,
                     ttft_slo_s, tier, retention, block_size,
                     priorities=None if assigned is None else [classes.priority(c) for c in assigned],
                     ttft_targets=None if assigned is None else [classes.ttft_target(c, ttft_slo_s) for c in assigned],
                     gate=assigned is not None)
    elastic = None
    if migration is not None or planner is not None:
        elastic = Elastic(sim, migration, planner, tick_s, startup_s)
    sim.run()
    served, ledger = account(sim.done, block_size, retention, prices or Prices())
    start = trace[0].arrival_s if trace else 0.0
    makespan = max([end for _, end in sim.done] + [sim.last_work_s]) - start if trace else 0.0
    res = {
        "policy": policy_name, "profile": prof.name, "workers": num_workers, "prefill_workers": prefill_workers,
        "kv_capacity_blocks": kv_capacity_blocks, "tier_dram_blocks": tier_dram_blocks,
        "tier_ssd_blocks": tier_ssd_blocks, "retention": retention, "seed": seed, "speed": speed,
        "ttft_slo_s": ttft_slo_s, "tpot_slo_s": tpot_slo_s, "requests": len(trace), "served": len(sim.done),
        "rejected": sim.rejected, "preemptions": sim.preemptions, "distinct_blocks": ndist,
        **served_metrics(served, len(trace), makespan, ttft_slo_s, tpot_slo_s),
    }
    if assigned is not None:
        res["classes_on"] = classes.on
        res["classes"] = class_metrics(classes, assigned, [(r.pos, s.ttft_s, s.tpot_s)
                                                           for (r, _), s in zip(sim.done, served)])
    ideal = ideal_hit_rate(trace)
    hit = sim.hit_blocks / sim.total_blocks if sim.total_blocks else 0.0
    if elastic is not None and elastic.resized:
        gpu_hours = elastic.worker_seconds(start + makespan) * prof.gpus_per_worker / 3600.0
    else:
        gpu_hours = len(sim.workers) * prof.gpus_per_worker * makespan / 3600.0
    revenue = ledger.prices.cost(ledger.total.cached_tokens, ledger.total.uncached_tokens, ledger.total.output_tokens)
    res.update({
        "hit_rate": round(hit, 6), "local_hit_rate": round(sim.local_blocks / max(1, sim.total_blocks), 6),
        "ideal_hit_rate": round(ideal, 6), "hit_vs_ideal": round(hit / ideal, 6) if ideal else None,
        "tier_hit_blocks": dict(sim.tier_hits), "tier": tier.counters() if tier.enabled else {},
        "gpu_hours": round(gpu_hours, 6), "revenue": round(revenue, 6),
        "revenue_per_gpu_hour": round(revenue / gpu_hours, 6) if gpu_hours else 0.0,
        "accounting": ledger.as_dict(),
        "economics": (economics or Economics()).summary(ledger.total, ledger.prices, gpu_hours),
    })
    if elastic is not None:
        res["tick_s"], res["startup_s"] = tick_s, startup_s
        res.update(elastic.results())
    res["_served_idx"] = [r.tr.idx for r, _ in sim.done]  # in completion order; left out of json_line
    if timings is not None:
        timings.update(wall_s=time.perf_counter() - wall0, view_s=sim.view_s, place_s=sim.place_s,
                       placements=len(trace))
    return res
